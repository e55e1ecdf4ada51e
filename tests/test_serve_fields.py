"""The OpenAI fields agent frameworks send, through the server: `parallel_tool_calls`, `n`
(streamed and not, seeded), vLLM's `/tokenize` and `/detokenize`, and the 400s that name what
is not supported or out of range (tests/test_structured.py has what the engine enforces:
`response_format`, `tool_choice` "required", `logit_bias`, `logprobs`).

Tool calls use the scripted engine of tests/test_serve_tools.py (the app over the real
scheduler, a runner emitting queued texts); sampling uses the tiny random model in process, as
tests/test_serve_robust.py does. Only 127.0.0.1 is contacted."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from engine.config import SamplingParams  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.serve import ServeConfig  # noqa: E402
from engine.serve.app import build_app, choice_params, choice_seed  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from tests.test_serve import MAX_LEN, _ids, serving  # noqa: E402
from tests.test_serve_tools import (  # noqa: E402
    ARGUMENT_BEGIN,
    ASK,
    CALL_BEGIN,
    CALL_END,
    INSTANT,
    INSTANT_KWARGS,
    SECTION_BEGIN,
    SECTION_END,
    TOOLS,
    TWO_CALLS,
    WEATHER,
    ScriptedLLM,
    _call,
    _joined,
    _merged_calls,
    _stream,
    client,  # noqa: F401 - fixtures
    llm,  # noqa: F401
    served,  # noqa: F401
    tokenizer,  # noqa: F401
    url,  # noqa: F401
)
from tools.make_draft import make_draft  # noqa: E402
from tools.make_tiny import make_tiny  # noqa: E402


def _post(base: str, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=60, **kw)


def _sse(base: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


# ---- parallel_tool_calls -----------------------------------------------------------------------


def test_parallel_tool_calls_false_returns_one_call(llm: ScriptedLLM,  # noqa: F811
                                                    client: openai.OpenAI) -> None:  # noqa: F811
    for parallel, want in ((True, ["get_weather", "get_time"]), (False, ["get_weather"])):
        llm.say(TWO_CALLS)
        r = client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS,
                                           parallel_tool_calls=parallel, **INSTANT)
        ch = r.choices[0]
        assert [c.function.name for c in ch.message.tool_calls] == want
        assert (ch.message.content, ch.finish_reason) == ("Let me check.", "tool_calls")
        assert ch.message.tool_calls[0].function.arguments == WEATHER
        llm.say(TWO_CALLS)
        deltas, reason = _stream(client, messages=ASK, tools=TOOLS, parallel_tool_calls=parallel,
                                 **INSTANT)
        assert reason == "tool_calls"
        assert [c["name"] for c in _merged_calls(deltas)] == want
        assert _joined(deltas, "content") == "Let me check."  # the dropped call leaks nowhere


def test_parallel_tool_calls_false_keeps_the_first_well_formed_call(
        llm: ScriptedLLM, client: openai.OpenAI) -> None:  # noqa: F811
    text = (f"{SECTION_BEGIN}{CALL_BEGIN}get weather now{ARGUMENT_BEGIN}{{}}{CALL_END}"
            f"{_call('get_time', 1, '{}')}{_call('get_weather', 2, WEATHER)}{SECTION_END}")
    llm.say(text)
    m = client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS,
                                       parallel_tool_calls=False, **INSTANT).choices[0].message
    assert [(c.id, c.function.name) for c in m.tool_calls] == [("functions.get_time:1",
                                                                "get_time")]
    assert m.content is None
    llm.say(text)
    deltas, _ = _stream(client, messages=ASK, tools=TOOLS, parallel_tool_calls=False, **INSTANT)
    assert _merged_calls(deltas) == [{"id": "functions.get_time:1", "name": "get_time",
                                      "arguments": "{}"}]
    assert _joined(deltas, "content") == ""


def test_n_choices_with_scripted_tool_calls(llm: ScriptedLLM, url: str) -> None:  # noqa: F811
    """Each choice is its own request (here: its own script), its calls under its index."""
    llm.say(TWO_CALLS)
    llm.say("Just text.")
    body = {"messages": ASK, "tools": TOOLS, "n": 2, "parallel_tool_calls": False,
            "chat_template_kwargs": INSTANT_KWARGS}
    r = _post(url, "/v1/chat/completions", body).json()
    by_index = {c["index"]: c for c in r["choices"]}
    assert sorted(by_index) == [0, 1]
    # which request took which script depends on admission order: both answers are there
    answers = sorted((c["finish_reason"], c["message"]["content"],
                      [t["function"]["name"] for t in c["message"].get("tool_calls") or []])
                     for c in r["choices"])
    assert answers == [("stop", "Just text.", []), ("tool_calls", "Let me check.",
                                                    ["get_weather"])]


# ---- refused and accepted fields ---------------------------------------------------------------


REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    # (route, body fields, param, a word the message must hold)
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "not a name", "schema": {}}}}, "response_format", "pattern"),
    ("chat", {"tool_choice": "required"}, "tool_choice", "tools"),
    ("chat", {"tools": TOOLS, "tool_choice": "required", "response_format": {
        "type": "json_object"}}, "response_format", "tool_choice"),
    ("chat", {"n": 9}, "n", "8"),
    ("completions", {"n": 0}, "n", "n"),
    ("completions", {"n": 3, "best_of": 4}, "best_of", "n"),
    ("chat", {"logit_bias": {"12": 101}}, "logit_bias", "100"),
    ("chat", {"logit_bias": {"x": 1}}, "logit_bias", "token id"),
    ("completions", {"logit_bias": {str(10**9): 1}}, "logit_bias", "vocabulary"),
    ("chat", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "300"),
    ("chat", {"top_logprobs": 2}, "top_logprobs", "logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "20"),
    ("chat", {"logprobs": 2}, "logprobs", "bool"),
    ("completions", {"logprobs": 6}, "logprobs", "5"),
    ("completions", {"top_logprobs": 2}, "top_logprobs", "count"),
    ("chat", {"echo": True}, "echo", "completions"),
    ("chat", {"presence_penalty": 0.5}, "presence_penalty", "0"),
    ("chat", {"functions": [{"name": "f"}]}, "functions", "tools"),
    ("chat", {"reasoning_effort": "low"}, "reasoning_effort", "thinking"),
    ("chat", {"stop": ["a", "b", "c", "d", "e"]}, "stop", "4"),
    ("completions", {"response_format": {"type": "text"}}, "response_format", "chat"),
    ("completions", {"parallel_tool_calls": False}, "parallel_tool_calls", "chat"),
]


@pytest.mark.parametrize(("route", "fields", "param", "word"), REFUSED,
                         ids=[f"{r[0]} {r[2]}" for r in REFUSED])
def test_unsupported_fields_are_named(url: str, route: str, fields: dict[str, Any],  # noqa: F811
                                      param: str, word: str) -> None:
    base = {"messages": ASK} if route == "chat" else {"prompt": "x"}
    r = _post(url, f"/v1/{'chat/' if route == 'chat' else ''}completions", {**base, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and word in err["message"], err


def test_neutral_values_are_accepted(llm: ScriptedLLM, url: str) -> None:  # noqa: F811
    for extra in ({"response_format": {"type": "text"}}, {"parallel_tool_calls": True},
                  {"logit_bias": {}, "top_logprobs": 0, "logprobs": False},
                  {"n": 1, "seed": 3}):
        llm.say("ok")
        r = _post(url, "/v1/chat/completions", {"messages": ASK, **extra,
                                                "chat_template_kwargs": INSTANT_KWARGS})
        assert r.status_code == 200, (extra, r.text)
        assert r.json()["choices"][0]["message"]["content"] == "ok"


def test_choice_seeds() -> None:
    assert [choice_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert choice_seed(None, 2) is None
    assert [choice_seed(2**64 - 2, i) for i in range(3)] == [2**64 - 2, 2**64 - 1, 0]
    p = SamplingParams(temperature=0.7, seed=5)
    assert [q.seed for q in choice_params(p, 3)] == [5, 6, 7]
    assert choice_params(p, 1) == [p]
    assert [q.seed for q in choice_params(SamplingParams(), 2)] == [None, None]


# ---- /tokenize and /detokenize -----------------------------------------------------------------


def test_tokenize_a_chat_as_the_engine_feeds_it(llm: ScriptedLLM, url: str,  # noqa: F811
                                                tokenizer: Tokenizer) -> None:  # noqa: F811
    body = {"messages": ASK, "tools": TOOLS, "chat_template_kwargs": INSTANT_KWARGS}
    r = _post(url, "/tokenize", {**body, "return_prompt": True, "return_token_strs": True})
    assert r.status_code == 200, r.text
    out = r.json()
    want = tokenizer.chat.encode(ASK, TOOLS, True, **INSTANT_KWARGS)
    assert want == tokenizer.apply_chat_template(ASK, tools=TOOLS, **INSTANT_KWARGS)
    assert out["tokens"] == want and out["count"] == len(want)
    assert out["max_model_len"] == llm.max_model_len
    assert out["prompt"] == tokenizer.chat.render(ASK, TOOLS, True, **INSTANT_KWARGS)
    assert "".join(out["token_strs"]) == out["prompt"]  # ASCII text: every token whole
    # what the chat route feeds the engine: the same count
    llm.say("ok")
    usage = _post(url, "/v1/chat/completions", body).json()["usage"]
    assert usage["prompt_tokens"] == out["count"]
    # no generation prompt: the conversation without the assistant's opening
    bare = _post(url, "/tokenize", {**body, "add_generation_prompt": False}).json()
    assert bare["tokens"] == tokenizer.chat.encode(ASK, TOOLS, False, **INSTANT_KWARGS)
    assert bare["count"] < out["count"] and "prompt" not in bare and "token_strs" not in bare
    # the round trip: the ids' text, special tokens written out, is the rendered prompt
    back = _post(url, "/detokenize", {"tokens": out["tokens"]}).json()
    assert back == {"prompt": out["prompt"]}


def test_tokenize_a_text_and_detokenize(llm: ScriptedLLM, url: str,  # noqa: F811
                                        tokenizer: Tokenizer) -> None:  # noqa: F811
    text = "Héllo <|im_end|> wörld"
    for extra in ({}, {"add_special_tokens": False}, {"model": "scripted"}):
        out = _post(url, "/tokenize", {"prompt": text, **extra}).json()
        assert out == {"count": len(tokenizer.encode(text)), "tokens": tokenizer.encode(text),
                       "max_model_len": llm.max_model_len}
    # as /v1/completions feeds it: a special-token string in a text is plain text
    llm.say("ok")
    usage = _post(url, "/v1/completions", {"prompt": text}).json()["usage"]
    assert usage["prompt_tokens"] == out["count"]
    strs = _post(url, "/tokenize", {"prompt": text, "return_token_strs": True,
                                    "return_prompt": True}).json()
    assert len(strs["token_strs"]) == strs["count"] and strs["prompt"] == text
    assert _post(url, "/detokenize", {"tokens": out["tokens"]}).json() == {"prompt": text}
    assert _post(url, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
    ("/tokenize", {"prompt": "x", "temperature": 1}, 400, "temperature"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "bot", "content": "x"}]}, 400, "messages"),
    ("/tokenize", {"messages": ASK, "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/detokenize", {"tokens": [1, -3]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10**6]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
], ids=lambda v: str(v)[:40])
def test_bad_tokenize_bodies(url: str, path: str, body: dict[str, Any], status: int,  # noqa: F811
                             param: str) -> None:
    r = _post(url, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err


def test_the_api_key_covers_tokenize(llm: ScriptedLLM) -> None:  # noqa: F811
    from starlette.testclient import TestClient

    http = TestClient(build_app(llm, "scripted", config=ServeConfig(api_key="k")),
                      base_url="http://127.0.0.1")
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        assert http.post(path, json=body).status_code == 401
        assert http.post(path, json=body, headers={"Authorization": "Bearer k"}).status_code == 200
    assert http.get("/health").status_code == 200


# ---- n with the tiny model ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LLM, str]]:
    d = tmp_path_factory.mktemp("fields")
    model = make_tiny(d / "tiny", dtype="fp32")
    llm_ = LLM(model, make_draft(model, d / "tiny-dflash", layers=1, block_size=8),
               mode="tree", budget=4, max_batch_size=8, max_model_len=MAX_LEN, progress=False)
    with serving(build_app(llm_, "tiny")) as base:
        yield llm_, base


def _idle(llm_: LLM) -> None:
    sched = llm_.scheduler
    deadline = time.monotonic() + 30
    while sched.has_work and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not sched.has_work and sched.cache.available == sched.alloc.capacity


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_n_seeded_choices_equal_single_requests(real: tuple[LLM, str], chat: bool) -> None:
    llm_, url_ = real
    path = "/v1/chat/completions" if chat else "/v1/completions"
    base = ({"messages": [{"role": "user", "content": "tell me"}]} if chat
            else {"prompt": _ids(31, 9)})
    body = {**base, "max_tokens": 10, "temperature": 0.9, "seed": 1234, "ignore_eos": True}

    def text(c: dict[str, Any]) -> str:
        return c["message"]["content"] if chat else c["text"]

    alone = [text(_post(url_, path, {**body, "seed": 1234 + i}).json()["choices"][0])
             for i in range(3)]
    assert len(set(alone)) > 1, "the seeds should sample different answers"
    r = _post(url_, path, {**body, "n": 3}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert [text(c) for c in r["choices"]] == alone
    prompt = (_post(url_, "/tokenize", {"messages": base["messages"]}).json()["count"] if chat
              else len(base["prompt"]))
    # the prompt's whole pages (all but its last token's) were cached by the answers above
    assert r["usage"] == {"prompt_tokens": prompt, "completion_tokens": 30,
                          "total_tokens": prompt + 30,
                          "prompt_tokens_details": {"cached_tokens": (prompt - 1) // 16 * 16}}
    # streamed: each chunk carries its choice's index; the texts are the same
    events = _sse(url_, path, {**body, "n": 3, "stream_options": {"include_usage": True}})
    parts: dict[int, str] = {0: "", 1: "", 2: ""}
    reasons: dict[int, str] = {}
    roles = []
    for ev in events[:-1]:
        [c] = ev["choices"]
        piece = c["delta"] if chat else c
        parts[c["index"]] += (piece.get("content") if chat else piece["text"]) or ""
        if chat and piece.get("role"):
            roles.append(c["index"])
        if c["finish_reason"]:
            reasons[c["index"]] = c["finish_reason"]
    assert [parts[i] for i in range(3)] == alone
    assert reasons == {0: "length", 1: "length", 2: "length"}
    assert roles == ([0, 1, 2] if chat else [])
    assert events[-1]["choices"] == [] and events[-1]["usage"] == r["usage"]
    _idle(llm_)


def test_n_greedy_choices_are_identical(real: tuple[LLM, str]) -> None:
    llm_, url_ = real
    body = {"prompt": _ids(5, 7), "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    one = _post(url_, "/v1/completions", body).json()["choices"][0]["text"]
    r = _post(url_, "/v1/completions", {**body, "n": 4}).json()
    assert [c["text"] for c in r["choices"]] == [one] * 4
    assert r["usage"]["completion_tokens"] == 24 and r["usage"]["prompt_tokens"] == 7
    _idle(llm_)


def test_leaving_aborts_every_choice(real: tuple[LLM, str]) -> None:
    llm_, url_ = real
    body = {"prompt": _ids(8, 6), "max_tokens": MAX_LEN - 7, "temperature": 0.8, "ignore_eos": True,
            "n": 4}

    async def leave(stream: bool) -> None:
        async with httpx.AsyncClient(timeout=30) as http:
            if stream:
                async with http.stream("POST", url_ + "/v1/completions",
                                       json={**body, "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            break  # leave after the first chunk
            else:
                with pytest.raises(httpx.ReadTimeout):
                    await http.post(url_ + "/v1/completions", json=body, timeout=0.5)

    def aborted() -> float:
        for line in httpx.get(url_ + "/metrics", timeout=10).text.splitlines():
            if line.startswith('kimi_requests_finished_total{reason="abort"}'):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    for stream in (True, False):
        before = aborted()
        asyncio.run(leave(stream))
        _idle(llm_)
        assert aborted() - before == 4  # all four choices, each long past the client's leaving
