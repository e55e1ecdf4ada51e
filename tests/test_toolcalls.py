from __future__ import annotations

import functools
import json

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


def _stream_tools(chunks: list[str]) -> tuple[str, list[ToolCall], list[ToolCallDelta]]:
    parser = ToolCallParser()
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
    "text",
    [
        f"x{SB}junk{CB}functions.f:0{AB}{{}}{CE}{SE}y",  # text before the first call
        f"x{SB}{SE}y",  # empty section
        f"x{SB}  {SE}",
        f"x{SB}{CB}no_index{AB}{{}}{CE}{SE}",  # bad id
        f"x{SB}{CB}functions.f:0{CE}{SE}",  # no argument marker
        f"x{SB}{CB}functions.f:0{SB}{AB}{{}}{CE}{SE}",  # marker inside the id
        f"x{SB}{CB}functions.f:0",  # ends inside the id
        f"x{SB}{CB}",
        f"x{SB}",
        f"x{SB}{CB}" + "y" * (MAX_ID_CHARS + 5) + f":0{AB}{{}}{CE}{SE}",
        f"{CB}functions.f:0{AB}{{}}{CE}{SE}",  # no section
        f"{AB}{CE}{SE} <|tool_calls_section <|tool_calls_section_beginning|>",
        f"{TB}not reasoning here{TE}",
    ],
)
def test_malformed_sections_are_content(text: str) -> None:
    got = parse_tool_calls(text)
    assert got.tool_calls == []
    assert got.content == text
    for cut in range(len(text) + 1):
        assert _stream_tools([text[:cut], text[cut:]])[:2] == (text, [])


def test_malformed_call_after_a_good_one_is_content_from_its_begin() -> None:
    good = f"{CB}functions.f:0{AB}{{}}{CE}"
    got = parse_tool_calls(f"{SB}{good}{CB}oops{AB}{{}}{CE}{SE}")
    assert got.tool_calls == [ToolCall(0, "functions.f:0", "f", "{}")]
    assert got.content == f"{CB}oops{AB}{{}}{CE}{SE}"
    got = parse_tool_calls(f"{SB}{good} trailing words {SE}!")
    assert got.tool_calls == [ToolCall(0, "functions.f:0", "f", "{}")]
    assert got.content == f"trailing words {SE}!"


def test_a_later_section_still_parses_after_a_broken_one() -> None:
    text = f"{SB}broken{SE} then {_section(('functions.g:1', '{}'))}"
    got = parse_tool_calls(text)
    assert got.content == f"{SB}broken{SE} then "
    assert got.tool_calls == [ToolCall(0, "functions.g:1", "g", "{}")]


def test_missing_call_end_is_implied() -> None:
    text = f'{SB}{CB}functions.f:0{AB}{{"a": 1}}{CB}functions.g:1{AB}[]{SE}after'
    got = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in got.tool_calls] == [("f", '{"a": 1}'), ("g", "[]")]
    assert got.content == "after"
    truncated = parse_tool_calls(f'ok{SB}{CB}functions.f:0{AB} {{"a": ')
    assert truncated.content == "ok"
    assert truncated.tool_calls == [ToolCall(0, "functions.f:0", "f", '{"a":')]


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
                (f"functions.{draw(st.sampled_from(['f', 'get_weather', 'a.b']))}:{k}",
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
    if not whole.tool_calls:
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
    # nothing is lost but the markers that delimit the reasoning
    if whole.reasoning is None:
        assert whole.content == text
    else:
        body = text[len(TB):] if text.startswith(TB) else text
        assert body.startswith(whole.reasoning)
        rest = body[len(whole.reasoning):]
        assert rest == TE + whole.content or rest == whole.content and (
            rest == "" or rest.startswith(SB)
        )


@settings(max_examples=200, deadline=None)
@given(_outputs(), st.lists(st.integers(0, 200), max_size=12), st.booleans(), st.booleans())
def test_output_stream_equals_whole(text: str, cuts: list[int], think: bool,
                                    implicit: bool) -> None:
    text = (TB if think else "") + text
    whole = parse_output(text, in_reasoning=implicit)
    parser = OutputParser(in_reasoning=implicit)
    deltas = [parser.feed(c) for c in _chunks(text, cuts)] + [parser.finish()]
    assert "".join(d.reasoning for d in deltas) == (whole.reasoning or "")
    assert "".join(d.content for d in deltas) == whole.content
    assert merge_tool_call_deltas(t for d in deltas for t in d.tool_calls) == whole.tool_calls


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
    # only the parsers' own markers are kept: with tools alone, <think> leaves no text
    out = OutputStream(tok, tools=True)
    _run(out, ids, [])
    assert out.result().content == f"ab{SB}c{CB}de"


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
        assert out.result() == ParsedOutput(f"a{CE}", "", [])


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
