"""Tool calls and reasoning through the OpenAI-compatible server, with scripted model output.

A random test model cannot be made to write a tool-call section, so the answers here are
scripted: the app (`build_app`) runs in this process over a stand-in for `engine.llm.LLM` whose
scheduler is the real one, driving a runner that emits the token ids of a chosen text (queued with
`say`) a few ids per step and then `[EOS]`. uvicorn serves it on a local port from a thread, and
the official `openai` client (or raw httpx) asks. The tokenizer is the tiny model's, with its
config naming Kimi's tool-call and thinking markers at their places in the special block, as
K2-Thinking's tokenizer_config.json does, so the markers arrive as special ids, as in real
output. Its config has no chat template: the engine's fallback renders tools and thinking. Like
K2.5's template it thinks unless `thinking` is false (the prompt ends in `<think>`, so the answer
is read as reasoning first): tests of answers without reasoning ask for instant mode (INSTANT)."""

from __future__ import annotations

import itertools
import json
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from engine.config import SamplingParams  # noqa: E402
from engine.grammar import Grammars  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.runner import PrefillInputs, StepInputs  # noqa: E402
from engine.scheduler import Scheduler  # noqa: E402
from engine.serve.app import build_app  # noqa: E402
from engine.tokenizer import CONFIG_FILE, Tokenizer, write_tokenizer_files  # noqa: E402
from engine.toolcalls import (  # noqa: E402
    ARGUMENT_BEGIN,
    CALL_BEGIN,
    CALL_END,
    SECTION_BEGIN,
    SECTION_END,
    THINK_BEGIN,
    THINK_END,
)
from tests.test_serve import serving  # noqa: E402
from tools.make_tiny import NUM_SPECIAL, tiny_mergeable_ranks  # noqa: E402

ORDINARY = 768
# Offsets in the special block of the markers Kimi's configs name (K2: 163595..163599 for the
# tool-call markers; K2-Thinking: 163606 and 163607 for <think> and </think>).
MARKERS = {11: SECTION_BEGIN, 12: SECTION_END, 13: CALL_BEGIN, 14: ARGUMENT_BEGIN, 15: CALL_END,
           22: THINK_BEGIN, 23: THINK_END}
EMIT = 3  # ids per scripted step
# A scripted step's time, as a real step takes some: a reader that keeps up gets each step's
# tokens in a chunk of their own (one that falls behind gets them merged).
STEP_S = 0.01
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
ASK = [{"role": "user", "content": "Weather in Paris, and the time?"}]
# A request without thinking: K2.5's instant mode (the prompt ends in <think></think>).
INSTANT_KWARGS = {"thinking": False}
INSTANT = {"extra_body": {"chat_template_kwargs": INSTANT_KWARGS}}
WEATHER = '{"city": "Paris"}'


def _call(name: str, i: int, args: str) -> str:
    return f"{CALL_BEGIN}functions.{name}:{i}{ARGUMENT_BEGIN}{args}{CALL_END}"


TWO_CALLS = (f"Let me check.{SECTION_BEGIN}{_call('get_weather', 0, WEATHER)}"
             f"{_call('get_time', 1, '{}')}{SECTION_END}")


# ---- the scripted engine -----------------------------------------------------------------------


@dataclass
class _Shape:
    max_emit: int = EMIT + 1
    drafts: bool = False


class ScriptedRunner:
    """The runner interface of `engine.scheduler.Scheduler`: each new request takes the next
    queued script and emits it, EMIT ids per step after its first, then [EOS]. A request is
    known by its first KV page."""

    shape = _Shape()

    def __init__(self, eos: int):
        self.eos = eos
        self.scripts: deque[list[int]] = deque()
        self.rows: dict[int, Iterator[int]] = {}

    def coins_per_row(self, b: int) -> int:
        return 1

    def step_shape(self, b: int, params: list, lagging: bool = False) -> _Shape:
        return self.shape

    def prefill(self, inps: list[PrefillInputs]) -> list[int | None]:
        assert all(inp.params is not None for inp in inps), "scripted requests are never preempted"
        firsts: list[int | None] = []
        for inp in inps:
            it = self.rows[inp.pages[0]] = iter(self.scripts.popleft())
            firsts.append(next(it, self.eos))
        return firsts

    def capture(self, progress: bool = True, lagging: bool = False) -> None:
        """Nothing to capture: the server calls it before serving."""

    def step(self, inp: StepInputs, pad: bool = False) -> tuple[list[list[int]], list[int]]:
        time.sleep(STEP_S)
        out = [list(itertools.islice(self.rows[p[0]], EMIT)) or [self.eos] for p in inp.pages]
        return out, [len(o) - 1 for o in out]


class ScriptedLLM:
    """What the server uses of `engine.llm.LLM`, over the real scheduler and a scripted
    runner."""

    max_model_len = 512

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.runner = ScriptedRunner(tokenizer.special_id("[EOS]"))
        self.scheduler = Scheduler(
            self.runner, num_pages=80, page_size=16, vocab_size=tokenizer.vocab_size,
            max_batch_size=4, max_model_len=self.max_model_len, stop_ids=tokenizer.stop_ids,
            decoder=lambda: tokenizer.stream_decoder(skip_special_tokens=True),
            grammars=Grammars(tokenizer, tokenizer.vocab_size),
            # NOTE: scripts are handed out in prefill order, whatever the prompt: a prefix
            # cache (which holds back a prompt's copies one step) would reorder them
            prefix_caching=False)
        self.timer = SimpleNamespace(totals={})
        self._rids = itertools.count()

    def make_request(self, prompt_ids: list[int], params: SamplingParams) -> Request:
        return Request(next(self._rids), list(prompt_ids), params)

    def say(self, text: str) -> list[int]:
        """Queues the answer of the next request: `text`, markers as special ids."""
        ids = self.tokenizer.encode(text, allow_special=True)
        self.runner.scripts.append(ids)
        return ids


# ---- fixtures ----------------------------------------------------------------------------------


def kimi_tokenizer_dir(out: Path) -> Path:
    """The tiny model's tokenizer files, the config naming the tool-call and thinking markers
    and shipping no chat template."""
    write_tokenizer_files(out, tiny_mergeable_ranks(ORDINARY), num_reserved_special=NUM_SPECIAL)
    config = json.loads((out / CONFIG_FILE).read_text())
    for offset, name in MARKERS.items():
        config["added_tokens_decoder"][str(ORDINARY + offset)]["content"] = name
    del config["chat_template"]
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return out


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    tok = Tokenizer.from_dir(kimi_tokenizer_dir(tmp_path_factory.mktemp("kimi-tok")))
    assert tok.special_tokens[SECTION_BEGIN] == ORDINARY + 11
    assert tok.special_tokens[THINK_END] == ORDINARY + 23
    return tok


@pytest.fixture(scope="module")
def served(tokenizer: Tokenizer) -> Iterator[tuple[ScriptedLLM, str]]:
    llm = ScriptedLLM(tokenizer)
    with serving(build_app(llm, "scripted"), timeout=30) as url:  # type: ignore[arg-type]
        yield llm, url


@pytest.fixture
def llm(served: tuple[ScriptedLLM, str]) -> Iterator[ScriptedLLM]:
    yield served[0]
    assert not served[0].runner.scripts, "a script was left unread"


@pytest.fixture(scope="module")
def url(served: tuple[ScriptedLLM, str]) -> str:
    return served[1]


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)


def _stream(client: openai.OpenAI, **kw: Any) -> tuple[list[Any], str | None]:
    """The deltas of a streamed chat answer and its finish reason."""
    deltas, reason = [], None
    for ev in client.chat.completions.create(model="scripted", stream=True, **kw):
        for ch in ev.choices:
            deltas.append(ch.delta)
            reason = ch.finish_reason or reason
    return deltas, reason


def _joined(deltas: list[Any], field: str) -> str:
    return "".join(getattr(d, field, None) or "" for d in deltas)


def _merged_calls(deltas: list[Any]) -> list[dict[str, Any]]:
    """Streamed tool calls put together as a client does, checking OpenAI's delta shape: a
    call's first delta has its index, id, type and name; later ones the index and arguments."""
    calls: list[dict[str, Any]] = []
    for d in deltas:
        for c in d.tool_calls or []:
            if c.index == len(calls):
                assert c.id and c.type == "function" and c.function.name
                calls.append({"id": c.id, "name": c.function.name, "arguments": ""})
            else:
                assert c.index == len(calls) - 1 and c.id is None and c.function.name is None
            calls[c.index]["arguments"] += c.function.arguments or ""
    return calls


# ---- tool calls --------------------------------------------------------------------------------


def test_tool_calls_non_streamed(llm: ScriptedLLM, client: openai.OpenAI) -> None:
    llm.say(TWO_CALLS)
    r = client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, **INSTANT)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content == "Let me check."
    assert [(c.id, c.type, c.function.name, c.function.arguments)
            for c in ch.message.tool_calls] == [
        ("functions.get_weather:0", "function", "get_weather", WEATHER),
        ("functions.get_time:1", "function", "get_time", "{}")]
    assert json.loads(ch.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert getattr(ch.message, "reasoning_content", None) is None
    # the tools reached the prompt: the fallback template declares them in a first turn,
    # TypeScript-style as K2.5 does
    assert r.usage.prompt_tokens == len(llm.tokenizer.apply_chat_template(
        ASK, tools=TOOLS, **INSTANT_KWARGS))
    prompt = llm.tokenizer.render_chat_template(ASK, tools=TOOLS, **INSTANT_KWARGS)
    assert prompt.startswith("<|im_system|>tool_declare<|im_middle|># Tools")
    assert "namespace functions {" in prompt and "type get_time = " in prompt


def test_tool_calls_streamed(llm: ScriptedLLM, client: openai.OpenAI) -> None:
    llm.say(TWO_CALLS)
    deltas, reason = _stream(client, messages=ASK, tools=TOOLS, tool_choice="auto", **INSTANT)
    assert reason == "tool_calls"
    assert deltas[0].role == "assistant"
    assert _joined(deltas, "content") == "Let me check."
    assert _merged_calls(deltas) == [
        {"id": "functions.get_weather:0", "name": "get_weather", "arguments": WEATHER},
        {"id": "functions.get_time:1", "name": "get_time", "arguments": "{}"}]
    # the arguments came in pieces, as generated (EMIT ids per step)
    assert sum(1 for d in deltas for c in d.tool_calls or [] if c.id is None) > 2


def test_tool_calls_after_reasoning_without_think_end(llm: ScriptedLLM,
                                                      client: openai.OpenAI) -> None:
    """K2.5 thinking mode: the prompt ends in <think>; reasoning may end at the section."""
    kw = {"messages": ASK, "tools": TOOLS, "extra_body": {"chat_template_kwargs": {
        "thinking": True}}}
    assert llm.tokenizer.render_chat_template(ASK, tools=TOOLS, thinking=True).endswith(
        THINK_BEGIN)
    text = f"I need the weather.{SECTION_BEGIN}{_call('get_weather', 0, WEATHER)}{SECTION_END}"
    llm.say(text)
    m = client.chat.completions.create(model="scripted", **kw).choices[0].message
    assert m.reasoning_content == "I need the weather."
    assert m.content is None
    assert [(c.function.name, c.function.arguments) for c in m.tool_calls] == [
        ("get_weather", WEATHER)]
    llm.say(text)
    deltas, reason = _stream(client, **kw)
    assert reason == "tool_calls"
    assert _joined(deltas, "reasoning_content") == "I need the weather."
    assert _joined(deltas, "content") == ""
    assert [c["name"] for c in _merged_calls(deltas)] == ["get_weather"]


def test_named_tool_choice_returns_only_that_function(llm: ScriptedLLM, url: str,
                                                      client: openai.OpenAI) -> None:
    """A forced call is a grammar the scheduler's matcher follows token by token (the scripted
    runner ignores its masks): Kimi's section with special-token markers passes it, after the
    reasoning of a thinking prompt too, and the streamed and whole answers carry the call."""
    choice = {"type": "function", "function": {"name": "get_time"}}
    section = f"{SECTION_BEGIN}{_call('get_time', 1, '{}')}{SECTION_END}"
    llm.say(section)
    r = client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS,
                                       tool_choice=choice, **INSTANT)
    assert r.choices[0].finish_reason == "tool_calls"
    assert [(c.id, c.function.name) for c in r.choices[0].message.tool_calls] == [
        ("functions.get_time:1", "get_time")]
    llm.say(f"The time, then.{THINK_END}{section}")
    deltas, _ = _stream(client, messages=ASK, tools=TOOLS, tool_choice=choice)
    assert _merged_calls(deltas) == [
        {"id": "functions.get_time:1", "name": "get_time", "arguments": "{}"}]
    assert _joined(deltas, "reasoning_content") == "The time, then."
    llm.say(f"{SECTION_BEGIN}{_call('get_weather', 0, WEATHER)}"
            f"{_call('get_time', 1, '{}')}{SECTION_END}")
    r = client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS,
                                       tool_choice="required", **INSTANT)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather",
                                                                         "get_time"]
    r2 = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
        "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {
            "name": "get_news"}}})
    assert r2.status_code == 400, r2.text
    assert r2.json()["error"]["param"] == "tool_choice"


def test_json_response_format_beside_tools(llm: ScriptedLLM, client: openai.OpenAI) -> None:
    """With tools the model may call, a JSON response format allows the JSON answer or a call
    (the scheduler's matcher follows every scripted token)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}}}
    llm.say(WEATHER)
    llm.say(f"{SECTION_BEGIN}{_call('get_weather', 0, WEATHER)}{SECTION_END}")
    answers = [client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS,
                                              response_format=fmt, **INSTANT).choices[0]
               for _ in range(2)]
    assert (answers[0].finish_reason, answers[0].message.content) == ("stop", WEATHER)
    assert answers[1].finish_reason == "tool_calls"
    assert answers[1].message.tool_calls[0].function.arguments == WEATHER


def test_tool_choice_none_leaves_the_answer_as_text(llm: ScriptedLLM,
                                                    client: openai.OpenAI) -> None:
    ids = llm.say(TWO_CALLS)
    r = client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS,
                                       tool_choice="none", **INSTANT)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == llm.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize(("text", "content", "calls", "reason"), [
    (f"Hmm.{SECTION_BEGIN}{CALL_BEGIN}get weather now{ARGUMENT_BEGIN}{{}}{CALL_END}{SECTION_END}",
     "Hmm.", [], "stop"),
    (f"{SECTION_BEGIN}{SECTION_END}after", "after", [], "stop"),
    # K2.5 may open a call without the section
    (f"x{CALL_BEGIN}functions.get_time:0{ARGUMENT_BEGIN}{{}}{CALL_END}", "x",
     [{"id": "functions.get_time:0", "name": "get_time", "arguments": "{}"}], "tool_calls"),
    (f"{SECTION_BEGIN}{CALL_BEGIN}functions.get_time:0", "", [], "stop"),  # ends inside the id
], ids=["bad id", "empty section", "no section", "cut id"])
def test_malformed_calls_are_dropped_and_no_marker_reaches_content(
        llm: ScriptedLLM, client: openai.OpenAI, text: str, content: str,
        calls: list[dict[str, str]], reason: str) -> None:
    """A malformed call is dropped (its well-formed neighbours are kept) and the tool-call
    markers never reach the content, streamed or not."""
    llm.say(text)
    r = client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, **INSTANT)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == reason
    assert m.content == content
    assert [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in m.tool_calls or []] == calls
    assert (m.tool_calls is None) == (not calls)
    llm.say(text)
    deltas, stream_reason = _stream(client, messages=ASK, tools=TOOLS, **INSTANT)
    assert (_joined(deltas, "content"), _merged_calls(deltas), stream_reason) == (
        content, calls, reason)


def test_a_call_cut_by_max_tokens(llm: ScriptedLLM, client: openai.OpenAI) -> None:
    ids = llm.say(TWO_CALLS)
    cut = ids.index(llm.tokenizer.special_tokens[ARGUMENT_BEGIN]) + 3
    r = client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS,
                                       max_tokens=cut)
    assert r.choices[0].finish_reason == "length"
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert WEATHER.startswith(call.function.arguments) and call.function.arguments


# ---- reasoning ---------------------------------------------------------------------------------


def test_reasoning_content(llm: ScriptedLLM, client: openai.OpenAI) -> None:
    thinking = {"extra_body": {"chat_template_kwargs": {"thinking": True}}}
    # thinking asked for, then by default (the fallback thinks unless told not to, like K2.5):
    # the prompt opens <think>, and a <think> the model writes again is dropped
    for text, kw in [(f"Paris is in France.{THINK_END}It is sunny.", thinking),
                     (f"{THINK_BEGIN}Paris is in France.{THINK_END}It is sunny.", {})]:
        llm.say(text)
        m = client.chat.completions.create(model="scripted", messages=ASK, **kw).choices[0]
        assert (m.message.reasoning_content, m.message.content) == (
            "Paris is in France.", "It is sunny.")
        assert m.finish_reason == "stop"
        llm.say(text)
        deltas, reason = _stream(client, messages=ASK, **kw)
        assert _joined(deltas, "reasoning_content") == "Paris is in France."
        assert _joined(deltas, "content") == "It is sunny."
        # reasoning streams before the answer, each in its own field
        r_at = [i for i, d in enumerate(deltas) if getattr(d, "reasoning_content", None)]
        c_at = [i for i, d in enumerate(deltas) if d.content]
        assert len(r_at) > 1 and c_at and max(r_at) <= min(c_at)


def test_thinking_off_reads_no_reasoning(llm: ScriptedLLM, client: openai.OpenAI) -> None:
    kw = {"extra_body": {"chat_template_kwargs": {"thinking": False}}}
    assert llm.tokenizer.render_chat_template(ASK, thinking=False).endswith(
        THINK_BEGIN + THINK_END)
    llm.say(f"{THINK_BEGIN}a{THINK_END}b")
    m = client.chat.completions.create(model="scripted", messages=ASK, **kw).choices[0].message
    assert (getattr(m, "reasoning_content", None), m.content) == (None, "ab")


def test_a_stop_string_cuts_reasoning(llm: ScriptedLLM, client: openai.OpenAI) -> None:
    """Stop strings match the text without special ids: "ng A" spans </think> here."""
    kw = {"messages": ASK, "stop": ["ng A"], "extra_body": {"chat_template_kwargs": {
        "thinking": True}}}
    llm.say(f"Thinking{THINK_END} Answer")
    m = client.chat.completions.create(model="scripted", **kw).choices[0]
    assert (m.message.reasoning_content, m.message.content, m.finish_reason) == (
        "Thinki", "", "stop")
    llm.say(f"Thinking{THINK_END} Answer")
    deltas, reason = _stream(client, **kw)
    assert (_joined(deltas, "reasoning_content"), _joined(deltas, "content")) == ("Thinki", "")


# ---- plain answers and requests ----------------------------------------------------------------


def test_plain_answers_have_no_new_fields(llm: ScriptedLLM, url: str) -> None:
    """Without tools or reasoning markers an answer is the text without special ids, in the
    same body as ever: no `reasoning_content`, no `tool_calls` keys, streamed or not."""
    text = f"Hello <|tool_call_begin|> there.{SECTION_BEGIN}<|reserved_token_{ORDINARY + 40}|>"
    for body in ({"messages": ASK, "chat_template_kwargs": INSTANT_KWARGS},
                 {"messages": ASK, "tools": TOOLS, "chat_template_kwargs": INSTANT_KWARGS}):
        ids = llm.say(text if "tools" not in body else "Just text.")
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30).json()
        assert r["choices"][0]["message"] == {
            "role": "assistant", "content": llm.tokenizer.decode(ids, skip_special_tokens=True)}
        assert r["choices"][0]["finish_reason"] == "stop"
        llm.say(text)
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True},
                          timeout=30) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines()
                      if line.startswith("data: {")]
        assert all(set(c["choices"][0]["delta"]) == {"role", "content"} for c in chunks)
        if "tools" not in body:
            assert "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks) == \
                r["choices"][0]["message"]["content"]


def test_a_tool_conversation_renders(llm: ScriptedLLM, client: openai.OpenAI) -> None:
    """The second turn of a tool call, thinking (the default): the assistant's calls (as the
    client got them), its reasoning and the tool's result go back to the template."""
    llm.say(f"Weather first.{THINK_END}{TWO_CALLS}")
    first = client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS)
    assert (first.choices[0].message.reasoning_content,
            first.choices[0].message.content) == ("Weather first.", "Let me check.")
    calls = [c.model_dump() for c in first.choices[0].message.tool_calls]
    history: list[dict[str, Any]] = [
        *ASK,
        {"role": "assistant", "content": "Let me check.", "tool_calls": calls,
         "reasoning_content": "weather first"},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "22 C"},
        {"role": "tool", "tool_call_id": calls[1]["id"], "content": "noon"},
    ]
    llm.say(f"Both known.{THINK_END}It is 22 C at noon.")
    r = client.chat.completions.create(model="scripted", messages=history, tools=TOOLS)
    assert r.choices[0].message.content == "It is 22 C at noon."
    assert r.choices[0].message.reasoning_content == "Both known."
    want = llm.tokenizer.apply_chat_template(history, tools=TOOLS)
    assert r.usage.prompt_tokens == len(want)
    prompt = llm.tokenizer.render_chat_template(history, tools=TOOLS)
    # the tool loop in progress keeps its reasoning; the answer opens <think>
    assert f"{THINK_BEGIN}weather first{THINK_END}Let me check.{SECTION_BEGIN}" in prompt
    assert "## Return of functions.get_weather:0\n22 C" in prompt
    assert _call("get_time", 1, "{}") in prompt
    assert prompt.endswith(THINK_BEGIN)
    # the message object itself, as clients append it
    llm.say(f"{THINK_END}ok")
    r = client.chat.completions.create(
        model="scripted", tools=TOOLS,
        messages=[*ASK, first.choices[0].message, *history[2:]])  # type: ignore[list-item]
    assert r.choices[0].message.content == "ok"


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("tools not a list", {"tools": TOOLS[0]}, "tools"),
    ("tool without function", {"tools": [{"type": "function"}]}, "tools"),
    ("tool of another type", {"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools"),
    ("function name with a space", {"tools": [{"type": "function", "function": {
        "name": "get weather"}}]}, "tools"),
    ("unknown tool field", {"tools": [{"type": "function", "function": {"name": "f",
                                                                         "x": 1}}]}, "tools"),
    ("tool_choice without tools", {"tool_choice": {"type": "function", "function": {
        "name": "f"}}}, "tool_choice"),
    ("tool_choice required without tools", {"tool_choice": "required"}, "tool_choice"),
    ("template kwargs not a dict", {"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ("template kwarg not a name", {"chat_template_kwargs": {"a b": 1}}, "chat_template_kwargs"),
    *[(f"template kwarg {k}", {"chat_template_kwargs": {k: 1}}, "chat_template_kwargs")
      for k in ("tools", "messages", "self", "add_generation_prompt")],
    ("tool call without function", {"messages": [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}]}, "messages"),
    ("tool_call_id not a string", {"messages": [
        {"role": "tool", "content": "x", "tool_call_id": 3}]}, "messages"),
    ("tool_calls on a user message", {"messages": [{"role": "user", "content": "x",
        "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]}, "messages"),
]


@pytest.mark.parametrize(("name", "body", "param"), BAD, ids=[b[0] for b in BAD])
def test_bad_tool_requests(url: str, name: str, body: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": ASK, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert param in err["message"], err
