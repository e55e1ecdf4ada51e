"""OpenAI's Responses API (`/v1/responses`) through the official `openai` client: text, streaming
(the events in order), function calls and their outputs given back, reasoning,
`previous_response_id`, `text.format`, stored responses, a body as Codex CLI sends it, an engine
failure, the API key, and the bad bodies the OpenAI routes refuse.

Sampling runs on the bundled pair served in this process (tests/test_structured.py's setup);
function calls and reasoning on the scripted engine of tests/test_serve_tools.py (the app over
the real scheduler, a runner emitting queued texts). Only 127.0.0.1 is contacted."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from engine import LLM  # noqa: E402
from engine.serve import ServeConfig  # noqa: E402
from engine.serve.app import build_app  # noqa: E402
from engine.serve.responses import (  # noqa: E402
    ITEMS,
    ResponsesRequest,
    Store,
    messages,
)
from engine.tokenizer import Tokenizer  # noqa: E402
from tests.test_serve import serving  # noqa: E402
from tests.test_serve_tools import (  # noqa: E402
    ARGUMENT_BEGIN,
    CALL_BEGIN,
    CALL_END,
    INSTANT_KWARGS,
    SECTION_BEGIN,
    SECTION_END,
    THINK_END,
    TOOLS,
    TWO_CALLS,
    WEATHER,
    ScriptedLLM,
    client,  # noqa: F401 - fixtures
    llm,  # noqa: F401
    served,  # noqa: F401
    tokenizer,  # noqa: F401
    url,  # noqa: F401
)

NAME = "kimi-mini"
KEY = "responses-key"
# The chat tools of tests/test_serve_tools.py, flat as the Responses API has them.
FLAT = [{"type": "function", **t["function"]} for t in TOOLS]
INSTANT = {"reasoning": {"effort": "none"}}  # thinking off (the chat route's INSTANT_KWARGS)
ASK = "Weather in Paris, and the time?"
# Every field bounded, so even the bundled toy model's answers end within max_output_tokens.
SMALL = {"type": "object", "properties": {
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "color": {"enum": ["red", "green", "blue"]}},
    "required": ["age", "color"], "additionalProperties": False}


@pytest.fixture(scope="module")
def real() -> Iterator[tuple[LLM, str]]:
    """The bundled pair served in this process."""
    llm_ = LLM(mode="tree", budget=8, max_batch_size=8, compile="off", max_model_len=512,
               progress=False)
    with serving(build_app(llm_, NAME)) as base:
        yield llm_, base


@pytest.fixture(scope="module")
def oa(real: tuple[LLM, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{real[1]}/v1", api_key="x", max_retries=0, timeout=60)


def _greedy(**kw: Any) -> dict[str, Any]:
    return {"model": NAME, "temperature": 0, "max_output_tokens": 6, **kw}


# ---- text on the bundled pair ------------------------------------------------------------------


def test_text_and_usage(real: tuple[LLM, str], oa: openai.OpenAI) -> None:
    llm_ = real[0]
    r = oa.responses.create(**_greedy(input="Write a function that adds two numbers."))
    assert r.object == "response" and r.id.startswith("resp_") and r.model == NAME
    assert [o.type for o in r.output] == ["message"]
    msg = r.output[0]
    assert msg.role == "assistant" and msg.content[0].type == "output_text"
    assert r.output_text == msg.content[0].text
    prompt = llm_.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a function that adds two numbers."}])
    u = r.usage
    assert u.input_tokens == len(prompt) and 1 <= u.output_tokens <= 6
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert u.input_tokens_details.cached_tokens >= 0
    assert u.output_tokens_details.reasoning_tokens == 0
    if r.status == "incomplete":  # the answer ran out of tokens
        assert u.output_tokens == 6 and r.incomplete_details.reason == "max_output_tokens"
        assert msg.status == "incomplete"
    else:
        assert r.status == "completed" and r.incomplete_details is None


def test_greedy_text_equals_the_chat_routes(real: tuple[LLM, str], oa: openai.OpenAI) -> None:
    """instructions, developer and system messages, parts, an assistant's output_text given
    back: the chat route's conversation, the same prompt and the same answer."""
    items = [{"role": "developer", "content": "Answer in Python."},
             {"role": "user", "content": [{"type": "input_text", "text": "Add two "},
                                          {"type": "input_text", "text": "numbers."}]},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "def add(a, b):", "annotations": []}]},
             {"role": "user", "content": "Now subtract."}]
    chat = [{"role": "system", "content": "Be brief."},
            {"role": "system", "content": "Answer in Python."},
            {"role": "user", "content": "Add two numbers."},
            {"role": "assistant", "content": "def add(a, b):"},
            {"role": "user", "content": "Now subtract."}]
    r = oa.responses.create(**_greedy(input=items, instructions="Be brief."))
    c = oa.chat.completions.create(model=NAME, messages=chat, temperature=0, max_tokens=6)
    assert r.output_text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.usage.output_tokens == c.usage.completion_tokens


def test_streamed_events_in_order(oa: openai.OpenAI) -> None:
    whole = oa.responses.create(**_greedy(input="hello there"))
    events = list(oa.responses.create(**_greedy(input="hello there"), stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    last = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", last]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == events[-4].text == final.output_text == whole.output_text
    assert events[-2].item.id == events[2].item.id == final.output[0].id
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.id == events[0].response.id


def test_json_schema_output_validates_for_several_seeds(oa: openai.OpenAI) -> None:
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": SMALL, "strict": True}}

    def ask(seed: int) -> Any:
        return oa.responses.create(model=NAME, input="Describe someone.", text=fmt,
                                   max_output_tokens=40, extra_body={"seed": seed})

    with ThreadPoolExecutor(3) as pool:
        rs = list(pool.map(ask, range(3)))
    for r in rs:
        assert r.status == "completed", r
        jsonschema.validate(json.loads(r.output_text), SMALL)
        assert r.text.format.type == "json_schema"
    body = ResponsesRequest.model_validate({"input": "x", "text": {
        "format": {"type": "json_object"}}, "reasoning": {"effort": "minimal"}})
    chat = body.chat_request(body.items())
    assert chat.answer_schema == {"type": "object"}
    assert chat.chat_template_kwargs == {"thinking": False}


def test_previous_response_id_and_stored_responses(real: tuple[LLM, str],
                                                   oa: openai.OpenAI) -> None:
    first = oa.responses.create(**_greedy(input="hello", instructions="Be kind."))
    then = oa.responses.create(**_greedy(input="and more", previous_response_id=first.id))
    assert then.previous_response_id == first.id
    # the earlier conversation and answer come first; its instructions do not carry over
    chat = [{"role": "user", "content": "hello"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "and more"}]
    c = oa.chat.completions.create(model=NAME, messages=chat, temperature=0, max_tokens=6)
    assert then.output_text == c.choices[0].message.content
    assert then.usage.input_tokens == c.usage.prompt_tokens
    # GET gives the stored response as it was sent
    assert oa.responses.retrieve(then.id).model_dump() == then.model_dump()
    with pytest.raises(openai.NotFoundError) as e:
        oa.responses.create(**_greedy(input="x", previous_response_id="resp_unknown"))
    assert e.value.body["param"] == "previous_response_id"
    assert "resp_unknown" in e.value.body["message"]
    unstored = oa.responses.create(**_greedy(input="x", store=False))
    for ask in (lambda: oa.responses.retrieve(unstored.id),
                lambda: oa.responses.create(**_greedy(input="x",
                                                      previous_response_id=unstored.id))):
        with pytest.raises(openai.NotFoundError):
            ask()
    oa.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(first.id)
    assert oa.responses.retrieve(then.id).id == then.id  # its own copy of the conversation


def test_the_store_keeps_the_last_responses() -> None:
    store = Store(capacity=2, budget=10_000)
    items = ITEMS.validate_python([{"type": "message", "role": "user", "content": "x" * 2000}])
    for i in range(3):
        store.put({"id": f"r{i}"}, items)
    assert list(store.kept) == ["r1", "r2"]
    store.get("r1")  # used: r2 is now the oldest
    store.put({"id": "r3"}, items)
    assert list(store.kept) == ["r1", "r3"]
    store.put({"id": "big"}, items * 4)  # more than the budget with the others: they go
    assert list(store.kept) == ["big"] and store.chars <= store.budget
    store.put({"id": "huge"}, items * 6)  # more than the whole budget: not kept
    assert list(store.kept) == ["big"]


def test_reasoning_and_calls_given_back_become_one_assistant_turn() -> None:
    items = ITEMS.validate_python([
        {"type": "message", "role": "user", "content": "q"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me check.", "annotations": []}]},
        {"type": "function_call", "call_id": "c0", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c1", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c0", "output": "1"},
        {"type": "function_call_output", "call_id": "c1",
         "output": [{"type": "input_text", "text": "2"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "more"}]},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
    ])
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert messages(items) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "think",
         "tool_calls": [{"id": "c0", **call},
                        {"id": "c1", "type": "function",
                         "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c0", "content": "1"},
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
        {"role": "assistant", "content": "", "reasoning_content": "more",
         "tool_calls": [{"id": "c2", **call}]},
    ]


# ---- function calls and reasoning on the scripted engine -------------------------------------


def test_function_calls_and_their_outputs(llm: ScriptedLLM,  # noqa: F811
                                          client: openai.OpenAI) -> None:  # noqa: F811
    llm.say(TWO_CALLS)
    r = client.responses.create(model="scripted", input=ASK, tools=FLAT, **INSTANT)
    assert r.status == "completed"
    assert [o.type for o in r.output] == ["message", "function_call", "function_call"]
    assert r.output_text == "Let me check."
    calls = r.output[1:]
    assert [(c.call_id, c.name, c.arguments, c.status) for c in calls] == [
        ("functions.get_weather:0", "get_weather", WEATHER, "completed"),
        ("functions.get_time:1", "get_time", "{}", "completed")]
    assert all(c.id.startswith("fc_") for c in calls)
    assert r.tools[0].name == "get_weather" and r.tool_choice == "auto"
    # the calls' outputs given back, with the answer's items as the client got them
    llm.say("It is sunny.")
    given = [{"role": "user", "content": ASK}, *[o.model_dump(exclude_none=True)
                                                for o in r.output],
             {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"},
             {"type": "function_call_output", "call_id": calls[1].call_id, "output": "noon"}]
    r2 = client.responses.create(model="scripted", input=given, tools=FLAT, **INSTANT)
    assert r2.output_text == "It is sunny." and r2.status == "completed"
    chat = [{"role": "user", "content": ASK},
            {"role": "assistant", "content": "Let me check.", "tool_calls": [
                {"id": c.call_id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}} for c in calls]},
            {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny"},
            {"role": "tool", "tool_call_id": calls[1].call_id, "content": "noon"}]
    assert r2.usage.input_tokens == len(llm.tokenizer.apply_chat_template(
        chat, tools=TOOLS, **INSTANT_KWARGS))
    # the same through previous_response_id
    llm.say("It is sunny.")
    r3 = client.responses.create(model="scripted", previous_response_id=r.id, tools=FLAT,
                                 input=given[-2:], **INSTANT)
    assert r3.usage.input_tokens == r2.usage.input_tokens


def test_one_call_without_parallel_calls(llm: ScriptedLLM,  # noqa: F811
                                         client: openai.OpenAI) -> None:  # noqa: F811
    """With what Codex CLI sends besides (accepted, changing nothing here)."""
    llm.say(TWO_CALLS)
    r = client.responses.create(model="scripted", input=ASK, tools=FLAT, tool_choice="auto",
                                parallel_tool_calls=False, instructions="You are a coder.",
                                reasoning={"effort": "minimal", "summary": "auto"},
                                store=False, include=["reasoning.encrypted_content"],
                                prompt_cache_key="session-1", text={"verbosity": "low"},
                                extra_body={"client_metadata": {"x": "y"}})
    assert [o.type for o in r.output] == ["message", "function_call"]
    assert r.output[1].name == "get_weather" and r.parallel_tool_calls is False
    assert r.store is False and r.instructions == "You are a coder."


def _plain(item: Any) -> dict[str, Any]:
    """An output item without its id and what the SDK's stream helper adds (`parsed`)."""
    d = item.to_dict()
    del d["id"]
    for part in d.get("content") or []:
        part.pop("parsed", None)
    d.pop("parsed_arguments", None)
    return d


def test_a_body_as_codex_cli_sends_it(llm: ScriptedLLM, url: str) -> None:  # noqa: F811
    """Null reasoning, empty lists, a reasoning item with null content given back, a tool's
    output, client metadata; the answer streamed as SSE `event:` and `data:` lines."""
    body = {"model": "scripted", "instructions": "You are a coding agent.", "input": [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "<permissions>"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]},
        {"type": "reasoning", "summary": [], "content": None, "encrypted_content": None},
        {"type": "function_call", "name": "get_time", "arguments": "{}",
         "call_id": "functions.get_time:0"},
        {"type": "function_call_output", "call_id": "functions.get_time:0", "output": "noon"}],
        "tools": [{**t, "strict": False} for t in FLAT], "tool_choice": "auto",
        "parallel_tool_calls": False, "reasoning": None, "store": False, "stream": True,
        "include": [], "prompt_cache_key": "thread-1",
        "client_metadata": {"session_id": "thread-1"}}
    llm.say(f"Read it.{THINK_END}It is noon.")  # no effort: the template thinks
    with httpx.stream("POST", url + "/v1/responses", json=body, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200
    names = [x.removeprefix("event: ") for x in lines if x.startswith("event: ")]
    events = [json.loads(x.removeprefix("data: ")) for x in lines if x.startswith("data: ")]
    assert names == [e["type"] for e in events] and names[-1] == "response.completed"
    done = events[-1]["response"]
    assert done["status"] == "completed" and done["store"] is False
    assert [o["type"] for o in done["output"]] == ["reasoning", "message"]
    assert done["output"][1]["content"][0]["text"] == "It is noon."


THOUGHT = "The user wants weather."
THINKING_CALLS = f"{THOUGHT}{THINK_END}Let me check.{TWO_CALLS.removeprefix('Let me check.')}"


def test_streamed_reasoning_and_calls_equal_the_whole_answer(
        llm: ScriptedLLM, client: openai.OpenAI, tokenizer: Tokenizer) -> None:  # noqa: F811
    """Thinking on (the prompt opens <think>): reasoning, a message and two calls, streamed
    as the SDK's stream helper reads them, and the same items whole."""
    llm.say(THINKING_CALLS)
    whole = client.responses.create(model="scripted", input=ASK, tools=FLAT,
                                    reasoning={"effort": "high"})
    llm.say(THINKING_CALLS)
    with client.responses.stream(model="scripted", input=ASK, tools=FLAT,
                                 reasoning={"effort": "high"}) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # each item opens, grows and closes before the next; reasoning as reasoning_text
    squeezed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert squeezed == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        *["response.output_item.added", "response.function_call_arguments.delta",
          "response.function_call_arguments.done", "response.output_item.done"] * 2,
        "response.completed"]
    for r in (whole, final):
        assert [o.type for o in r.output] == ["reasoning", "message", "function_call",
                                              "function_call"]
        assert r.output[0].content[0].text == THOUGHT and r.output[0].summary == []
        assert r.output_text == "Let me check."
        assert [(c.call_id, c.arguments) for c in r.output[2:]] == [
            ("functions.get_weather:0", WEATHER), ("functions.get_time:1", "{}")]
        assert r.usage.output_tokens_details.reasoning_tokens == len(tokenizer.encode(THOUGHT))
    strip = {"id", "created_at", "completed_at"}
    assert [_plain(o) for o in whole.output] == [_plain(o) for o in final.output]
    assert whole.model_dump(exclude=strip | {"output"}) == final.model_dump(
        exclude=strip | {"output"})
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == WEATHER + "{}"
    # the reasoning given back reaches the prompt as the tool-calling turn's reasoning
    llm.say("Sunny.")
    back = client.responses.create(model="scripted", tools=FLAT, reasoning={"effort": "high"},
                                   input=[{"role": "user", "content": ASK},
                                          *[o.model_dump(exclude_none=True)
                                            for o in final.output],
                                          {"type": "function_call_output",
                                           "call_id": "functions.get_time:1", "output": "noon"}])
    chat = [{"role": "user", "content": ASK},
            {"role": "assistant", "content": "Let me check.", "reasoning_content": THOUGHT,
             "tool_calls": [{"id": c.call_id, "type": "function", "function": {
                 "name": c.name, "arguments": c.arguments}} for c in final.output[2:]]},
            {"role": "tool", "tool_call_id": "functions.get_time:1", "content": "noon"}]
    assert back.usage.input_tokens == len(tokenizer.apply_chat_template(
        chat, tools=TOOLS, thinking=True))


def test_a_named_function_is_forced(llm: ScriptedLLM,  # noqa: F811
                                    client: openai.OpenAI) -> None:  # noqa: F811
    call = f"{SECTION_BEGIN}{CALL_BEGIN}functions.get_time:0{ARGUMENT_BEGIN}{{}}{CALL_END}"
    llm.say(call + SECTION_END)
    r = client.responses.create(model="scripted", input=ASK, tools=FLAT, **INSTANT,
                                tool_choice={"type": "function", "name": "get_time"})
    assert [(o.type, o.name) for o in r.output] == [("function_call", "get_time")]
    assert r.tool_choice.name == "get_time"


def test_an_engine_failure_fails_the_response(llm: ScriptedLLM, client: openai.OpenAI,  # noqa: F811
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole: a 500 in OpenAI's shape; streamed: a `response.failed` event ends the stream."""
    def boom(*_: Any, **__: Any) -> Any:
        raise RuntimeError("a step failed")

    monkeypatch.setattr(llm.runner, "step", boom)
    llm.say("never")
    with pytest.raises(openai.InternalServerError) as e:
        client.responses.create(model="scripted", input=ASK, **INSTANT)
    assert e.value.body["type"] == "server_error" and "a step failed" not in str(e.value.body)
    llm.say("never")
    events = list(client.responses.create(model="scripted", input=ASK, stream=True, **INSTANT))
    kinds = [e.type for e in events]  # the prefill's token may have come first
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.failed" and kinds.count("response.failed") == 1
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert "a step failed" not in failed.error.message


# ---- the API key and bad bodies ----------------------------------------------------------------


def test_the_api_key_covers_the_responses_routes(real: tuple[LLM, str]) -> None:
    from starlette.testclient import TestClient

    app = build_app(real[0], NAME, config=ServeConfig(api_key=KEY))
    http = TestClient(app, base_url="http://127.0.0.1")  # no lifespan: the guard answers
    for method, path in (("POST", "/v1/responses"), ("GET", "/v1/responses/resp_x"),
                         ("DELETE", "/v1/responses/resp_x")):
        r = http.request(method, path, json={"input": "x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    auth = {"Authorization": f"Bearer {KEY}"}
    r = http.get("/v1/responses/resp_x", headers=auth)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


BAD = [
    ({"input": "x", "messages": []}, "messages", "unknown_parameter"),
    ({"input": "x", "max_tokens": 4}, "max_tokens", "unknown_parameter"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ({"input": "x", "max_output_tokens": 5000}, "max_output_tokens", "context_length_exceeded"),
    ({"input": "x", "temperature": 1e300}, "temperature", "invalid_value"),
    ({"input": "x", "top_p": 0}, "top_p", "invalid_value"),
    ({"input": "x", "top_k": 5000}, "top_k", "invalid_value"),
    ({"input": []}, "input", "invalid_value"),
    ({}, "input", "missing_required_parameter"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input", "invalid_value"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input",
     "invalid_value"),
    ({"input": [{"role": "critic", "content": "x"}]}, "input", "invalid_value"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "invalid_value"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({"input": "x", "tools": FLAT, "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice", "invalid_value"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text",
     "missing_required_parameter"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a",
                                        "schema": {"type": "nonsense"}}}}, "text",
     "invalid_value"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning", "invalid_value"),
    ({"input": "x", "stream_options": {"include_obfuscation": False}}, "stream_options",
     "invalid_value"),
    ({"input": "ab " * 200_000}, "input", "context_length_exceeded"),
    ({"input": "x", "model": "gpt-5"}, "model", "model_not_found"),
    ({"input": "x", "previous_response_id": "resp_gone"}, "previous_response_id",
     "previous_response_not_found"),
]


def test_bad_bodies_are_named_and_disturb_no_one(real: tuple[LLM, str],
                                                 oa: openai.OpenAI) -> None:
    """Each bad body gets its 400 (404 for an unknown model or response) naming the field,
    while a streamed answer runs beside them and ends as it does alone."""
    url_ = real[1]
    good = {**_greedy(input="a story", max_output_tokens=12), "stream": True}
    alone = "".join(e.delta for e in oa.responses.create(**good)
                    if e.type == "response.output_text.delta")

    async def run() -> tuple[str, list[httpx.Response]]:
        async with httpx.AsyncClient(timeout=60) as http:
            async def streamed() -> str:
                async with http.stream("POST", url_ + "/v1/responses", json=good) as r:
                    lines = [line async for line in r.aiter_lines()]
                events = [json.loads(x[6:]) for x in lines if x.startswith("data: ")]
                assert events[-1]["type"] in ("response.completed", "response.incomplete")
                return "".join(e["delta"] for e in events
                               if e["type"] == "response.output_text.delta")

            text, *bad = await asyncio.gather(streamed(), *[
                http.post(url_ + "/v1/responses", json=b) for b, _, _ in BAD])
            return text, bad

    text, answers = asyncio.run(run())
    assert text == alone
    for (body, param, code), r in zip(BAD, answers):
        err = r.json()["error"]
        assert r.status_code == (404 if code.endswith("not_found") else 400), (body, r.text)
        assert (err["param"], err["code"]) == (param, code), (body, err)
        assert param.split(".")[0] in err["message"] or param == "model", (body, err)
    msg = answers[0].json()["error"]["message"]
    assert "input" in msg  # why: the Responses API's own field
    # the wrong content type and a body of too many JSON values, as on the other routes
    r = httpx.post(url_ + "/v1/responses", content=b'{"input": "x"}',
                   headers={"content-type": "text/plain"})
    assert r.status_code == 415
    r = httpx.post(url_ + "/v1/responses", content=b'{"input": [' + b"{}," * 70_000 + b"{}]}",
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
