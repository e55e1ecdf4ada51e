"""Logit bias, log-probabilities and grammar-constrained decoding with the bundled pair: the ops,
the step on fake tensors, the engine (tree mode against plain decoding, log-probabilities
against transformers' logits), and the server in this process (raw httpx and the official
openai client): `response_format` `json_schema`, `tool_choice` "required" and named,
`parallel_tool_calls`, `logit_bias`, `logprobs` / `top_logprobs`, `echo`, `n`."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import pytest
import torch

pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

from engine import LLM, SamplingParams  # noqa: E402
from engine.grammar import Grammars, json_schema_grammar, tool_call_grammar  # noqa: E402
from engine.llm import DEFAULT_MODEL  # noqa: E402
from engine.serve.app import build_app  # noqa: E402
from engine.spec import StepBuffers, StepShape, spec_step  # noqa: E402
from engine.toolcalls import parse_output  # noqa: E402
from ops.logits import add_bias_, allowed_tokens, emitted_logprobs, mask_  # noqa: E402
from ops.sampling import race_noise, sample_from_probs  # noqa: E402
from tests.fakeguard import run_on_fake  # noqa: E402
from tests.test_serve import serving  # noqa: E402

PROMPTS = ["def main():\n", "class Config:\n"]
# Every field bounded, so even the bundled toy model's answers end within max_tokens.
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "color": {"enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
    "required": ["name", "age", "color", "tags"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}},
]
ASK = [{"role": "user", "content": "def main():"}]
KW = {"compile": "off", "max_model_len": 512, "progress": False}


@pytest.fixture(scope="module")
def tree() -> LLM:
    return LLM(mode="tree", budget=8, max_batch_size=8, **KW)


@pytest.fixture(scope="module")
def ar() -> LLM:
    return LLM(mode="ar", max_batch_size=8, **KW)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    """The bundled pair served in this process (its own engine: the server's step thread owns
    its scheduler)."""
    with serving(build_app(LLM(mode="tree", budget=8, max_batch_size=8, **KW),
                           "kimi-mini")) as base:
        yield base


def _post(base: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(base + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


# ---- ops and the step ------------------------------------------------------------------------


def test_bias_mask_and_logprob_ops() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 70, generator=g)
    raw = logits.clone()
    ids = torch.tensor([[5, 69, 0], [7, 0, 0]])
    vals = torch.tensor([[2.0, -100.0, 0.0], [1.5, 0.0, 0.0]])
    add_bias_(logits, ids, vals)
    want = raw.clone()
    want[0, :, 5] += 2
    want[0, :, 69] -= 100
    want[1, :, 7] += 1.5
    assert torch.equal(logits, want)
    allowed = torch.zeros(70, dtype=torch.bool)
    allowed[[0, 31, 32, 63, 64, 69]] = True
    words = torch.tensor([sum(1 << b for b in range(32) if allowed[w * 32 + b]) if w < 2 else
                          sum(1 << b for b in range(6) if allowed[64 + b]) for w in range(3)],
                         dtype=torch.int64).to(torch.int32)  # bit 31 set: a negative word
    bits = torch.stack([words, torch.full_like(words, -1)])
    assert torch.equal(allowed_tokens(bits, 70)[0], allowed)
    assert allowed_tokens(bits, 70)[1].all()
    root = logits[:, 0]
    mask_(root, bits)
    assert torch.isinf(logits[0, 0, ~allowed]).all() and torch.isfinite(logits[1]).all()
    nodes = torch.tensor([[0, 2], [1, -1]])
    tokens = torch.tensor([[31, 3], [4, -1]])
    tok, top, top_ids = emitted_logprobs(logits, nodes, tokens, 4, ids, vals)
    masked = raw.clone()
    masked[0, 0, ~allowed] = float("-inf")
    ref = torch.log_softmax(masked, -1)
    assert torch.allclose(tok[0], torch.stack([ref[0, 0, 31], ref[0, 2, 3]]), atol=1e-5)
    assert torch.allclose(tok[1, 0], ref[1, 1, 4], atol=1e-5)
    assert torch.equal(top_ids[0, 1], ref[0, 2].topk(4).indices)
    assert torch.allclose(top[0, 1], ref[0, 2].topk(4).values, atol=1e-5)


def test_a_token_ruled_out_never_wins_the_race() -> None:
    """This coin hashes token 394 to the top of the race's 24-bit range, whose uniform rounds
    to 1.0 in float32: its exponential must stay above 0, or 0 / 0 (a masked token) is NaN and
    wins the argmax (a grammar run at temperature 1 found it). The Triton kernel agrees."""
    probs = torch.zeros(2, 3072)
    probs[:, 95] = 1.0
    coins = torch.tensor([0.9450247883796692, 0.5])
    assert race_noise(coins, 3072)[0, 394] > 0
    assert sample_from_probs(probs, coins).tolist() == [95, 95]
    if importlib.util.find_spec("triton") is not None:
        from ops.sampling_triton import race_sample_triton

        assert race_sample_triton(probs, coins, block=1024).tolist() == [95, 95]


@pytest.mark.parametrize(("mode", "sample"), [("tree", False), ("tree", True), ("ar", True)],
                         ids=["tree-greedy", "tree-sample", "ar-sample"])
def test_adjusting_step_runs_on_fake_tensors(tree: LLM, mode: str, sample: bool) -> None:
    """Bias, root mask, the cut of grammar rows' trees and the log-probabilities: no host sync
    and no data-dependent shape (so a captured graph can hold them)."""
    models = tree.models
    shape = StepShape(mode, 8, 8, sample, adjust=True, logprobs=True)
    pool = models.kv_pool(16, 8)
    buf = StepBuffers.allocate(3, 4, shape, models.target, "cpu").fit(shape)
    buf.cache_len.fill_(5)
    buf.page_table[:, :1] = torch.arange(1, 4)[:, None]
    buf.plain[1] = True
    run_on_fake(spec_step, models, pool, buf, shape)


# ---- logit bias ------------------------------------------------------------------------------


def test_logit_bias_steers_the_greedy_tree(tree: LLM) -> None:
    plain = tree.generate(PROMPTS, SamplingParams(max_new_tokens=8, ignore_eos=True))
    first = plain[0].token_ids[0]
    banned = tree.generate(PROMPTS[:1], SamplingParams(max_new_tokens=8, ignore_eos=True,
                                                       logit_bias=((first, -100.0),)))[0]
    assert first not in banned.token_ids
    forced = tree.generate(PROMPTS, [SamplingParams(max_new_tokens=8, ignore_eos=True,
                                                    logit_bias=((500, 100.0),)),
                                     SamplingParams(max_new_tokens=8, ignore_eos=True)])
    assert forced[0].token_ids == [500] * 8
    assert forced[1].token_ids == plain[1].token_ids  # a row without bias is untouched


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_tree_equals_plain_decoding_with_bias_and_logprobs(tree: LLM, ar: LLM,
                                                           sampled: bool) -> None:
    """The tree verifies against the biased target: the tokens are plain decoding's, and so
    are their log-probabilities (those of the unbiased target)."""
    sampling = {"temperature": 0.9, "seed": 11} if sampled else {}
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=3,
                             logit_bias=((262, 4.0), (258, -3.0)), **sampling),
              SamplingParams(max_new_tokens=12, ignore_eos=True, **sampling)]
    a, b = tree.generate(PROMPTS, params), ar.generate(PROMPTS, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert a[1].logprobs is None
    assert [x.token for x in a[0].logprobs] == a[0].token_ids
    for x, y in zip(a[0].logprobs, b[0].logprobs, strict=True):
        assert abs(x.logprob - y.logprob) < 1e-4
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert max(abs(u - v) for (_, u), (_, v) in zip(x.top, y.top)) < 1e-4


def test_logprobs_equal_transformers_log_softmax(tree: LLM) -> None:
    """Greedy tokens' and prompt tokens' log-probabilities are transformers' log-softmax of
    `DeepseekV3ForCausalLM`'s logits over the same prefix (one forward over prompt + output)."""
    from transformers import DeepseekV3ForCausalLM

    out = tree.generate(PROMPTS[:1], SamplingParams(max_new_tokens=10, ignore_eos=True,
                                                    logprobs=5, prompt_logprobs=2))[0]
    ids = out.prompt_token_ids + out.token_ids
    hf = DeepseekV3ForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1)
    n = len(out.prompt_token_ids)
    assert out.prompt_logprobs[0] is None
    for pos, lp in enumerate([*out.prompt_logprobs[1:], *out.logprobs], start=1):
        assert lp.token == ids[pos]
        assert abs(lp.logprob - ref[pos - 1, ids[pos]].item()) < 1e-3, pos
        k = len(lp.top)
        assert k == (2 if pos < n else 5)
        assert [t for t, _ in lp.top] == ref[pos - 1].topk(k).indices.tolist()
    assert all(x.top[0][0] == x.token for x in out.logprobs)  # greedy: the top token


# ---- grammars in the engine ------------------------------------------------------------------


def test_grammar_rows_decode_plainly_beside_drafting_rows(tree: LLM, ar: LLM) -> None:
    """A constrained row emits one token a step (its root's masked draw) while an unconstrained
    row in the same steps keeps its tree; the constrained tokens are plain decoding's under the
    same mask, and the first token (from the prefill) is masked too."""
    grammar = json_schema_grammar(PERSON)
    params = [SamplingParams(max_new_tokens=120, temperature=1.0, seed=3, grammar=grammar),
              SamplingParams(max_new_tokens=40, ignore_eos=True)]
    a, b = tree.generate(PROMPTS, params), ar.generate(PROMPTS, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert a[0].finish_reason == "stop" and a[0].text.startswith("{")
    jsonschema.validate(json.loads(a[0].text), PERSON)
    assert set(a[0].accept_lengths) == {1}
    assert max(a[1].accept_lengths) > 1


def test_tool_grammar_output_parses_into_a_given_call(tree: LLM) -> None:
    """The bundled tokenizer has no tool-call special tokens: the markers are text, and the
    output still parses (engine.toolcalls.parse_output) into calls of the given tools: one
    call without parallel calls; with them (here only `get_weather`'s) one or more, the toy
    model may go on calling until max_tokens, every finished call well-formed."""
    tok = tree.tokenizer
    one = tool_call_grammar(tok, TOOLS, parallel=False)
    named = tool_call_grammar(tok, TOOLS[:1])
    outs = tree.generate(["def main():\n"] * 6, [
        SamplingParams(max_new_tokens=200 if g is one else 60, temperature=1.0, seed=s,
                       grammar=g) for s, g in enumerate([one] * 3 + [named] * 3)])
    for k, o in enumerate(outs):
        calls = parse_output(o.text, tools=TOOLS, reasoning=False).tool_calls
        assert calls and (k >= 3 or len(calls) == 1 and o.finish_reason == "stop"), o.text
        for c in calls[:-1] if o.finish_reason == "length" else calls:
            assert c.name in ({"get_weather", "get_time"} if k < 3 else {"get_weather"})
            json.loads(c.arguments)


def test_a_grammar_that_cannot_compile_is_refused(tree: LLM) -> None:
    grammars = Grammars(tree.tokenizer, tree.models.target.cfg.vocab_size)
    with pytest.raises(ValueError, match="nonsense"):
        grammars.check(json_schema_grammar({"type": "nonsense"}))
    with pytest.raises(ValueError, match="grammar"):
        tree.generate(PROMPTS[:1], SamplingParams(grammar="start: nothing_defined"))


def test_a_grammar_compiles_once_and_its_matchers_are_apart(tree: LLM,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """A grammar checked, then matched by several requests, compiles once; each matcher
    advances on its own."""
    import llguidance

    grammars = Grammars(tree.tokenizer, tree.models.target.cfg.vocab_size)
    made = []
    real = llguidance.LLMatcher

    def counting(*a: Any, **k: Any) -> Any:
        made.append(a[1])
        return real(*a, **k)

    monkeypatch.setattr(llguidance, "LLMatcher", counting)
    monkeypatch.setattr(counting, "validate_grammar_with_warnings",
                        real.validate_grammar_with_warnings, raising=False)
    g = json_schema_grammar({"type": "integer"})
    grammars.check(g)
    a, b = grammars.matcher(g), grammars.matcher(g)
    assert len(made) == 1
    digit = tree.tokenizer.encode("7")[0]
    a.consume(digit)
    assert a.mask().tolist() != b.mask().tolist()  # b still wants a first digit
    assert b.mask().tolist() == grammars.matcher(g).mask().tolist()


# ---- through the server ----------------------------------------------------------------------


def test_json_schema_answers_validate_for_20_seeds(url: str) -> None:
    """Three concurrent requests of n 7, 7 and 6 choices (seeds 0 .. 19)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}

    async def ask() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=300) as http:
            rs = await asyncio.gather(*[http.post(f"{url}/v1/chat/completions", json={
                "messages": ASK, "max_tokens": 120, "seed": seed, "n": n,
                "response_format": fmt}) for seed, n in ((0, 7), (7, 7), (14, 6))])
        for r in rs:
            assert r.status_code == 200, r.text
        return [c for r in rs for c in r.json()["choices"]]

    choices = asyncio.run(ask())
    assert len(choices) == 20
    for c in choices:
        assert c["finish_reason"] == "stop", c
        jsonschema.validate(json.loads(c["message"]["content"]), PERSON)
    assert len({c["message"]["content"] for c in choices}) > 10


def test_forced_tool_calls_through_the_server(url: str) -> None:
    body = {"messages": ASK, "tools": TOOLS, "seed": 5, "n": 3, "temperature": 1.0}
    for extra, names, most in (
            ({"tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 200},
             {"get_weather", "get_time"}, 1),
            ({"tool_choice": {"type": "function", "function": {"name": "get_time"}},
              "max_tokens": 60}, {"get_time"}, None)):
        r = _post(url, "/v1/chat/completions", {**body, **extra})
        assert len(r["choices"]) == 3
        for c in r["choices"]:
            # with parallel calls the toy model may call until max_tokens
            assert c["finish_reason"] == "tool_calls" or most is None, c
            calls = c["message"]["tool_calls"]
            assert calls and (most is None or len(calls) <= most), c
            for call in calls:
                assert call["function"]["name"] in names
            for call in calls if c["finish_reason"] == "tool_calls" else calls[:-1]:
                json.loads(call["function"]["arguments"])


def test_openai_parse_with_a_pydantic_model(url: str) -> None:
    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=12)
        age: int = pydantic.Field(ge=0, le=120)
        color: Literal["red", "green", "blue"]
        tags: list[str] = pydantic.Field(max_length=3)

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    r = parse(model="kimi-mini", messages=ASK, response_format=Person, max_tokens=150, seed=2,
              temperature=0.7)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and r.choices[0].finish_reason == "stop"


def test_logprobs_n_bias_and_grammar_together(url: str) -> None:
    """`n` 3 with a JSON schema, a bias and log-probabilities: three valid answers, each
    with one log-probability entry (and 2 top ones) per completion token; streamed, the same
    tokens and numbers."""
    body = {"messages": ASK, "max_tokens": 120, "seed": 9, "n": 3, "logprobs": True,
            "top_logprobs": 2, "logit_bias": {"123": 3.0},
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "person", "schema": PERSON}}}
    r = _post(url, "/v1/chat/completions", body)
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    count = 0
    for c in r["choices"]:
        jsonschema.validate(json.loads(c["message"]["content"]), PERSON)
        content = c["logprobs"]["content"]
        assert b"".join(bytes(e["bytes"]) for e in content).decode() == c["message"]["content"]
        assert all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in content)
        count += len(content)
    assert count == r["usage"]["completion_tokens"]
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True},
                      timeout=120) as s:
        assert s.status_code == 200
        events = [json.loads(line[6:]) for line in s.iter_lines()
                  if line.startswith("data: {")]
    streamed: dict[int, list[Any]] = {0: [], 1: [], 2: []}
    for ev in events:
        for c in ev["choices"]:
            streamed[c["index"]] += (c["logprobs"] or {}).get("content") or []
    assert [streamed[i] for i in range(3)] == [c["logprobs"]["content"] for c in r["choices"]]


def test_completion_logprobs_with_echo(url: str, tree: LLM) -> None:
    """The completions shape: the prompt's tokens first (the first with no log-probability),
    text offsets into the echoed text; the numbers are the engine's (`tree`)."""
    prompt = PROMPTS[0]
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 2, "echo": True,
            "ignore_eos": True}
    c = _post(url, "/v1/completions", body)["choices"][0]
    lp = c["logprobs"]
    want = tree.generate([prompt], SamplingParams(max_new_tokens=6, ignore_eos=True,
                                                  logprobs=2, prompt_logprobs=2))[0]
    n = len(want.prompt_token_ids)
    assert c["text"].startswith(prompt) and len(lp["tokens"]) == n + 6
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    got = lp["token_logprobs"][1:]
    ref = [x.logprob for x in [*want.prompt_logprobs[1:], *want.logprobs]]
    assert max(abs(u - v) for u, v in zip(got, ref, strict=True)) < 1e-5
    assert all(len(t) <= 2 for t in lp["top_logprobs"][1:])
    for tok, off in zip(lp["tokens"], lp["text_offset"]):
        assert c["text"][off:off + len(tok)] == tok
    streamed = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                      timeout=120) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])["choices"][0]
                streamed += (ch["logprobs"] or {}).get("token_logprobs") or []
    assert streamed == lp["token_logprobs"]
    one = _post(url, "/v1/completions", {"prompt": [5], "max_tokens": 2, "echo": True,
                                         "logprobs": 0})["choices"][0]["logprobs"]
    assert one["token_logprobs"][0] is None and len(one["tokens"]) == 3


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}],
      "tool_choice": "required"}, "tools"),
], ids=["schema", "tool schema"])
def test_schemas_that_cannot_be_enforced_are_named(url: str, body: dict[str, Any],
                                                   param: str) -> None:
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": ASK, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
