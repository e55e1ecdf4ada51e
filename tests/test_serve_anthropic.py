"""Anthropic's Messages API (`engine.serve.anthropic`), driven by the official `anthropic` SDK and
raw httpx: text, streaming events, tool use, thinking, count_tokens, errors in Anthropic's shape,
the API key, a request shaped as Claude Code sends it, and the limits the OpenAI routes have.

Sampling runs on the bundled model in process (`build_app` over an `LLM`, with an API key and a
1 s request timeout); tool calls and reasoning on the scripted engine of
tests/test_serve_tools.py (the real scheduler, a runner emitting queued texts). Only 127.0.0.1
is contacted."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

if importlib.util.find_spec("anthropic") is None:
    pytest.skip("needs the anthropic SDK", allow_module_level=True)
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from engine.llm import LLM  # noqa: E402
from engine.serve import ServeConfig  # noqa: E402
from engine.serve.anthropic import MessagesRequest, error_body, to_chat  # noqa: E402
from engine.serve.app import build_app, uvicorn_options  # noqa: E402
from tests.test_serve import serving  # noqa: E402


def sdk():
    """The anthropic SDK, imported when a test first uses it (not while collecting)."""
    import anthropic

    return anthropic
from tests.test_serve_tools import (  # noqa: E402
    SECTION_BEGIN,
    SECTION_END,
    THINK_END,
    WEATHER,
    ScriptedLLM,
    _call,
    llm,  # noqa: F401 - fixtures
    served,  # noqa: F401
    tokenizer,  # noqa: F401
    url,  # noqa: F401
)

KEY = "anthropic-key-1"
NAME = "kimi-mini"
MAX_LEN = 128
BODY_LIMIT = 256 << 10  # the bundled server's --max-body-bytes
TIMEOUT_S = 1.0  # its --request-timeout
HELLO = [{"role": "user", "content": "def fibonacci(n):"}]
TOOLS = [
    {"name": "get_weather", "description": "Weather in a city.", "input_schema": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    {"name": "get_time", "input_schema": {"type": "object", "properties": {}}},
]
ASK = [{"role": "user", "content": "Weather in Paris, and the time?"}]


# ---- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real() -> Iterator[tuple[Any, str, LLM]]:
    """The bundled model served in process, with an API key and a short request timeout: the
    app, its URL, the model."""
    bundled = LLM(progress=False, max_batch_size=4, max_model_len=MAX_LEN, warm_up=False)
    cfg = ServeConfig(api_key=KEY, request_timeout=TIMEOUT_S, max_body_bytes=BODY_LIMIT)
    app = build_app(bundled, NAME, config=cfg)
    with serving(app, **uvicorn_options(cfg)) as base:
        yield app, base, bundled


@pytest.fixture(scope="module")
def base(real: tuple[Any, str, LLM]) -> str:
    return real[1]


@pytest.fixture(scope="module")
def client(base: str) -> Any:
    return sdk().Anthropic(base_url=base, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def scripted(url: str) -> Any:  # noqa: F811 - the scripted server's URL
    return sdk().Anthropic(base_url=url, api_key="x", max_retries=0, timeout=30)


def _post(base: str, body: Any, path: str = "/v1/messages", **headers: str) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=60, headers={"x-api-key": KEY, **headers})


def _events(base: str, body: dict[str, Any], path: str = "/v1/messages",
            **headers: str) -> tuple[int, list[tuple[str, dict[str, Any]]]]:
    """A streamed answer's status and its events, each checked to be `event: NAME` then `data:
    JSON` whose type is NAME."""
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=60,
                      headers={"x-api-key": KEY, **headers}) as r:
        raw = "".join(r.iter_text())
    if r.status_code != 200:
        return r.status_code, [("", json.loads(raw))]
    assert r.headers["content-type"].startswith("text/event-stream")
    events = []
    for chunk in raw.split("\n\n")[:-1]:
        name_line, data_line = chunk.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: "), chunk
        data = json.loads(data_line[6:])
        assert data["type"] == name_line[7:], chunk
        events.append((data["type"], data))
    assert raw.endswith("\n\n")
    return r.status_code, events


def _check_order(events: list[tuple[str, dict[str, Any]]]) -> None:
    """Anthropic's order: message_start, a ping, each block's start, deltas and stop (indices
    0, 1, ...), message_delta, message_stop."""
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta",
                                                                     "message_stop"], names
    index, open_ = 0, False
    for name, data in events[2:-2]:
        if name == "content_block_start":
            assert not open_ and data["index"] == index
            open_ = True
        elif name == "content_block_delta":
            assert open_ and data["index"] == index
        else:
            assert name == "content_block_stop" and open_ and data["index"] == index, name
            open_, index = False, index + 1
    assert not open_


def _streamed_text(events: list[tuple[str, dict[str, Any]]], kind: str = "text_delta") -> str:
    key = {"text_delta": "text", "thinking_delta": "thinking",
           "input_json_delta": "partial_json"}[kind]
    return "".join(d["delta"][key] for n, d in events
                   if n == "content_block_delta" and d["delta"]["type"] == kind)


def _err(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    assert set(body["error"]) == {"type", "message"}
    return body["error"]["message"]


# ---- text, streaming, counting (the bundled model) ---------------------------------------------


def test_create_stream_and_count(client: Any, base: str) -> None:
    """A greedy answer created and streamed is the same text; usage splits the prompt as
    Anthropic does (input_tokens plus cache_read_input_tokens: count_tokens' count)."""
    kw = {"model": NAME, "max_tokens": 12, "messages": HELLO}
    # NOTE: sampling fields through extra_body: the newest SDKs no longer take them as arguments
    greedy = {"extra_body": {"temperature": 0}}
    m = client.messages.create(**kw, **greedy)
    assert (m.type, m.role, m.model) == ("message", "assistant", NAME)
    assert m.id.startswith("msg_")
    [block] = m.content
    assert block.type == "text" and block.text
    assert m.stop_reason in ("max_tokens", "end_turn") and m.stop_sequence is None
    count = client.messages.count_tokens(model=NAME, messages=HELLO).input_tokens
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == count
    assert m.usage.output_tokens <= 12
    with client.messages.stream(**kw, **greedy) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == block.text == final.content[0].text
    assert final.stop_reason == m.stop_reason and final.usage.output_tokens == m.usage.output_tokens
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == count
    status, events = _events(base, {**kw, "temperature": 0})
    assert status == 200
    _check_order(events)
    assert _streamed_text(events) == block.text
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["model"] == NAME
    assert events[-2][1]["delta"]["stop_reason"] == m.stop_reason


def test_cache_reads_are_reported(client: Any) -> None:
    """A prompt the prefix cache holds the most of: its pages are cache reads, the rest
    input_tokens, as Anthropic splits them."""
    long = [{"role": "user", "content": "import os\nimport sys\n" * 8}]
    count = client.messages.count_tokens(model=NAME, messages=long).input_tokens
    for _ in range(2):
        m = client.messages.create(model=NAME, max_tokens=2, messages=long)
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens == count
    assert 0 < m.usage.cache_read_input_tokens < count


def test_greedy_text_equals_the_chat_route(client: Any, base: str) -> None:
    """The same conversation (system, turns) through both routes: the same greedy text and
    prompt tokens."""
    system = "You write Python."
    turns = [{"role": "user", "content": "import os"},
             {"role": "assistant", "content": "import sys"},
             {"role": "user", "content": [{"type": "text", "text": "def main():"}]}]
    m = client.messages.create(model=NAME, max_tokens=16, system=system, messages=turns,
                               extra_body={"temperature": 0})
    chat = httpx.post(base + "/v1/chat/completions", timeout=60, headers={
        "Authorization": f"Bearer {KEY}"}, json={
        "model": NAME, "max_tokens": 16, "temperature": 0, "messages": [
            {"role": "system", "content": system}, *turns]}).json()
    assert m.content[0].text == chat["choices"][0]["message"]["content"]
    assert m.usage.output_tokens == chat["usage"]["completion_tokens"]
    assert (m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
            == chat["usage"]["prompt_tokens"])


def test_a_claude_code_request(base: str) -> None:
    """Shaped as Claude Code sends it: its headers, `?beta=true`, system blocks with
    cache_control, a tool schema with `$schema` and `additionalProperties`, metadata, thinking
    and max_tokens 32000 (clamped to what the context leaves)."""
    body = {
        "model": NAME, "max_tokens": 32000, "temperature": 1, "stream": True,
        "metadata": {"user_id": "user_abc_account_def_session_0f2e"},
        # NOTE: a long prompt leaves the model few tokens (the file's budget)
        "system": [{"type": "text", "text": "You are Claude Code, a command line agent.",
                    "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "Answer briefly. " * 5,
                    "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>ok</system-reminder>"},
            {"type": "text", "text": "list files", "cache_control": {"type": "ephemeral"}}]}],
        "tools": [{"name": "Bash", "description": "Run a command.", "input_schema": {
            "$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
            "properties": {"command": {"type": "string"}}, "required": ["command"],
            "additionalProperties": False}}],
        "thinking": {"type": "enabled", "budget_tokens": 31999},
    }
    headers = {"anthropic-version": "2023-06-01", "x-app": "cli",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
                                 "fine-grained-tool-streaming-2025-05-14",
               "anthropic-dangerous-direct-browser-access": "true",
               "user-agent": "claude-cli/2.0.0 (external, cli)"}
    status, events = _events(base, body, "/v1/messages?beta=true", **headers)
    assert status == 200, events
    _check_order(events)
    end = events[-2][1]
    prompt = end["usage"]["input_tokens"] + end["usage"]["cache_read_input_tokens"]
    assert 0 < end["usage"]["output_tokens"] <= MAX_LEN - prompt
    assert end["delta"]["stop_reason"] in ("max_tokens", "end_turn", "tool_use")


# ---- errors, the key, limits -------------------------------------------------------------------


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("bad temperature", {"temperature": "hot"}, "temperature"),
    ("unknown field", {"frobnicate": 1}, "frobnicate"),
    ("image block", {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "iVBORw0KGgo="}}]}]}, "image"),
    ("server tool", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "server tool"),
    ("tool_choice names no tool", {"tools": TOOLS, "tool_choice": {"type": "tool",
                                                                   "name": "nope"}}, "nope"),
    ("any without tools", {"tool_choice": {"type": "any"}}, "tool_choice"),
    ("prefill", {"messages": [*HELLO, {"role": "assistant", "content": "x"}]}, "prefill"),
    ("role", {"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ("thinking without budget", {"thinking": {"type": "enabled"}}, "budget_tokens"),
    ("too many stops", {"stop_sequences": list("abcde")}, "stop_sequences"),
    ("tool_result of a number", {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": 3}]}]}, "messages.0.content.0"),
    ("system image", {"system": [{"type": "image", "source": {}}]}, "system.0: 'image'"),
    ("untyped block", {"messages": [{"role": "user", "content": [{"text": "x"}]}]},
     "messages.0.content.0: a content block needs a type"),
]


@pytest.mark.parametrize(("name", "body", "named"), BAD, ids=[b[0] for b in BAD])
def test_bad_requests_in_anthropics_shape(base: str, name: str, body: dict[str, Any],
                                          named: str) -> None:
    r = _post(base, {"model": NAME, "max_tokens": 4, "messages": HELLO, **body})
    assert named in _err(r, 400, "invalid_request_error")


def test_errors_through_the_sdk(client: Any, base: str) -> None:
    with pytest.raises(sdk().BadRequestError) as e:
        client.messages.create(model=NAME, max_tokens=4, messages=HELLO,
                               extra_body={"top_p": 0})
    assert e.value.status_code == 400 and e.value.body["error"]["type"] == "invalid_request_error"
    assert "top_p" in e.value.body["error"]["message"]
    with pytest.raises(sdk().NotFoundError) as e:
        client.messages.create(model="claude-sonnet-4", max_tokens=4, messages=HELLO)
    assert e.value.body["error"]["type"] == "not_found_error"
    assert "claude-sonnet-4" in e.value.body["error"]["message"]
    msg = _err(_post(base, {"model": NAME, "messages": HELLO}), 400, "invalid_request_error")
    assert "max_tokens" in msg and "required" in msg.lower()
    _err(_post(base, {"messages": HELLO}, "/v1/messages/nothing"), 404, "not_found_error")


def test_the_key_as_x_api_key_or_bearer(base: str) -> None:
    kw = {"model": NAME, "max_tokens": 2, "messages": HELLO}
    assert sdk().Anthropic(base_url=base, api_key=KEY, max_retries=0).messages.create(**kw)
    bearer = sdk().Anthropic(base_url=base, auth_token=KEY, max_retries=0)
    assert bearer.messages.count_tokens(model=NAME, messages=HELLO).input_tokens > 0
    with pytest.raises(sdk().AuthenticationError) as e:
        sdk().Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(**kw)
    assert e.value.body["error"]["type"] == "authentication_error"
    assert "x-api-key" in e.value.body["error"]["message"]
    r = httpx.post(base + "/v1/messages", json=kw, timeout=10)
    _err(r, 401, "authentication_error")
    # the OpenAI routes take the key either way too, and keep OpenAI's error body
    r = httpx.get(base + "/v1/models", headers={"x-api-key": KEY}, timeout=10)
    assert r.status_code == 200
    r = httpx.get(base + "/v1/models", headers={"x-api-key": "wrong"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(base + "/v1/messages", content=json.dumps(kw), timeout=10,
                   headers={"x-api-key": KEY, "content-type": "text/plain"})
    _err(r, 415, "invalid_request_error")


def test_the_limits_of_the_openai_routes(real: tuple[Any, str, LLM]) -> None:
    """Body size, JSON values, a prompt whose bytes prove it too long, a slow body and a full
    queue: refused as on the chat route, in Anthropic's shape (max_tokens past the context is
    clamped, not refused: test_a_claude_code_request)."""
    app, base, _ = real
    big = {"model": NAME, "max_tokens": 4, "messages": [
        {"role": "user", "content": "x" * (BODY_LIMIT + 10)}]}
    assert "--max-body-bytes" in _err(_post(base, big), 413, "request_too_large")
    values = b'{"model": "' + NAME.encode() + b'", "max_tokens": 4, "messages": [' + \
        b"{}," * 60_000 + b"{}]}"
    r = httpx.post(base + "/v1/messages", content=values, timeout=60,
                   headers={"x-api-key": KEY, "content-type": "application/json"})
    assert "JSON values" in _err(r, 413, "request_too_large")
    long = {"model": NAME, "max_tokens": 4, "messages": [
        {"role": "user", "content": "ab " * 30_000}]}
    for path, body in (("/v1/messages", long), ("/v1/messages/count_tokens", {
            k: v for k, v in long.items() if k != "max_tokens"})):
        assert "bytes of text" in _err(_post(base, body, path), 400, "invalid_request_error")
    host, port = base.removeprefix("http://").split(":")
    head = (f"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nx-api-key: {KEY}\r\n"
            f"content-type: application/json\r\ncontent-length: 100\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=10) as c:
        t0 = time.monotonic()
        c.sendall(head + b'{"model": ')
        out = b""
        while chunk := c.recv(65536):
            out += chunk
    assert out.startswith(b"HTTP/1.1 408 ") and b"--request-timeout" in out, out[:300]
    assert time.monotonic() - t0 < TIMEOUT_S + 5
    srv = app.state.server
    srv.max_queue = 0
    try:
        r = _post(base, {"model": NAME, "max_tokens": 4, "messages": HELLO})
    finally:
        srv.max_queue = 256
    assert "--max-queue" in _err(r, 503, "overloaded_error")
    assert r.headers["retry-after"] == "1"


def test_a_bad_request_never_disturbs_another(base: str) -> None:
    """Streams running beside bad requests (each of BAD, a client that leaves) end with the
    text they have alone."""
    good = {"model": NAME, "max_tokens": 12, "temperature": 0, "stream": True}

    async def stream(http: httpx.AsyncClient, i: int) -> str:
        async with http.stream("POST", base + "/v1/messages", json={**good, "messages": [
                {"role": "user", "content": f"class A{i}:"}]}) as r:
            raw = "".join([t async for t in r.aiter_text()])
        assert r.status_code == 200 and raw.endswith('"type":"message_stop"}\n\n'), raw[-300:]
        return "".join(json.loads(line[6:])["delta"].get("text", "") for line in raw.split("\n")
                       if line.startswith('data: {"type":"content_block_delta"'))

    async def bad(http: httpx.AsyncClient, body: dict[str, Any]) -> int:
        r = await http.post(base + "/v1/messages", json={
            "model": NAME, "max_tokens": 4, "messages": HELLO, **body})
        return r.status_code

    async def leave(http: httpx.AsyncClient) -> None:
        async with http.stream("POST", base + "/v1/messages", json={
                **good, "max_tokens": 200}) as r:
            async for line in r.aiter_lines():
                if line.startswith("event: content_block_delta"):
                    break

    async def run() -> tuple[list[str], list[Any]]:
        async with httpx.AsyncClient(timeout=60, headers={"x-api-key": KEY}) as http:
            alone = [await stream(http, i) for i in range(3)]
            together = await asyncio.gather(*[stream(http, i) for i in range(3)],
                                            *[bad(http, b) for _, b, _ in BAD], leave(http))
            return alone, list(together)

    alone, together = asyncio.run(run())
    assert together[:3] == alone
    assert together[3:-1] == [400] * len(BAD)


def test_an_engine_failure(real: tuple[Any, str, LLM], monkeypatch: pytest.MonkeyPatch) -> None:
    """A request the engine fails: a 500 api_error whole; streamed, an `error` event ends the
    stream (as Anthropic's do), and the cause stays in the log."""
    _, base, bundled = real
    step = bundled.runner.step

    def failing(inp: Any, pad: bool = False) -> Any:
        if any(p.temperature == 0.5 for p in inp.params):
            raise OverflowError("a secret cause")
        return step(inp, pad)

    monkeypatch.setattr(bundled.runner, "step", failing)
    body = {"model": NAME, "max_tokens": 8, "messages": HELLO, "temperature": 0.5}
    assert "secret" not in _err(_post(base, body), 500, "api_error")
    status, events = _events(base, body)
    assert status == 200 and [n for n, _ in events[:2]] == ["message_start", "ping"]
    name, data = events[-1]
    assert name == "error" and data["error"]["type"] == "api_error"
    assert "secret" not in data["error"]["message"]


def test_error_bodies() -> None:
    detail = {"error": {"message": "is 3", "type": "invalid_request_error", "param": "top_k",
                        "code": "invalid_value"}}
    assert error_body(400, detail) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "top_k: is 3"}}
    assert error_body(529, "busy")["error"] == {"type": "overloaded_error", "message": "busy"}
    assert error_body(408, detail)["error"]["type"] == "invalid_request_error"
    assert error_body(502, detail)["error"]["type"] == "api_error"


# ---- tool use and thinking (the scripted engine) -----------------------------------------------


def test_forced_tool_use_and_its_result(llm: ScriptedLLM, scripted: Any,  # noqa: F811
                                        url: str) -> None:  # noqa: F811
    """tool_choice `tool` is a grammar (the scripted runner's output passes it); the answer's
    tool_use block goes back with a tool_result, as a client sends them."""
    llm.say(f"{SECTION_BEGIN}{_call('get_time', 1, '{}')}{SECTION_END}")
    m = scripted.messages.create(model="scripted", max_tokens=32000, messages=ASK, tools=TOOLS,
                                 tool_choice={"type": "tool", "name": "get_time"})
    assert m.stop_reason == "tool_use"
    [use] = m.content
    assert (use.type, use.id, use.name, use.input) == ("tool_use", "functions.get_time:1",
                                                       "get_time", {})
    history = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": use.id, "content": [
                       {"type": "text", "text": "noon"}], "cache_control": {
                       "type": "ephemeral"}},
                   {"type": "text", "text": "Thanks."}]}]
    llm.say("It is noon.")
    r = scripted.messages.create(model="scripted", max_tokens=64, messages=history, tools=TOOLS)
    assert [(b.type, b.text) for b in r.content] == [("text", "It is noon.")]
    assert r.stop_reason == "end_turn"
    chat = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": "get_time",
                                                        "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": use.id, "content": "noon"},
            {"role": "user", "content": "Thanks."}]
    functions = [{"type": "function", "function": {
        "name": t["name"], "parameters": t["input_schema"],
        **({"description": t["description"]} if "description" in t else {})}} for t in TOOLS]
    want = llm.tokenizer.apply_chat_template(chat, tools=functions, thinking=False)
    assert r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0) == len(want)
    assert scripted.messages.count_tokens(model="scripted", messages=history,
                                          tools=TOOLS).input_tokens == len(want)
    prompt = llm.tokenizer.render_chat_template(chat, tools=functions, thinking=False)
    assert "## Return of functions.get_time:1\nnoon" in prompt
    # an error result says so
    history[2]["content"][0]["is_error"] = True
    llm.say("Sorry.")
    r = scripted.messages.create(model="scripted", max_tokens=8, messages=history, tools=TOOLS)
    assert r.content[0].text == "Sorry."
    messages, kw = to_chat(MessagesRequest.model_validate({
        "max_tokens": 1, "messages": history, "tools": TOOLS})).template_inputs()
    assert "## Return of functions.get_time:1\nError: noon" in \
        llm.tokenizer.render_chat_template(messages, **kw)


def test_tool_choice_any_streamed_and_not(llm: ScriptedLLM, scripted: Any,  # noqa: F811
                                          url: str) -> None:  # noqa: F811
    two = (f"{SECTION_BEGIN}{_call('get_weather', 0, WEATHER)}{_call('get_time', 1, '{}')}"
           f"{SECTION_END}")
    kw = {"model": "scripted", "max_tokens": 200, "messages": ASK, "tools": TOOLS,
          "tool_choice": {"type": "any"}}
    llm.say(two)
    m = scripted.messages.create(**kw)
    assert m.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in m.content] == [
        ("tool_use", "get_weather", {"city": "Paris"}), ("tool_use", "get_time", {})]
    llm.say(two)
    status, events = _events(url, kw)
    assert status == 200
    _check_order(events)
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert [(b["type"], b["id"], b["name"], b["input"]) for b in starts] == [
        ("tool_use", "functions.get_weather:0", "get_weather", {}),
        ("tool_use", "functions.get_time:1", "get_time", {})]
    deltas = [json.loads(d["delta"]["partial_json"]) for n, d in events
              if n == "content_block_delta"]
    assert deltas == [{"city": "Paris"}, {}]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    # one call only (the grammar allows one), streamed through the SDK's accumulator
    llm.say(f"{SECTION_BEGIN}{_call('get_weather', 0, WEATHER)}{SECTION_END}")
    with scripted.messages.stream(**{**kw, "tool_choice": {
            "type": "any", "disable_parallel_tool_use": True}}) as s:
        final = s.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [
        ("tool_use", "get_weather", {"city": "Paris"})]


def test_text_then_a_call_and_a_malformed_call(llm: ScriptedLLM, scripted: Any,  # noqa: F811
                                               url: str) -> None:  # noqa: F811
    """Text, then a call (tool_choice auto): two blocks, streamed alike; a call whose
    arguments are not a JSON object is dropped."""
    text = (f"Let me check.{SECTION_BEGIN}{_call('get_weather', 0, WEATHER)}"
            f"{_call('get_time', 1, '[1, 2]')}{SECTION_END}")
    llm.say(text)
    m = scripted.messages.create(model="scripted", max_tokens=200, messages=ASK, tools=TOOLS)
    assert [b.type for b in m.content] == ["text", "tool_use"] and m.stop_reason == "tool_use"
    assert m.content[0].text == "Let me check." and m.content[1].input == {"city": "Paris"}
    llm.say(text)
    with scripted.messages.stream(model="scripted", max_tokens=200, messages=ASK,
                                  tools=TOOLS) as s:
        final = s.get_final_message()
    assert final.model_dump()["content"] == m.model_dump()["content"]


def test_thinking_blocks(llm: ScriptedLLM, scripted: Any, url: str) -> None:  # noqa: F811
    kw = {"model": "scripted", "max_tokens": 2048, "messages": ASK,
          "thinking": {"type": "enabled", "budget_tokens": 1024}}
    said = f"Paris is in France.{THINK_END}It is sunny."
    llm.say(said)
    m = scripted.messages.create(**kw)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
            for b in m.content] == [("thinking", "Paris is in France."), ("text", "It is sunny.")]
    assert m.content[0].signature == ""
    llm.say(said)
    status, events = _events(url, kw)
    _check_order(events)
    assert _streamed_text(events, "thinking_delta") == "Paris is in France."
    assert _streamed_text(events) == "It is sunny."
    kinds = [d["content_block"]["type"] for n, d in events if n == "content_block_start"]
    assert kinds == ["thinking", "text"]
    sig = [i for i, (n, d) in enumerate(events) if n == "content_block_delta"
           and d["delta"]["type"] == "signature_delta"]
    assert len(sig) == 1 and events[sig[0] + 1][0] == "content_block_stop"
    # thinking off: the prompt ends in instant mode; the answer is all text
    assert llm.tokenizer.render_chat_template(ASK, thinking=False).endswith(THINK_END)
    llm.say("Sunny.")
    m = scripted.messages.create(**{**kw, "thinking": {"type": "disabled"}})
    assert [b.type for b in m.content] == ["text"]
    # a thinking turn of the history goes back as the turn's reasoning (signatures ignored)
    llm.say(f"Fine.{THINK_END}ok")
    history = [*ASK, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hmm", "signature": "c2ln"},
        {"type": "redacted_thinking", "data": "eA=="}, {"type": "text", "text": "Sunny."}]},
        {"role": "user", "content": "Thanks"}]
    m = scripted.messages.create(**{**kw, "messages": history})
    assert [b.type for b in m.content] == ["thinking", "text"] and m.content[1].text == "ok"


def test_stop_sequences(llm: ScriptedLLM, scripted: Any, url: str) -> None:  # noqa: F811
    kw = {"model": "scripted", "max_tokens": 64, "messages": ASK,
          "stop_sequences": ["zzz", "world"]}
    llm.say("Hello world. Bye.")
    m = scripted.messages.create(**kw)
    assert (m.content[0].text, m.stop_reason, m.stop_sequence) == ("Hello ", "stop_sequence",
                                                                   "world")
    llm.say("Hello world. Bye.")
    status, events = _events(url, kw)
    assert _streamed_text(events) == "Hello "
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "world"}
    llm.say("Hello.")
    m = scripted.messages.create(**{**kw, "max_tokens": 2})
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2
