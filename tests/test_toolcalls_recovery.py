"""A tool-call section that never closes loses no text: whole, streamed, from token ids and
through the server.

vLLM's Kimi K2 tool parser has the recovery case: a section-begin marker followed by 10,000
characters and no end marker gives those characters as the content. Here the same holds for a
section left open by an answer that ran out of tokens or a model that wandered, on every route
(the HTTP process reads every answer through `engine.toolcalls.OutputStream`)."""

from __future__ import annotations

from typing import Any

import pytest

from engine.toolcalls import (
    ARGUMENT_BEGIN,
    CALL_BEGIN,
    CALL_END,
    MAX_SECTION_TEXT,
    SECTION_BEGIN,
    SECTION_END,
    OutputStream,
    ToolCallParser,
    parse_output,
    parse_tool_calls,
)
from tests.test_toolcalls import _run, _tokenizer

SB, SE, CB, AB, CE = SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END
LARGE = "x" * 10000  # vLLM's case: more than its parser's 8192 characters of a section
CALL = f'{CB}functions.get_weather:0{AB}{{"city": "Paris"}}{CE}'


def _streamed(chunks: list[str], tools: Any = None) -> tuple[list[str], list[str]]:
    """The content of each feed (then finish) and the names of the calls."""
    parser = ToolCallParser(tools)
    deltas = [parser.feed(c) for c in chunks] + [parser.finish()]
    return [d.content for d in deltas], [c.name or "" for d in deltas for c in d.tool_calls
                                         if c.name]


def test_vllm_recovery_case_whole() -> None:
    got = parse_tool_calls(SB + LARGE)
    assert (got.content, got.tool_calls) == (LARGE, [])
    got = parse_output(SB + LARGE)  # reasoning and tools, as the chat route reads an answer
    assert (got.content, got.tool_calls) == (LARGE, [])


def test_vllm_recovery_case_streamed() -> None:
    # as vLLM's streaming case: the marker alone, then the 10,000 characters in one delta,
    # which come back in that delta (past MAX_SECTION_TEXT the section is over)
    contents, calls = _streamed([SB, LARGE])
    assert contents == ["", LARGE, ""] and calls == []
    for size in (1, 7, 4096, 9000):
        chunks = [SB] + [LARGE[i:i + size] for i in range(0, len(LARGE), size)]
        contents, calls = _streamed(chunks)
        assert "".join(contents) == LARGE and calls == []
        # nothing is held back for long: the text streams once the section is given up
        assert sum(map(len, contents[:-1])) == len(LARGE)


@pytest.mark.parametrize(("text", "content", "calls"), [
    # an answer that ran out of tokens, or a model that opened a section and wandered
    (f"ok{SB}I cannot call a tool for that.", "okI cannot call a tool for that.", []),
    (f"{SB} The answer is 4.", " The answer is 4.", []),
    (f"{SB}\n", "", []),  # only whitespace: nothing to recover
    # calls kept, and what the model wrote after them when the section never closed
    (f"a{SB}{CALL}\nthen it wandered", "a\nthen it wandered", ["get_weather"]),
    (f"a{SB}{CALL}\n", "a", ["get_weather"]),
    # a call cut short keeps its arguments as far as generated, no text
    (f'a{SB}{CB}functions.get_weather:0{AB}{{"ci', "a", ["get_weather"]),
    # a closed section's noise, and the noise before a call, are still dropped
    (f"a{SB}noise{SE}b", "ab", []),
    (f"a{SB}noise{CALL}{SE}", "a", ["get_weather"]),
    # noise past MAX_SECTION_TEXT before any marker: the section was not one
    (f"a{SB}{'y' * (MAX_SECTION_TEXT + 1)}{SE}b", f"a{'y' * (MAX_SECTION_TEXT + 1)}b", []),
    (f"a{SB}{'y' * MAX_SECTION_TEXT}{SE}b", "ab", []),
    # an id too long to be one counts as the section's text
    (f"a{SB}{CB}{'z' * 600}", f"a{'z' * 600}", []),
])
def test_open_section_text_is_content(text: str, content: str, calls: list[str]) -> None:
    got = parse_tool_calls(text)
    assert got.content == content
    assert [c.name for c in got.tool_calls] == calls
    for chunks in ([text], list(text), [text[:len(text) // 3], text[len(text) // 3:]]):
        contents, names = _streamed(chunks)
        assert "".join(contents) == content and names == calls


def test_output_stream_from_token_ids() -> None:
    """The server's path: the marker as its special id, the text as ordinary ids, pushed a few
    ids at a time, non-streamed (one end) or streamed (pushes, then end)."""
    tok = _tokenizer()
    for text, want in [(SB + LARGE, LARGE), (f"Sure.{SB}{CALL}then prose", "Sure.then prose"),
                       (f"Sure.{SB}I ran out of tok", "Sure.I ran out of tok")]:
        ids = tok.encode(text, allow_special=True)
        assert tok.special_tokens[SB] in ids
        for cuts in ([], list(range(0, len(ids), 5)), list(range(len(ids)))):
            out = OutputStream(tok, tools=True)
            deltas = _run(out, ids, cuts)
            assert "".join(d.content for d in deltas) == want
            assert out.result().content == want
            assert out.result() == parse_output(text)
            # a stop after an open section's text is a stop, not a tool call, unless calls came
            assert out.finish_reason("stop") == ("tool_calls" if CALL in text else "stop")


# ---- through the server (the scripted engine of tests/test_serve_tools.py) ----------------------

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tests.test_serve_tools import (  # noqa: E402,F401 (fixtures)
    ASK,
    INSTANT,
    TOOLS,
    ScriptedLLM,
    _joined,
    _stream,
    client,
    llm,
    served,
    tokenizer,
    url,
)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_route_returns_an_open_sections_text(
        llm: ScriptedLLM, client: openai.OpenAI, stream: bool) -> None:  # noqa: F811
    answer = "I could not call the tool; it is sunny in Paris."
    llm.say(f"Let me see.{SB}{answer}")
    if stream:
        deltas, reason = _stream(client, messages=ASK, tools=TOOLS, **INSTANT)
        content, calls = _joined(deltas, "content"), [c for d in deltas for c in d.tool_calls or []]
    else:
        r = client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, **INSTANT)
        content, calls, reason = (r.choices[0].message.content, r.choices[0].message.tool_calls,
                                  r.choices[0].finish_reason)
    assert content == "Let me see." + answer
    assert not calls and reason == "stop"
