from __future__ import annotations

import functools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.tokenizer import TextStream, Tokenizer, kimi_special_tokens
from engine.toolcalls import (
    ARGUMENT_BEGIN,
    CALL_BEGIN,
    CALL_END,
    MAX_ID_CHARS,
    SECTION_BEGIN,
    SECTION_END,
    THINK_BEGIN,
    THINK_END,
    OutputDelta,
    OutputParser,
    OutputStream,
    ParsedOutput,
    ReasoningParser,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    merge_tool_call_deltas,
    parse_call_id,
    parse_output,
    parse_reasoning,
    parse_tool_calls,
    prompt_opens_reasoning,
)

SB, SE, CB, AB, CE = SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END
TB, TE = THINK_BEGIN, THINK_END
_TOOL_MARKERS = (SB, SE, CB, AB, CE)


def _section(*calls: tuple[str, str], sep: str = "") -> str:
    body = sep.join(f"{CB}{cid}{AB}{args}{CE}" for cid, args in calls)
    return f"{SB}{sep}{body}{sep}{SE}"


def _chunks(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    out, last = [], 0
    for p in points:
        out.append(text[last:p])
        last = p
    out.append(text[last:])
    return out


def _stream_tools(chunks: list[str], tools: Any = None
                  ) -> tuple[str, list[ToolCall], list[ToolCallDelta]]:
    parser = ToolCallParser(tools)
    content, deltas = [], []
    for c in [*chunks, None]:
        d = parser.feed(c) if c is not None else parser.finish()
        content.append(d.content)
        deltas.extend(d.tool_calls)
    return "".join(content), merge_tool_call_deltas(deltas), deltas


# ---------------------------------------------------------------- whole text


def test_two_calls_with_content_before() -> None:
    text = "Let me check." + _section(
        ("functions.get_weather:0", '{"city": "Paris"}'), ("functions.get_time:1", " {} \n")
    )
    got = parse_tool_calls(text)
    assert got.content == "Let me check."
    assert got.tool_calls == [
        ToolCall(0, "functions.get_weather:0", "get_weather", '{"city": "Paris"}'),
        ToolCall(1, "functions.get_time:1", "get_time", "{}"),
    ]
    assert got.tool_calls[0].to_openai() == {
        "id": "functions.get_weather:0", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }


def test_whitespace_between_markers_and_text_after_section() -> None:
    text = f"a{SB}\n {CB} functions.f:7 {AB}\n[1]\n{CE}\n{SE} tail"
    got = parse_tool_calls(text)
    assert got.content == "a tail"
    assert got.tool_calls == [ToolCall(0, "functions.f:7", "f", "[1]")]
    # whitespace after a section is dropped unless text follows it
    assert parse_tool_calls(f"a\n{_section(('functions.f:0', '{}'))}\n \n").content == "a\n"


@pytest.mark.parametrize(
    ("raw", "name"),
    [
        ("functions.get_weather:0", "get_weather"),
        ("get_weather:12", "get_weather"),
        ("  functions.mcp.search:3 ", "mcp.search"),
        ("functions.a:b:4", "a:b"),
        ("functions.:0", None),
        ("functions.f", None),
        ("f:x", None),
        ("get weather:0", None),
        ("f:٣", None),
        (":0", None),
        ("x" * MAX_ID_CHARS + ":0", None),
    ],
)
def test_call_ids(raw: str, name: str | None) -> None:
    assert parse_call_id(raw) == name


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (f"x{SB}junk{CB}functions.f:0{AB}{{}}{CE}{SE}y", "xy", ["f"]),  # noise before a call
        (f"x{SB}{SE}y", "xy", []),  # empty section
        (f"x{SB}  {SE}", "x", []),
        (f"x{SB}broken{SE} then", "x then", []),  # a section without calls
        (f"x{SB}{CB}no_index{AB}{{}}{CE}{SE}", "x", []),  # bad id, no tools to name it
        (f"x{SB}{CB}get weather:0{AB}{{}}{CE}{SE}", "x", []),
        (f"x{SB}{CB}functions.f:0{CE}{SE}", "x", []),  # no argument marker
        (f"x{SB}{CB}functions.f:0{SB}{AB}{{}}{CE}{SE}", "x", []),  # marker inside the id
        (f"x{SB}{CB}functions.f:0", "x", []),  # ends inside the id
        (f"x{SB}{CB}", "x", []),
        (f"x{SB}", "x", []),
        (f"x{SB}{CB}" + "y" * (MAX_ID_CHARS + 5) + f":0{AB}{{}}{CE}{SE}", "x", []),
        (f"{AB}{CE}{SE} <|tool_calls_section <|tool_calls_section_beginning|>",
         " <|tool_calls_section <|tool_calls_section_beginning|>", []),  # stray markers
        (f"{TB}not reasoning here{TE}", f"{TB}not reasoning here{TE}", []),
        # a call without its section (what follows a bare <|tool_call_begin|>)
        (f"{CB}functions.f:0{AB}{{}}{CE}{SE}", "", ["f"]),
        (f"a {CB}functions.f:0{AB}{{}}{CE} b", "a  b", ["f"]),
        (f"a {CB}just prose", "a just prose", []),
        (f"a {CB}prose{CE}more", "a prosemore", []),
    ],
)
def test_no_marker_reaches_the_content(text: str, content: str, calls: list[str]) -> None:
    got = parse_tool_calls(text)
    assert [c.name for c in got.tool_calls] == calls
    assert got.content == content
    for cut in range(len(text) + 1):
        assert _stream_tools([text[:cut], text[cut:]])[:2] == (got.content, got.tool_calls)


def test_a_malformed_call_loses_no_other_call() -> None:
    good = f"{CB}functions.f:0{AB}{{}}{CE}"
    got = parse_tool_calls(f"{SB}{good}{CB}oops{AB}{{}}{CE}{CB}functions.g:2{AB}[2]{CE}{SE}")
    assert got.tool_calls == [ToolCall(0, "functions.f:0", "f", "{}"),
                              ToolCall(1, "functions.g:2", "g", "[2]")]
    assert got.content == ""
    got = parse_tool_calls(f"{SB}{good}, {good.replace('f:0', 'g:1')} trailing {SE}!")
    assert [c.name for c in got.tool_calls] == ["f", "g"]
    assert got.content == "!"


def test_a_later_section_still_parses_after_a_broken_one() -> None:
    text = f"{SB}broken{SE} then {_section(('functions.g:1', '{}'))}"
    got = parse_tool_calls(text)
    assert got.content == " then "
    assert got.tool_calls == [ToolCall(0, "functions.g:1", "g", "{}")]


def test_missing_call_end_is_implied() -> None:
    text = f'{SB}{CB}functions.f:0{AB}{{"a": 1}}{CB}functions.g:1{AB}[]{SE}after'
    got = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in got.tool_calls] == [("f", '{"a": 1}'), ("g", "[]")]
    assert got.content == "after"
    truncated = parse_tool_calls(f'ok{SB}{CB}functions.f:0{AB} {{"a": ')
    assert truncated.content == "ok"
    assert truncated.tool_calls == [ToolCall(0, "functions.f:0", "f", '{"a":')]


def _fn(name: str, **props: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {k: {"type": v} for k, v in props.items()}}}}


@pytest.mark.parametrize("cid", ["0", "call_3", "toolu_01A09q90qw90lq917835lq9",
                                 "123e4567-e89b-12d3-a456-426614174000"])
def test_ids_without_a_name_are_named_by_the_request_tools(cid: str) -> None:
    weather, search = _fn("get_weather", city="string", unit="string"), _fn("search", q="string")
    text = "ok" + _section((cid, '{"q": "x"}'), ("functions.f:1", "{}"), (cid, '{"city": "A"}'))
    got = parse_tool_calls(text, [weather, search])
    assert got.content == "ok"
    assert [(c.index, c.id, c.name) for c in got.tool_calls] == [
        (0, cid, "search"), (1, "functions.f:1", "f"), (2, cid, "get_weather")]
    # the only tool names any call; without tools, or when no one tool fits, it is dropped
    assert [c.name for c in parse_tool_calls(text, [search]).tool_calls] == [
        "search", "f", "search"]
    assert [c.name for c in parse_tool_calls(text).tool_calls] == ["f"]
    assert [c.name for c in parse_tool_calls(text, [weather, _fn("w2", city="string")]
                                              ).tool_calls] == ["f"]
    for cut in range(len(text) + 1):
        assert _stream_tools([text[:cut], text[cut:]], [weather, search])[1] == \
            got.tool_calls


def test_streaming_deltas_have_openai_shape() -> None:
    text = "hi" + _section(("functions.f:0", '{"q": "x"}'), ("functions.g:1", "{}"))
    content, calls, deltas = _stream_tools(list(text))
    assert content == "hi"
    assert calls == parse_tool_calls(text).tool_calls
    firsts = [d for d in deltas if d.id is not None]
    assert [(d.index, d.id, d.name) for d in firsts] == [
        (0, "functions.f:0", "f"), (1, "functions.g:1", "g")
    ]
    # the header comes first, then fragments that carry only the index
    assert deltas[0] == firsts[0]
    assert all(d.name is None and d.arguments for d in deltas if d.id is None)
    assert firsts[0].to_openai() == {
        "index": 0, "id": "functions.f:0", "type": "function",
        "function": {"name": "f", "arguments": ""},
    }
    assert ToolCallDelta(0, arguments="{").to_openai() == {
        "index": 0, "function": {"arguments": "{"}
    }


def test_parser_can_continue_after_finish() -> None:
    p = ToolCallParser()
    p.feed(_section(("functions.f:0", "{}")))
    p.finish()
    d = p.feed(_section(("functions.g:5", "[]")))
    assert [(c.index, c.name) for c in d.tool_calls] == [(1, "g")]


# ---------------------------------------------------------------- streaming equals whole

_PIECES = st.one_of(
    st.sampled_from([SB, SE, CB, AB, CE, TB, TE, " ", "\n", "<|", "|>", "<|tool_call", ":",
                     "functions.", "get_weather", ":0", ":12", '{"a": 1}', "{", "}", "é🎉",
                     SB[:9], CE[:-2], TB[:3], TE[:4]]),
    st.text(max_size=6),
)


@st.composite
def _outputs(draw: st.DrawFn) -> str:
    """Mostly-wellformed outputs, with random noise spliced in."""
    parts: list[str] = []
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.integers(0, 3))
        if kind == 0:
            parts.append(draw(st.text(max_size=10)))
        elif kind == 1:
            calls = [
                (draw(st.sampled_from([f"functions.f:{k}", f"functions.get_weather:{k}",
                                       f"functions.a.b:{k}", f"get_weather:{k}", str(k),
                                       f"call_{k}", "bad id"])),
                 json.dumps(draw(st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))))
                for k in range(draw(st.integers(1, 3)))
            ]
            parts.append(_section(*calls, sep=draw(st.sampled_from(["", " ", "\n"]))))
        else:
            parts.extend(draw(st.lists(_PIECES, max_size=6)))
    return "".join(parts)


@settings(max_examples=300, deadline=None)
@given(_outputs(), st.lists(st.integers(0, 200), max_size=12))
def test_tool_stream_equals_whole(text: str, cuts: list[int]) -> None:
    whole = parse_tool_calls(text)
    content, calls, deltas = _stream_tools(_chunks(text, cuts))
    assert (content, calls) == (whole.content, whole.tool_calls)
    assert [c.index for c in calls] == list(range(len(calls)))
    # each call's first delta carries id and name, and comes before its fragments
    seen: set[int] = set()
    for d in deltas:
        assert (d.id is not None) == (d.index not in seen)
        seen.add(d.index)
    assert not any(m in whole.content for m in _TOOL_MARKERS)
    if not any(m in text for m in _TOOL_MARKERS):
        assert whole.content == text


@settings(max_examples=200, deadline=None)
@given(st.lists(_PIECES, max_size=20), st.lists(st.integers(0, 120), max_size=10),
       st.booleans())
def test_reasoning_stream_equals_whole(pieces: list[str], cuts: list[int], implicit: bool) -> None:
    text = "".join(pieces)
    whole = parse_reasoning(text, in_reasoning=implicit)
    parser = ReasoningParser(in_reasoning=implicit)
    deltas = [parser.feed(c) for c in _chunks(text, cuts)] + [parser.finish()]
    assert "".join(d.reasoning for d in deltas) == (whole.reasoning or "")
    assert "".join(d.content for d in deltas) == whole.content
    assert parser.started == (whole.reasoning is not None)
    # the content is the text's end as generated; the reasoning holds no tool-call marker
    if whole.reasoning is None:
        assert whole.content == text
    else:
        assert text.endswith(whole.content)
        assert whole.content == "" or whole.content.startswith((SB, CB)) or \
            text.endswith(TE + whole.content)
        assert not any(m in whole.reasoning for m in (*_TOOL_MARKERS, TE))


_REQUEST_TOOLS = [None, [], [{"type": "function", "function": {"name": "f"}}], [
    {"type": "function", "function": {"name": "f", "parameters": {"properties": {"": {}}}}},
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}]]


@settings(max_examples=300, deadline=None)
@given(_outputs(), st.lists(st.integers(0, 200), max_size=12), st.booleans(), st.booleans(),
       st.sampled_from(_REQUEST_TOOLS))
def test_output_stream_equals_whole(text: str, cuts: list[int], think: bool,
                                    implicit: bool, tools: Any) -> None:
    text = (TB if think else "") + text
    whole = parse_output(text, tools=tools, in_reasoning=implicit)
    parser = OutputParser(tools=tools, in_reasoning=implicit)
    deltas = [parser.feed(c) for c in _chunks(text, cuts)] + [parser.finish()]
    assert "".join(d.reasoning for d in deltas) == (whole.reasoning or "")
    assert "".join(d.content for d in deltas) == whole.content
    assert merge_tool_call_deltas(t for d in deltas for t in d.tool_calls) == whole.tool_calls
    assert [c.index for c in whole.tool_calls] == list(range(len(whole.tool_calls)))
    for m in _TOOL_MARKERS:
        assert m not in whole.content and m not in (whole.reasoning or "")


# ---------------------------------------------------------------- reasoning


def test_reasoning_explicit_implicit_and_absent() -> None:
    assert parse_reasoning(f"{TB}plan{TE}answer") == parse_reasoning("plan" + TE + "answer", True)
    got = parse_reasoning(f"{TB}plan{TE}answer")
    assert (got.reasoning, got.content) == ("plan", "answer")
    got = parse_reasoning("just an answer")
    assert (got.reasoning, got.content) == (None, "just an answer")
    got = parse_reasoning(f"{TB}{TE}x")
    assert (got.reasoning, got.content) == ("", "x")
    # reasoning that never closes is all reasoning
    got = parse_reasoning("still thinking", in_reasoning=True)
    assert (got.reasoning, got.content) == ("still thinking", "")
    # a <think> later in the output is content
    got = parse_reasoning(f"a{TB}b{TE}")
    assert (got.reasoning, got.content) == (None, f"a{TB}b{TE}")


def test_reasoning_ends_at_a_tool_section() -> None:
    text = f"{TB}I should call f{_section(('functions.f:0', '{}'))}"
    got = parse_output(text)
    assert got.reasoning == "I should call f"
    assert got.content == ""
    assert got.tool_calls == [ToolCall(0, "functions.f:0", "f", "{}")]
    r = parse_reasoning(text)
    assert r.content.startswith(SB)


def test_output_parser_modes() -> None:
    text = f"{TB}r{TE}c{_section(('functions.f:0', '{}'))}"
    assert parse_output(text, reasoning=False).reasoning is None
    assert parse_output(text, reasoning=False).content == f"{TB}r{TE}c"
    assert parse_output(text, tools=False).content == "c" + _section(("functions.f:0", "{}"))
    assert parse_output(text, tools=False).tool_calls == []


def test_prompt_opens_reasoning() -> None:
    assert prompt_opens_reasoning("<|im_assistant|>assistant<|im_middle|><think>")
    assert not prompt_opens_reasoning("<|im_assistant|>assistant<|im_middle|><think></think>")
    assert not prompt_opens_reasoning("<|im_assistant|>assistant<|im_middle|>")


# ---------------------------------------------------------------- token ids

# Kimi's names for the special block's first ids (offsets after the ordinary ranks), the tool-call
# and thinking markers included, as K2-Thinking's tokenizer_config.json names them.
_KIMI_NAMES = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
               10: "<|im_system|>", 11: SB, 12: SE, 13: CB, 14: AB, 15: CE, 17: "<|im_middle|>",
               22: TB, 23: TE, 254: "[UNK]", 255: "[PAD]"}


@functools.cache
def _tokenizer() -> Tokenizer:
    """Single bytes as the ordinary ranks, then Kimi's special block with the markers named."""
    ranks = {bytes([b]): b for b in range(256)}
    return Tokenizer(ranks, kimi_special_tokens(256, {256 + k: v for k, v in _KIMI_NAMES.items()}))


@pytest.fixture
def tok() -> Tokenizer:
    return _tokenizer()


def _run(out: OutputStream, ids: list[int], cuts: list[int], text_end: int | None = None
         ) -> list[OutputDelta]:
    points = sorted({min(c, len(ids)) for c in cuts})
    chunks = [ids[a:b] for a, b in zip([0, *points], points)]
    return [out.push(c) for c in chunks] + [out.end(ids[len(sum(chunks, [])):], text_end)]


def test_output_stream_parses_marker_ids(tok: Tokenizer) -> None:
    text = f"{TB}plan{TE}Sure." + _section(("functions.f:0", '{"a": 1}'), ("functions.g:1", "{}"))
    ids = tok.encode(text, allow_special=True)
    assert tok.special_tokens[SB] in ids and tok.special_tokens[TB] in ids
    for cuts in ([], [1, 2, 3], list(range(len(ids))), [5, 17, 30]):
        out = OutputStream(tok, tools=True, reasoning=True)
        deltas = _run(out, ids, cuts)
        assert out.result() == parse_output(text)
        assert "".join(d.reasoning for d in deltas) == "plan"
        assert merge_tool_call_deltas(c for d in deltas for c in d.tool_calls) == \
            parse_output(text).tool_calls
        assert out.finish_reason("stop") == "tool_calls"
        assert out.finish_reason("length") == "length"
    assert out.result().to_openai() == {
        "content": "Sure.", "reasoning_content": "plan",
        "tool_calls": [c.to_openai() for c in parse_output(text).tool_calls]}


def test_output_stream_without_parsers_is_the_plain_text(tok: Tokenizer) -> None:
    text = f"a{TB}b{SB}c{CB}d{TE}<|reserved_token_300|>e"
    ids = tok.encode(text, allow_special=True)
    out = OutputStream(tok, tok.encode(TB, allow_special=True))
    assert "".join(d.content for d in _run(out, ids, [2, 4])) == "abcde"
    assert out.result() == ParsedOutput(None, "abcde", [])
    assert out.result().to_openai() == {"content": "abcde", "reasoning_content": None,
                                        "tool_calls": None}
    # only the parsers' own markers are kept: with tools alone, <think> leaves no text (and
    # the section's noise, and a call that never got its arguments, are dropped)
    out = OutputStream(tok, tools=True)
    _run(out, ids, [])
    assert out.result().content == "ab"


def test_output_stream_reasoning_opened_by_the_prompt(tok: Tokenizer) -> None:
    ids = tok.encode(f"plan{TE}answer", allow_special=True)
    prompt = tok.encode(f"<|im_assistant|>assistant<|im_middle|>{TB}", allow_special=True)
    out = OutputStream(tok, prompt, reasoning=True)
    _run(out, ids, [3])
    assert (out.result().reasoning, out.result().content) == ("plan", "answer")
    closed = tok.encode(f"<|im_middle|>{TB}{TE}", allow_special=True)
    for p in (closed, tok.encode("<think>"), []):  # <think> as ordinary text counts too
        out = OutputStream(tok, p, reasoning=True)
        _run(out, ids, [])
        assert out.result().reasoning == ("plan" if p and p != closed else None)
    out = OutputStream(tok, prompt, reasoning=False)  # thinking off
    _run(out, ids, [])
    assert out.result() == ParsedOutput(None, "plananswer", [])


def test_output_stream_keeps_only_the_named_function(tok: Tokenizer) -> None:
    text = _section(("functions.f:0", "[0]"), ("functions.g:1", "[1]"), ("functions.f:2", "[2]"))
    ids = tok.encode(text, allow_special=True)
    out = OutputStream(tok, tools=True, only="f")
    deltas = _run(out, ids, list(range(len(ids))))
    assert [(c.index, c.id, c.arguments) for c in out.result().tool_calls] == [
        (0, "functions.f:0", "[0]"), (1, "functions.f:2", "[2]")]
    assert {c.index for d in deltas for c in d.tool_calls} == {0, 1}
    out = OutputStream(tok, tools=True, only="h")
    _run(out, ids, [])
    assert out.result() == ParsedOutput(None, "", []) and out.finish_reason("stop") == "stop"


def test_output_stream_cut_at_a_stop_string(tok: Tokenizer) -> None:
    # The stop string "bc" spans </think> in the text without special ids ("abc"): nothing
    # from "b" on leaves, the marker included; a marker right before the match does leave.
    # (The scheduler ends a request at the id that completes a stop string: "c" comes last.)
    ids = tok.encode(f"{TB}ab{TE}c", allow_special=True)
    for cuts in ([], list(range(len(ids)))):
        out = OutputStream(tok, stop=["bc"], reasoning=True)
        deltas = _run(out, ids, cuts, text_end=1)
        assert "".join(d.reasoning for d in deltas) == "a"
        assert out.result() == ParsedOutput("a", "", [])
    ids = tok.encode(f"{TB}a{CE}bc", allow_special=True)
    for cuts in ([], list(range(len(ids)))):
        out = OutputStream(tok, stop=["bc"], reasoning=True, tools=True)
        _run(out, ids, cuts, text_end=1)
        assert out.result() == ParsedOutput("a", "", [])  # a stray marker is dropped


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 511), max_size=40), st.lists(st.integers(0, 40), max_size=8),
       st.lists(st.text("abc\n", min_size=1, max_size=3), max_size=2))
def test_output_stream_without_markers_equals_text_stream(ids: list[int], cuts: list[int],
                                                          stop: list[str]) -> None:
    """Plain answers come out as `TextStream` gives them, piece for piece, stop cuts included
    (ids are fed until the text without special ids holds a stop string, as the scheduler
    does)."""
    tok = _tokenizer()
    text_end, n = None, len(ids)
    for k in range(1, len(ids) + 1):
        found = [i for i in (tok.decode(ids[:k], True).find(s) for s in stop) if i >= 0]
        if found:
            text_end, n = min(found), k
            break
    ids = ids[:n]
    # the id that completes a stop string comes with the end, never in a push (as the server
    # hands the finishing step's ids to `end`)
    points = sorted({min(c, n if text_end is None else n - 1) for c in cuts})
    chunks = [ids[a:b] for a, b in zip([0, *points], points)]
    rest = ids[len(sum(chunks, [])):]
    plain, out = TextStream(tok, stop), OutputStream(tok, stop=stop)
    want = [plain.push(c) for c in chunks] + [plain.end(rest, text_end)]
    got = [out.push(c) for c in chunks] + [out.end(rest, text_end)]
    assert [d.content for d in got] == want
    assert out.result() == ParsedOutput(None, "".join(want), [])
    # the pieces add up to one decode of every id, cut where the stop string matched
    assert "".join(want) == tok.decode(ids, True)[:text_end]


@settings(max_examples=200, deadline=None)
@given(_outputs(), st.lists(st.integers(0, 400), max_size=12), st.booleans())
def test_output_stream_of_ids_equals_whole(text: str, cuts: list[int], think: bool) -> None:
    """Marker ids parse as their names however the ids are cut (one byte per id here, so
    multi-byte characters span several), exactly as the whole text parses."""
    tok = _tokenizer()
    ids = tok.encode((TB if think else "") + text, allow_special=True)
    markers = {tok.special_tokens[m] for m in (SB, SE, CB, AB, CE, TB, TE)}
    whole = parse_output(tok.decode([i for i in ids if i < 256 or i in markers]))
    out = OutputStream(tok, tools=True, reasoning=True)
    deltas = _run(out, ids, cuts)
    assert out.result() == whole
    assert "".join(d.reasoning for d in deltas) == (whole.reasoning or "")
    assert "".join(d.content for d in deltas) == whole.content
    assert merge_tool_call_deltas(c for d in deltas for c in d.tool_calls) == whole.tool_calls


# ---------------------------------------------------------------- published reference cases
#
# Inputs and expected results of the reference parsers' own tests, each checked on the whole
# text and streamed one character at a time (the same result both ways; no tool-call marker in
# the content or the reasoning). Expected content None there is "" here; where a reference's
# streaming result differs from its whole-text one, the whole-text one is expected.
#   vLLM  tests/tool_parsers/test_kimi_k2_tool_parser.py              (VT: 31 cases)
#   vLLM  tests/reasoning/test_kimi_k2_reasoning_parser.py            (VR2: 6)
#   vLLM  tests/reasoning/test_kimi_k25_reasoning_parser.py           (VR25: 15)
#   SGLang test/registered/function_call/test_kimik2_detector.py      (SG: 12)
#   sglang-jax test/srt/function_call/test_kimik2_detector.py         (SJ: 15; SGLang's subset)


def _vt(tool_id: str, args: str) -> str:  # vLLM's `_tool`: a space before the argument marker
    return f"{CB}{tool_id} {AB}{args}{CE}"


def _wrap(*calls: str) -> str:
    return SB + "".join(calls) + SE


def _sg(tool_id: str, args: str) -> str:
    return f"{CB}{tool_id}{AB}{args}{CE}"


def _vllm_fn(name: str, *props: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {p: {"type": "string"} for p in props}}}}


WEATHER_T = _vllm_fn("get_weather", "city", "unit")
READ_FILE_T = _vllm_fn("read_file", "path")
BOOK_FLIGHT_T = _vllm_fn("book_flight", "city")
SG_TOOLS = [_vllm_fn("read_file", "path"), _vllm_fn("get_weather", "city", "unit")]
SG_WRITE = {"type": "function", "function": {"name": "write_to_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
    "required": ["path", "content"]}}}
SG_EXEC = {"type": "function", "function": {"name": "execute_command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
NESTED = {"path": "x.md", "content": "# T\n```py\nd={'k': 1}\n```\ndone } { more"}
READ_CALL = f"{SB}{CB}functions.read:0{AB}{{'filePath':'file.txt'}}{CE}{SE}"

# (name, text, options, reasoning, content, calls: [(id or None, name, arguments)]);
# arguments: a dict compares parsed JSON, a string compares exactly
REFERENCE_CASES: list[tuple[str, str, dict[str, Any], str | None, str, list[Any]]] = [
    # ---- vLLM tool parser: TestExtractToolCalls
    ("VT no_tools", "This is a test", {}, None, "This is a test", []),
    ("VT single_tool_call", "I'll check. " + _wrap(_vt("functions.get_weather:0",
                                                        '{"city": "Beijing"}')),
     {}, None, "I'll check. ", [("functions.get_weather:0", "get_weather", {"city": "Beijing"})]),
    ("VT parallel_tool_calls", "Compare weather. " + _wrap(
        _vt("functions.get_weather:0", '{"city": "Beijing"}'),
        _vt("functions.get_weather:1", '{"city": "Shanghai"}')), {}, None, "Compare weather. ",
     [(None, "get_weather", {"city": "Beijing"}), (None, "get_weather", {"city": "Shanghai"})]),
    ("VT three_tool_calls", "Multiple tasks. " + _wrap(
        _vt("functions.get_weather:0", '{"city": "New York"}'),
        _vt("functions.get_news:1", '{"topic": "technology"}'),
        _vt("functions.send_email:2", '{"to": "user@example.com", "subject": "Daily Update"}')),
     {}, None, "Multiple tasks. ",
     [(None, "get_weather", {"city": "New York"}), (None, "get_news", {"topic": "technology"}),
      (None, "send_email", {"to": "user@example.com", "subject": "Daily Update"})]),
    ("VT angle_brackets_in_json", "Process HTML. " + _wrap(
        _vt("functions.process_html:0", '{"html": "<div>content</div>"}')), {}, None,
     "Process HTML. ", [(None, "process_html", {"html": "<div>content</div>"})]),
    ("VT multiline_json", "Formatted. " + _wrap(_vt(
        "functions.process_data:0", '{\n  "name": "test",\n  "value": 123\n}')), {}, None,
     "Formatted. ", [(None, "process_data", {"name": "test", "value": 123})]),
    ("VT no_functions_prefix", "No prefix. " + _wrap(_vt("get_weather:0", '{"city": "Tokyo"}')),
     {}, None, "No prefix. ", [("get_weather:0", "get_weather", {"city": "Tokyo"})]),
    ("VT empty_arguments", "Empty args. " + _wrap(_vt("functions.test:0", "{}")), {}, None,
     "Empty args. ", [(None, "test", {})]),
    ("VT invalid_json_still_extracted", "Help. " + _wrap(
        _vt("functions.bad:0", '{"city": "Beijing"'),
        _vt("functions.good:1", '{"city": "Shanghai"}')), {}, None, "Help. ",
     [(None, "bad", '{"city": "Beijing"'), (None, "good", {"city": "Shanghai"})]),
    ("VT invalid_funcall_id_skipped", "Help. " + _wrap(
        _vt("functions.invalid.0", '{"city": "Beijing"}'),
        _vt("functions.valid:1", '{"city": "Shanghai"}')), {}, None, "Help. ",
     [(None, "valid", {"city": "Shanghai"})]),
    ("VT native_id_extracted", "Checking weather. " + _wrap(
        _vt("functions.get_weather:0", '{"city": "Tokyo"}')), {}, None, "Checking weather. ",
     [("functions.get_weather:0", "get_weather", {"city": "Tokyo"})]),
    ("VT multi_turn_native_id_continuity (turn 2)", "Now let me get news. " + _wrap(
        _vt("functions.get_news:0", '{"topic": "weather in Beijing"}')), {}, None,
     "Now let me get news. ",
     [("functions.get_news:0", "get_news", {"topic": "weather in Beijing"})]),
    ("VT bare_counter", "Let me check. " + _wrap(_vt("0", '{"city": "Tokyo", "unit": "celsius"}')),
     {"tools": [WEATHER_T]}, None, "Let me check. ",
     [("0", "get_weather", {"city": "Tokyo", "unit": "celsius"})]),
    ("VT bare_counter_single_tool_invalid_json_still_extracted",
     "Let me check. " + _wrap(_vt("0", '{"city": "Tokyo"')), {"tools": [WEATHER_T]}, None,
     "Let me check. ", [("0", "get_weather", '{"city": "Tokyo"')]),
    ("VT bare_counter_multiple_tools_infers_by_args",
     "Let me check. " + _wrap(_vt("0", '{"city": "Tokyo", "unit": "celsius"}')),
     {"tools": [READ_FILE_T, WEATHER_T]}, None, "Let me check. ",
     [("0", "get_weather", {"city": "Tokyo", "unit": "celsius"})]),
    ("VT bare_counter_multiple_tools_skips_unsafe_inference[ambiguous]",
     "Let me check. " + _wrap(_vt("0", '{"city": "Tokyo"}')),
     {"tools": [WEATHER_T, BOOK_FLIGHT_T]}, None, "Let me check. ", []),
    ("VT bare_counter_multiple_tools_skips_unsafe_inference[malformed_json]",
     "Let me check. " + _wrap(_vt("0", '{"city": "Tokyo"')),
     {"tools": [WEATHER_T, BOOK_FLIGHT_T]}, None, "Let me check. ", []),
    # ---- vLLM tool parser: streaming classes (their deltas joined; streamed here per char)
    ("VT stream single_tool_call", "I'll help. " + _wrap(_vt("functions.get_weather:0",
                                                            '{"city": "Beijing"} ')),
     {}, None, "I'll help. ", [("functions.get_weather:0", "get_weather", {"city": "Beijing"})]),
    ("VT stream multiple_tool_calls", "Compare weather. " + _wrap(
        _vt("functions.get_weather:0", '{"city": "Tokyo"} '),
        _vt("functions.get_weather:1", '{"city": "NYC"} ')), {}, None, "Compare weather. ",
     [("functions.get_weather:0", "get_weather", {"city": "Tokyo"}),
      ("functions.get_weather:1", "get_weather", {"city": "NYC"})]),
    ("VT stream bare_counter", "I'll help. " + _wrap(_vt("0", '{"city": "Beijing"} ')),
     {"tools": [WEATHER_T]}, None, "I'll help. ", [("0", "get_weather", {"city": "Beijing"})]),
    ("VT stream bare_counter_multiple_tools_infers_by_args", "I'll help. " + _wrap(
        _vt("0", '{"city": "Beijing", "unit": "celsius"} ')), {"tools": [READ_FILE_T, WEATHER_T]},
     None, "I'll help. ", [("0", "get_weather", {"city": "Beijing", "unit": "celsius"})]),
    ("VT stream content_before_tools", "I'll check the weather. " + _wrap(
        _vt("functions.get_weather:0", '{"city": "Tokyo"} ')), {}, None,
     "I'll check the weather. ", [(None, "get_weather", {"city": "Tokyo"})]),
    ("VT stream no_tool_calls", "This is just regular text without tools.", {}, None,
     "This is just regular text without tools.", []),
    ("VT stream incremental_arguments", f'Help. {SB}{CB}functions.get_weather:0 {AB}'
     f'{{"city": "Beijing"}} {CE}{SE}', {}, None, "Help. ",
     [(None, "get_weather", {"city": "Beijing"})]),
    ("VT stream streaming_matches_nonstreaming[parallel_tools]", "Multi. " + _wrap(
        _vt("functions.get_weather:0", '{"city": "Tokyo"}'),
        _vt("functions.get_news:1", '{"topic": "tech"}')), {}, None, "Multi. ",
     [(None, "get_weather", {"city": "Tokyo"}), (None, "get_news", {"topic": "tech"})]),
    ("VT stream noise_between_markers_suppressed", f"Reasoning. {SB} spurious noise {CB}"
     f'functions.test:0 {AB}{{"k": "v"}} {CE}{SE}', {}, None, "Reasoning. ",
     [(None, "test", {"k": "v"})]),
    ("VT stream empty_tool_section", f"Reasoning. {SB}{SE}", {}, None, "Reasoning. ", []),
    ("VT stream three_different_tools", "Multiple tasks. " + _wrap(
        _vt("functions.get_weather:0", '{"city": "NYC"} '),
        _vt("functions.get_news:1", '{"topic": "tech"} '),
        _vt("functions.send_email:2", '{"to": "a@b.com"} ')), {}, None, "Multiple tasks. ",
     [("functions.get_weather:0", "get_weather", {"city": "NYC"}),
      ("functions.get_news:1", "get_news", {"topic": "tech"}),
      ("functions.send_email:2", "send_email", {"to": "a@b.com"})]),
    ("VT stream truncated_tool_call_no_end_marker",
     f'I\'ll check. {SB}{CB}functions.get_weather:0 {AB}{{"city": "Bei', {}, None,
     "I'll check. ", [("functions.get_weather:0", "get_weather", '{"city": "Bei')]),
    # vLLM drops " After tools." (text after the section); kept here: no text is lost
    ("VT stream content_after_tool_section", f"Before. {SB}{CB}functions.get_weather:0 {AB}"
     f'{{"city": "Tokyo"}} {CE}{SE} After tools.', {}, None, "Before.  After tools.",
     [(None, "get_weather", {"city": "Tokyo"})]),
    ("VT intervals plain_text", "This is plain text with no tool calling involved.", {}, None,
     "This is plain text with no tool calling involved.", []),
    # ---- vLLM Kimi K2 reasoning parser (thinking on: the prompt opened <think>)
    ("VR2 with_think_tags", "<think>step by step reasoning</think>final answer",
     {"in_reasoning": True}, "step by step reasoning", "final answer", []),
    ("VR2 empty_thinking", "<think></think>final answer", {"in_reasoning": True}, "",
     "final answer", []),
    ("VR2 implicit_start", "implicit reasoning with no tags", {"in_reasoning": True},
     "implicit reasoning with no tags", "", []),
    # a section left open with no call in it: its text is the content (vLLM's tool parser
    # recovery), where vLLM's reasoning parser alone leaves the section for the tool parser
    ("VR2 tool_section_ends_reasoning", f"some reasoning{SB}tool call data",
     {"in_reasoning": True}, "some reasoning", "tool call data", []),
    ("VR2 streaming_reasoning_then_content", "<think>step one</think>answer",
     {"in_reasoning": True}, "step one", "answer", []),
    ("VR2 streaming_tool_section_ends_reasoning", f"<think>thinking{SB}",
     {"in_reasoning": True}, "thinking", "", []),
    # ---- vLLM Kimi K2.5 reasoning parser (thinking always on)
    ("VR25 simple_reasoning", "This is a reasoning section</think>This is the rest",
     {"in_reasoning": True}, "This is a reasoning section", "This is the rest", []),
    ("VR25 complete_reasoning", "This is a reasoning section</think>", {"in_reasoning": True},
     "This is a reasoning section", "", []),
    ("VR25 no_content_token", "This is content", {"in_reasoning": True}, "This is content", "",
     []),
    ("VR25 multiple_lines", "This\nThat</think>This is the rest\nThat", {"in_reasoning": True},
     "This\nThat", "This is the rest\nThat", []),
    ("VR25 shortest", "</think>This is the rest", {"in_reasoning": True}, "",
     "This is the rest", []),
    ("VR25 reasoning_with_think", "<think>This is a reasoning section</think>This is the rest",
     {"in_reasoning": True}, "This is a reasoning section", "This is the rest", []),
    ("VR25 complete_reasoning_with_think", "<think>This is a reasoning section</think>",
     {"in_reasoning": True}, "This is a reasoning section", "", []),
    ("VR25 multiple_lines_with_think", "<think>This\nThat</think>This is the rest\nThat",
     {"in_reasoning": True}, "This\nThat", "This is the rest\nThat", []),
    ("VR25 think_no_end", "<think>This is a reasoning section", {"in_reasoning": True},
     "This is a reasoning section", "", []),
    ("VR25 empty", "", {"in_reasoning": True}, "", "", []),
    ("VR25 new_line", "\n<think>This is a reasoning section</think>\nThis is the rest",
     {"in_reasoning": True}, "This is a reasoning section", "\nThis is the rest", []),
    ("VR25 tool_call_during_think", f"<think>I should read that file{READ_CALL}",
     {"in_reasoning": True}, "I should read that file", "",
     [("functions.read:0", "read", "{'filePath':'file.txt'}")]),
    ("VR25 tool_call_immediately_after_think", f"<think>{READ_CALL}", {"in_reasoning": True},
     "", "", [("functions.read:0", "read", "{'filePath':'file.txt'}")]),
    ("VR25 tool_call_after_think_end", f"<think>I should read that file</think>{READ_CALL}",
     {"in_reasoning": True}, "I should read that file", "",
     [("functions.read:0", "read", "{'filePath':'file.txt'}")]),
    # the K2.5 parser also ends reasoning at a bare <|tool_call_begin|> (its reasoning-end ids)
    ("VR25 bare_tool_call_begin_ends_reasoning",
     f"<think>I should read that file{CB}functions.read:0{AB}{{}}{CE}", {"in_reasoning": True},
     "I should read that file", "", [("functions.read:0", "read", {})]),
    # ---- SGLang KimiK2Detector
    ("SG detect_and_parse_single", "Let me help. " + _wrap(_sg(
        "functions.execute_command:0", '{"command": "ls"}')), {"tools": [SG_WRITE, SG_EXEC]},
     None, "Let me help. ", [(None, "execute_command", {"command": "ls"})]),
    ("SG detect_and_parse_multiple", _wrap(
        _sg("functions.write_to_file:0", '{"path": "a.txt", "content": "hi"}'),
        _sg("functions.execute_command:1", '{"command": "ls"}')),
     {"tools": [SG_WRITE, SG_EXEC]}, None, "",
     [(None, "write_to_file", {"path": "a.txt", "content": "hi"}),
      (None, "execute_command", {"command": "ls"})]),
    ("SG detect_and_parse_nested_braces_not_truncated", _wrap(
        _sg("functions.write_to_file:0", json.dumps(NESTED))), {"tools": [SG_WRITE, SG_EXEC]},
     None, "", [(None, "write_to_file", NESTED)]),
    ("SG detect_and_parse_no_tool_call", "no tools here", {"tools": [SG_WRITE, SG_EXEC]}, None,
     "no tools here", []),
    ("SG stream_single_call", f'{SB}{CB}functions.execute_command:0{AB}{{"command": "ls"}}{CE}'
     f"{SE}", {"tools": [SG_WRITE, SG_EXEC]}, None, "",
     [(None, "execute_command", {"command": "ls"})]),
    ("SG stream_empty_args", _wrap(_sg("functions.execute_command:0", "{}")),
     {"tools": [SG_WRITE, SG_EXEC]}, None, "", [(None, "execute_command", {})]),
    ("SG stream_prefix_text_preserved", "Sure, doing it now. " + _wrap(_sg(
        "functions.execute_command:0", '{"command": "ls"}')), {"tools": [SG_WRITE, SG_EXEC]},
     None, "Sure, doing it now. ", [(None, "execute_command", {"command": "ls"})]),
    ("SG stream_end_marker_split_two_pieces", f'{SB}{CB}functions.execute_command:0{AB}'
     f'{{"command": "ls"}}{CE}{SE}', {"tools": [SG_WRITE, SG_EXEC]}, None, "",
     [(None, "execute_command", '{"command": "ls"}')]),
    ("SG stream_end_marker_split_many_pieces", f'{SB}{CB}functions.write_to_file:0{AB}'
     f'{{"path": "a.txt", "content": "hello"}}{CE}{SE}', {"tools": [SG_WRITE, SG_EXEC]}, None,
     "", [(None, "write_to_file", {"path": "a.txt", "content": "hello"})]),
    ("SG stream_multiple_calls", _wrap(
        _sg("functions.write_to_file:0", '{"path": "a.txt", "content": "hi"}'),
        _sg("functions.execute_command:1", '{"command": "ls"}')),
     {"tools": [SG_WRITE, SG_EXEC]}, None, "",
     [(None, "write_to_file", {"path": "a.txt", "content": "hi"}),
      (None, "execute_command", {"command": "ls"})]),
    ("SG has_tool_call_true", _wrap(_sg("functions.execute_command:0", "{}")),
     {"tools": [SG_WRITE, SG_EXEC]}, None, "", [(None, "execute_command", {})]),
    ("SG has_tool_call_false", "just some normal assistant text",
     {"tools": [SG_WRITE, SG_EXEC]}, None, "just some normal assistant text", []),
    # ---- sglang-jax's subset of SGLang's detector tests
    ("SJ no_tool_call", "just a normal answer", {"tools": SG_TOOLS}, None,
     "just a normal answer", []),
    ("SJ single_call_with_text_before", "Let me check." + _wrap(_sg(
        "functions.read_file:0", '{"path": "/a.py"}')), {"tools": SG_TOOLS}, None,
     "Let me check.", [(None, "read_file", {"path": "/a.py"})]),
    ("SJ multiple_calls_use_local_tool_index", _wrap(
        _sg("functions.read_file:5", '{"path": "/a.py"}'),
        _sg("functions.get_weather:6", '{"city": "Tokyo"}')), {"tools": SG_TOOLS}, None, "",
     [(None, "read_file", {"path": "/a.py"}), (None, "get_weather", {"city": "Tokyo"})]),
    ("SJ id_without_functions_prefix_and_hyphenated_name",
     _wrap(_sg("mcp__portal__search-docs:2", '{"q": "x"}')),
     {"tools": [_vllm_fn("mcp__portal__search-docs", "q")]}, None, "",
     [(None, "mcp__portal__search-docs", {"q": "x"})]),
    ("SJ bare_counter_id_single_tool", _wrap(_sg("3", '{"q": "x"}')),
     {"tools": [_vllm_fn("search", "q")]}, None, "", [("3", "search", {"q": "x"})]),
    ("SJ bare_counter_id_infers_name_from_arguments", _wrap(_sg("0", '{"city": "Tokyo"}')),
     {"tools": SG_TOOLS}, None, "", [("0", "get_weather", {"city": "Tokyo"})]),
    ("SJ bare_counter_id_with_unknown_arguments_is_skipped", _wrap(_sg("0", '{"unknown": 1}')),
     {"tools": [_vllm_fn("a"), _vllm_fn("b")]}, None, "", []),
    ("SJ unparsable_id_is_skipped", _wrap(
        _sg("weird@id", '{"city": "London"}'),
        _sg("functions.get_weather:1", '{"city": "Delhi"}')), {"tools": SG_TOOLS}, None, "",
     [(None, "get_weather", {"city": "Delhi"})]),
    ("SJ single_call_across_chunks", f'Checking. {SB}{CB}functions.get_weather:0{AB}'
     f'{{"city": "Paris"}}{CE}{SE}', {"tools": SG_TOOLS}, None, "Checking. ",
     [(None, "get_weather", '{"city": "Paris"}')]),
    ("SJ two_calls_keep_raw_arguments", _wrap(
        _sg("functions.read_file:0", '{"path": "/a.py"}'),
        _sg("functions.get_weather:1", '{"city": "Paris"}')), {"tools": SG_TOOLS}, None, "",
     [(None, "read_file", '{"path": "/a.py"}'), (None, "get_weather", '{"city": "Paris"}')]),
    ("SJ trailing_left_angle_is_not_dropped", "a < b <", {"tools": SG_TOOLS}, None, "a < b <",
     []),
    ("SJ orphan_tool_call_begin_is_discarded", f"{SB}{CB}functions.read_file:0"
     + _sg("functions.get_weather:1", '{"city": "Oslo"}') + SE, {"tools": SG_TOOLS}, None, "",
     [(None, "get_weather", '{"city": "Oslo"}')]),
    ("SJ whitespace_inside_section_is_not_content",
     "Checking.\n" + SB + "\n" + _sg("functions.read_file:0", '{"path": "/a"}') + "\n"
     + _sg("functions.get_weather:1", '{"city": "A"}') + "\n" + SE + "\n",
     {"tools": SG_TOOLS}, None, "Checking.\n",
     [(None, "read_file", {"path": "/a"}), (None, "get_weather", {"city": "A"})]),
    ("SJ argument_whitespace_is_stripped", f'{SB}{CB}functions.get_weather:0{AB} '
     f'{{"city": "A"}} \n{CE}{SE}', {"tools": SG_TOOLS}, None, "",
     [(None, "get_weather", '{"city": "A"}')]),
    ("SJ registered_and_parse_non_stream", "ok" + _wrap(_sg("functions.read_file:0",
                                                            '{"path": "/a"}')),
     {"tools": SG_TOOLS}, None, "ok", [(None, "read_file", {"path": "/a"})]),
]


def _streamed(text: str, **options: Any) -> ParsedOutput:
    parser = OutputParser(**options)
    deltas = [parser.feed(c) for c in text] + [parser.finish()]
    return ParsedOutput(
        "".join(d.reasoning for d in deltas) if parser.reasoning_started else None,
        "".join(d.content for d in deltas),
        merge_tool_call_deltas(c for d in deltas for c in d.tool_calls))


@pytest.mark.parametrize(("text", "options", "reasoning", "content", "calls"),
                         [c[1:] for c in REFERENCE_CASES], ids=[c[0] for c in REFERENCE_CASES])
def test_reference_case(text: str, options: dict[str, Any], reasoning: str | None,
                        content: str, calls: list[Any]) -> None:
    whole = parse_output(text, **options)
    assert _streamed(text, **options) == whole
    assert whole.reasoning == reasoning
    assert whole.content == content
    assert len(whole.tool_calls) == len(calls)
    for k, (call, (cid, name, args)) in enumerate(zip(whole.tool_calls, calls)):
        assert (call.index, call.name) == (k, name)
        if cid is not None:
            assert call.id == cid
        assert (json.loads(call.arguments) if isinstance(args, dict) else call.arguments) == args
    for m in _TOOL_MARKERS:
        assert m not in whole.content and m not in (whole.reasoning or "")
    message = whole.to_openai()
    assert message["content"] == (None if calls and not content else content)
    assert [c["function"]["name"] for c in message["tool_calls"] or []] == [c[1] for c in calls]


def test_reference_reasoning_alone_keeps_the_section_for_the_tool_parser() -> None:
    """vLLM's reasoning-parser cases whose expected content is the tool-call section."""
    got = parse_reasoning(f"some reasoning{SB}tool call data", in_reasoning=True)
    assert (got.reasoning, got.content) == ("some reasoning", f"{SB}tool call data")
    for text, want in [(f"<think>I should read that file{READ_CALL}", "I should read that file"),
                       (f"<think>{READ_CALL}", ""),
                       (f"<think>I should read that file</think>{READ_CALL}",
                        "I should read that file")]:
        got = parse_reasoning(text, in_reasoning=True)
        assert (got.reasoning, got.content) == (want, READ_CALL)


def test_output_stream_names_calls_from_the_request_tools(tok: Tokenizer) -> None:
    """What the server passes: the request's tools name a K2.5 bare-counter call."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}},
             {"type": "function", "function": {"name": "get_time", "parameters": {
                 "type": "object", "properties": {"tz": {"type": "string"}}}}}]
    text = "ok" + _section(("0", '{"tz": "UTC"}'), ("1", '{"city": "Oslo"}'), ("2", '{"x": 1}'))
    ids = tok.encode(text, allow_special=True)
    for cuts in ([], list(range(len(ids)))):
        out = OutputStream(tok, tools=True, request_tools=tools)
        _run(out, ids, cuts)
        assert out.result() == parse_output(text, tools=tools)
        assert [(c.index, c.id, c.name) for c in out.result().tool_calls] == [
            (0, "0", "get_time"), (1, "1", "get_weather")]
        assert out.result().content == "ok"
    out = OutputStream(tok, tools=True)  # without the request's tools nothing names them
    _run(out, ids, [])
    assert out.result() == ParsedOutput(None, "ok", [])


def test_text_stream_keeps_only_what_has_not_left() -> None:
    """A long answer's stream keeps only the text it holds back (for a stop string), not the
    whole text, and its pieces still add up to one decode cut at the stop."""
    tok = _tokenizer()
    ids = tok.encode("ab\nc" * 3000 + "STOP")  # the last step completes the stop string
    text = tok.decode(ids, True)
    chunks = [ids[i:i + 4] for i in range(0, len(ids), 4)]
    stream = TextStream(tok, ["STOP"])
    out, held = [], 0
    for c in chunks[:-1]:
        out.append(stream.push(c))
        held = max(held, len(stream._rest))
    out.append(stream.end(chunks[-1], text.find("STOP")))
    assert held <= 3  # the characters a stop string may still begin in, no more
    assert "".join(out) == text[:text.find("STOP")] and stream.length == len(text)
