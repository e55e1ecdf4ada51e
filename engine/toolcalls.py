"""Kimi K2 tool-call and reasoning parsing of generated text (decoded with special tokens kept).

Pure Python parsers (no torch, no server imports; OutputStream decodes ids with engine.tokenizer).
Every parser is incremental: `feed(text_delta)` returns what became certain, `finish()` flushes
what was held back. The whole-text functions feed the full text once and finish, so whole and
streamed parsing agree by construction, for any split of the text. No input raises.

Tool calls (vLLM/SGLang `kimi_k2` format)::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:{i}
    <|tool_call_argument_begin|>{JSON arguments}<|tool_call_end|>...<|tool_calls_section_end|>

- `parse_tool_calls(text) -> ToolParseResult(content, tool_calls: list[ToolCall])`.
- `ToolCallParser().feed(delta) / .finish() -> ToolParseDelta(content, tool_calls:
  tuple[ToolCallDelta, ...])`. OpenAI streaming semantics: a call's first delta carries its
  `index` (0-based position among this output's calls), `id` (`functions.get_weather:0`, as
  generated) and `name` (`get_weather`: the id without a leading `functions.` and the trailing
  `:{i}`); later deltas carry the same `index` and argument fragments only. Concatenating a
  call's fragments gives its arguments (surrounding whitespace stripped; the JSON is passed on
  as generated, not validated). `ToolCallDelta.to_openai()` gives the
  `choices[].delta.tool_calls[]` dict, `merge_tool_call_deltas` the finished calls.
- Whitespace may separate the markers. A call exists once its id is complete (at
  `<|tool_call_argument_begin|>`): from then on its arguments stream, and a missing
  `<|tool_call_end|>` is implied by the next `<|tool_call_begin|>`, by
  `<|tool_calls_section_end|>` or by the end of the text (arguments as far as generated).
- Malformed input becomes content, verbatim: a section whose first call is broken or missing
  (an empty section; text other than whitespace before `<|tool_call_begin|>`; an id that is
  not `[functions.]name:digits` or is longer than MAX_ID_CHARS; another marker inside the id;
  the text ending before the id is complete) is content from its
  `<|tool_calls_section_begin|>` on; a later broken call is content from its
  `<|tool_call_begin|>` on; text after a finished call that is neither whitespace nor a marker
  is content from there on. Content is then scanned again, so a later well-formed section still
  parses. Markers outside a section are content. An output without a recognised call thus comes
  back as content, unchanged.

Reasoning (`<think>...</think>`):

- `parse_reasoning(text, in_reasoning=False) -> ReasoningResult(reasoning: str | None,
  content)`; `ReasoningParser(in_reasoning).feed / .finish -> ReasoningDelta(reasoning,
  content)`.
- Reasoning starts with a leading `<think>` in the output, or implicitly when the prompt ended
  with `<think>` (`in_reasoning=True`; `prompt_opens_reasoning(prompt_text)` tells, e.g. K2.5's
  thinking generation prompt; K2.5's instant prompt ends with `<think></think>`). It ends at
  `</think>` (dropped) or at `<|tool_calls_section_begin|>` (kept: it begins the content, for
  the tool parser). Output that never enters reasoning is all content (`reasoning` None).

Both together: `parse_output(text, ...) -> ParsedOutput(reasoning, content, tool_calls)` and
`OutputParser(...).feed / .finish -> OutputDelta(reasoning, content, tool_calls)`: the reasoning
parser first, the tool parser on its content.

From token ids (what a server streams): `OutputStream(tokenizer, prompt_ids, stop, tools=,
reasoning=, only=)`; `push(ids)` and `end(ids, text_end)` return `OutputDelta`s, `result()` the
whole `ParsedOutput`, `finish_reason(reason)` says `tool_calls` for a stop after calls. The text
is `tokenizer.decode(ids, skip_special_tokens=True)`, released by an `engine.tokenizer.TextStream`
(the longest stop string less one character waits, and `end` cuts at `text_end`, an offset in
that text), plus the names of the special ids among the parsers' markers (tool-call markers with
`tools`, `<think>`/`</think>` with `reasoning`) where they were generated; a marker id leaves
with the text before it (one right at a cut comes before it). Without markers to parse, the
content is exactly the TextStream text. Reasoning is implicit when the prompt ids end in
`<think>`. `only` keeps the calls of that function (others are dropped) and renumbers them from
0. `to_openai()` of a delta or a result gives the fields of an OpenAI chat `delta` or `message`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.tokenizer import TextStream, Tokenizer

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
THINK_BEGIN = "<think>"
THINK_END = "</think>"

# A call id longer than this (without <|tool_call_argument_begin|> yet) is not a call id.
MAX_ID_CHARS = 512

_ALL_MARKERS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END)
_ARGS_ENDS = (CALL_END, CALL_BEGIN, SECTION_END)
_INDEX_RE = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class ToolCall:
    """A finished tool call: OpenAI `tool_calls[index]`."""

    index: int
    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of one tool call: the first piece has `id` and `name`, later ones None."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI streaming `delta.tool_calls[]` entry."""
        out: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            function = {"name": self.name, **function}
        out["function"] = function
        return out


_P = TypeVar("_P", bound="_Pieces")


class _Pieces:
    """`a + b`: each field of `a` followed by the same field of `b` (a piece, then the next)."""

    def __add__(self: _P, other: _P) -> _P:
        fields = dataclasses.fields(self)  # type: ignore[arg-type]
        return type(self)(*(getattr(self, f.name) + getattr(other, f.name) for f in fields))


@dataclass(frozen=True)
class ToolParseDelta(_Pieces):
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()


@dataclass(frozen=True)
class ToolParseResult:
    content: str
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ReasoningDelta(_Pieces):
    reasoning: str = ""
    content: str = ""


@dataclass(frozen=True)
class ReasoningResult:
    reasoning: str | None
    content: str


@dataclass(frozen=True)
class OutputDelta(_Pieces):
    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def to_openai(self) -> dict[str, Any]:
        """The fields of an OpenAI chat stream's `delta` (None where this piece has nothing)."""
        return {"content": self.content or None, "reasoning_content": self.reasoning or None,
                "tool_calls": [c.to_openai() for c in self.tool_calls] or None}


@dataclass(frozen=True)
class ParsedOutput:
    reasoning: str | None
    content: str
    tool_calls: list[ToolCall]

    def to_openai(self) -> dict[str, Any]:
        """The fields of an OpenAI chat `message`: content None only beside tool calls."""
        return {"content": None if self.tool_calls and not self.content else self.content,
                "reasoning_content": self.reasoning,
                "tool_calls": [c.to_openai() for c in self.tool_calls] or None}


def _held_suffix(buf: str, markers: Iterable[str]) -> int:
    """Length of the longest end of `buf` that is a proper beginning of one of `markers`."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(buf)), best, -1):
            if buf.endswith(m[:k]):
                best = k
                break
    return best


def _first(buf: str, markers: Iterable[str]) -> tuple[int, str] | None:
    found: tuple[int, str] | None = None
    for m in markers:
        i = buf.find(m)
        if i >= 0 and (found is None or i < found[0]):
            found = (i, m)
    return found


def parse_call_id(raw: str) -> str | None:
    """The function name in a Kimi call id (`functions.get_weather:0` -> `get_weather`), or None
    when `raw` (whitespace around it allowed) is not `[functions.]{name}:{digits}`."""
    if len(raw) > MAX_ID_CHARS:
        return None
    head, colon, index = raw.strip().rpartition(":")
    name = head.removeprefix("functions.")
    if not colon or not _INDEX_RE.fullmatch(index) or len(name.split()) != 1:
        return None  # no index, or a name that is empty or holds whitespace
    return name


def _merge(deltas: Iterable[ToolCallDelta]) -> tuple[ToolCallDelta, ...]:
    """One delta per call (in order of first appearance): its id, name and joined arguments."""
    parts: dict[int, list[Any]] = {}
    for d in deltas:
        entry = parts.setdefault(d.index, [None, None, []])
        if d.id is not None:
            entry[0] = d.id
        if d.name is not None:
            entry[1] = d.name
        entry[2].append(d.arguments)
    return tuple(ToolCallDelta(i, e[0], e[1], "".join(e[2])) for i, e in parts.items())


def merge_tool_call_deltas(deltas: Iterable[ToolCallDelta]) -> list[ToolCall]:
    """Finished calls from streamed deltas, in index order."""
    return [ToolCall(d.index, d.id or "", d.name or "", d.arguments)
            for d in sorted(_merge(deltas), key=lambda d: d.index)]


_NORMAL, _OPEN, _ID, _ARGS = range(4)


class ToolCallParser:
    """Incremental Kimi tool-call parser (see the module docstring for the rules)."""

    def __init__(self) -> None:
        self._buf = ""  # text not yet consumed
        self._state = _NORMAL
        self._anchor = ""  # marker where the unfinished element began ("" if none)
        self._held = ""  # original text since the anchor (anchor included)
        self._id = ""  # id text of the call being read
        self._section_calls = 0  # calls started in the current section
        self._count = 0  # calls so far: the index of the next one
        self._args_started = False
        self._pending_ws = ""  # trailing whitespace of the arguments, held back
        self._content: list[str] = []  # what the current feed()/finish() produces
        self._calls: list[ToolCallDelta] = []

    def feed(self, text: str) -> ToolParseDelta:
        """Consumes a text delta; returns the content and call pieces it made certain."""
        self._buf += text
        return self._run(final=False)

    def finish(self) -> ToolParseDelta:
        """Flushes held-back text (the output ended); the parser may then be fed again."""
        delta = self._run(final=True)
        self._state, self._buf, self._anchor, self._held = _NORMAL, "", "", ""
        return delta

    def _run(self, final: bool) -> ToolParseDelta:
        self._content, self._calls = [], []
        while self._step(final):
            pass
        return ToolParseDelta("".join(self._content), _merge(self._calls))

    def _abandon(self) -> None:
        """The unfinished element is malformed: its anchor is content, the rest is scanned
        again as ordinary text."""
        self._content.append(self._anchor)
        self._buf = self._held[len(self._anchor) :] + self._buf
        self._anchor = self._held = self._id = ""
        self._state = _NORMAL

    def _step(self, final: bool) -> bool:
        buf = self._buf
        if self._state == _NORMAL:
            i = buf.find(SECTION_BEGIN)
            if i >= 0:
                self._content.append(buf[:i])
                self._buf = buf[i + len(SECTION_BEGIN) :]
                self._state, self._section_calls = _OPEN, 0
                self._anchor = self._held = SECTION_BEGIN
                return True
            keep = 0 if final else _held_suffix(buf, (SECTION_BEGIN,))
            self._content.append(buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep :]
            return False
        if self._state == _OPEN:
            rest = buf.lstrip()
            ws = buf[: len(buf) - len(rest)]
            if rest.startswith(CALL_BEGIN):
                if self._section_calls == 0:
                    self._held += ws + CALL_BEGIN
                else:
                    self._anchor = self._held = CALL_BEGIN
                self._buf = rest[len(CALL_BEGIN) :]
                self._state, self._id = _ID, ""
                return True
            if rest.startswith(SECTION_END) and self._section_calls:
                self._buf = rest[len(SECTION_END) :]
                self._state, self._anchor, self._held = _NORMAL, "", ""
                return True
            waiting = not rest or CALL_BEGIN.startswith(rest) or SECTION_END.startswith(rest)
            if waiting and not final:
                return False
            if self._section_calls == 0:  # the first call never came: all of it is content
                self._held += ws
                self._buf = rest
                self._abandon()
            else:  # after a finished call: the text from here on is content
                self._buf = rest
                self._state, self._anchor, self._held = _NORMAL, "", ""
            return True
        if self._state == _ID:
            found = _first(buf, _ALL_MARKERS)
            if found is not None:
                i, marker = found
                self._id += buf[:i]
                self._held += buf[:i]
                self._buf = buf[i:]
                name = parse_call_id(self._id) if marker == ARGUMENT_BEGIN else None
                if name is None:
                    self._abandon()
                    return True
                self._buf = buf[i + len(ARGUMENT_BEGIN) :]
                self._calls.append(ToolCallDelta(self._count, self._id.strip(), name))
                self._count += 1
                self._section_calls += 1
                self._state, self._anchor, self._held, self._id = _ARGS, "", "", ""
                self._args_started, self._pending_ws = False, ""
                return True
            keep = 0 if final else _held_suffix(buf, _ALL_MARKERS)
            self._id += buf[: len(buf) - keep]
            self._held += buf[: len(buf) - keep]
            self._buf = buf[len(buf) - keep :]
            if final or len(self._id) > MAX_ID_CHARS:
                self._abandon()
                return True
            return False
        # _ARGS
        found = _first(buf, _ARGS_ENDS)
        if found is not None:
            i, marker = found
            self._arguments(buf[:i], end=True)
            self._buf = buf[i + len(marker) :]
            if marker == CALL_END:
                self._state = _OPEN
            elif marker == CALL_BEGIN:
                self._state, self._id = _ID, ""
                self._anchor = self._held = CALL_BEGIN
            else:
                self._state = _NORMAL
            return True
        keep = 0 if final else _held_suffix(buf, _ARGS_ENDS)
        self._arguments(buf[: len(buf) - keep], end=final)
        self._buf = buf[len(buf) - keep :]
        if final:
            self._state = _NORMAL
        return False

    def _arguments(self, text: str, end: bool) -> None:
        if not self._args_started:
            text = text.lstrip()
            if not text:
                return
            self._args_started = True
        text = self._pending_ws + text
        body = text.rstrip()
        self._pending_ws = "" if end else text[len(body) :]
        if body:
            self._calls.append(ToolCallDelta(self._count - 1, arguments=body))


def parse_tool_calls(text: str) -> ToolParseResult:
    """Content and tool calls of a whole generated text."""
    parser = ToolCallParser()
    d = parser.feed(text) + parser.finish()
    return ToolParseResult(d.content, merge_tool_call_deltas(d.tool_calls))


# ---------------------------------------------------------------- reasoning

_START, _REASONING, _CONTENT = range(3)


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt leaves the model inside `<think>` (K2.5 thinking mode)."""
    return prompt.rstrip().endswith(THINK_BEGIN)


class ReasoningParser:
    """Incremental `<think>...</think>` splitter (see the module docstring)."""

    def __init__(self, in_reasoning: bool = False) -> None:
        self._implicit = in_reasoning
        self._state = _START
        self._buf = ""
        self.started = in_reasoning  # whether any reasoning (maybe empty) was seen

    def feed(self, text: str) -> ReasoningDelta:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> ReasoningDelta:
        return self._run(final=True)

    def _run(self, final: bool) -> ReasoningDelta:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            buf = self._buf
            if self._state == _START:
                if buf.startswith(THINK_BEGIN):
                    self._buf = buf[len(THINK_BEGIN) :]
                    self._state, self.started = _REASONING, True
                    continue
                if THINK_BEGIN.startswith(buf) and not final:
                    break
                self._state = _REASONING if self._implicit else _CONTENT
                continue
            if self._state == _CONTENT:
                content.append(buf)
                self._buf = ""
                break
            found = _first(buf, (THINK_END, SECTION_BEGIN))
            if found is not None:
                i, marker = found
                reasoning.append(buf[:i])
                self._buf = buf[i + len(THINK_END) :] if marker == THINK_END else buf[i:]
                self._state = _CONTENT
                continue
            keep = 0 if final else _held_suffix(buf, (THINK_END, SECTION_BEGIN))
            reasoning.append(buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep :]
            break
        return ReasoningDelta("".join(reasoning), "".join(content))


def parse_reasoning(text: str, in_reasoning: bool = False) -> ReasoningResult:
    """Reasoning and content of a whole generated text."""
    parser = ReasoningParser(in_reasoning)
    d = parser.feed(text) + parser.finish()
    return ReasoningResult(d.reasoning if parser.started else None, d.content)


# ---------------------------------------------------------------- both


class OutputParser:
    """Reasoning, content and tool calls of a streamed output. `reasoning=False` treats all
    text as content (instant mode); `tools=False` leaves tool-call markup in the content."""

    def __init__(
        self, *, reasoning: bool = True, in_reasoning: bool = False, tools: bool = True
    ) -> None:
        self._reasoning = ReasoningParser(in_reasoning) if reasoning else None
        self._tools = ToolCallParser() if tools else None

    @property
    def reasoning_started(self) -> bool:
        return self._reasoning is not None and self._reasoning.started

    def feed(self, text: str) -> OutputDelta:
        r = self._reasoning.feed(text) if self._reasoning else ReasoningDelta("", text)
        return self._tool_step(r, final=False)

    def finish(self) -> OutputDelta:
        r = self._reasoning.finish() if self._reasoning else ReasoningDelta()
        return self._tool_step(r, final=True)

    def _tool_step(self, r: ReasoningDelta, final: bool) -> OutputDelta:
        if self._tools is None:
            return OutputDelta(r.reasoning, r.content)
        t = self._tools.feed(r.content)
        if final:
            t += self._tools.finish()
        return OutputDelta(r.reasoning, t.content, t.tool_calls)


def parse_output(
    text: str, *, reasoning: bool = True, in_reasoning: bool = False, tools: bool = True
) -> ParsedOutput:
    """Reasoning, content and tool calls of a whole generated text."""
    parser = OutputParser(reasoning=reasoning, in_reasoning=in_reasoning, tools=tools)
    d = parser.feed(text) + parser.finish()
    return ParsedOutput(d.reasoning if parser.reasoning_started else None, d.content,
                        merge_tool_call_deltas(d.tool_calls))


# ---------------------------------------------------------------- token ids

# Prompt ids decoded to see whether the prompt ends in `<think>` (ordinary text needs up to 7).
PROMPT_TAIL_IDS = 16


class OutputStream:
    """Reasoning, content and tool calls of generated token ids (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 stop: Sequence[str] = (), *, tools: bool = False, reasoning: bool = False,
                 only: str | None = None) -> None:
        names = (_ALL_MARKERS if tools else ()) + ((THINK_BEGIN, THINK_END) if reasoning else ())
        specials = tokenizer.special_tokens
        self._markers = {specials[m]: m for m in names if m in specials}
        opens = reasoning and prompt_opens_reasoning(
            tokenizer.decode(list(prompt_ids[-PROMPT_TAIL_IDS:])))
        self._parser = OutputParser(reasoning=reasoning, in_reasoning=opens, tools=tools)
        self._text = TextStream(tokenizer, stop)  # the text without special ids
        self._at: list[tuple[int, str]] = []  # markers not yet released: (offset in text, name)
        self._only = only
        self._index: dict[int, int | None] = {}  # the parser's call index -> ours (None: dropped)
        self._parts: tuple[list[str], list[str], list[ToolCallDelta]] = ([], [], [])

    def push(self, ids: Sequence[int]) -> OutputDelta:
        """What the new `ids` made certain."""
        self._take(ids)
        return self._release(self._text.push(), final=False)

    def end(self, ids: Sequence[int], text_end: int | None = None) -> OutputDelta:
        """The rest, the output ending with `ids` (cut at `text_end`, where a stop string
        matched)."""
        self._take(ids)
        return self._release(self._text.end(text_end=text_end), final=True)

    def result(self) -> ParsedOutput:
        """Everything released so far."""
        reasoning, content, calls = self._parts
        return ParsedOutput("".join(reasoning) if self._parser.reasoning_started else None,
                            "".join(content), merge_tool_call_deltas(calls))

    def finish_reason(self, reason: str) -> str:
        """`tool_calls` when the model stopped after calling tools, else `reason`."""
        return "tool_calls" if reason == "stop" and self._parts[2] else reason

    def _take(self, ids: Sequence[int]) -> None:
        """Decodes `ids`, each run between marker ids at once, noting where the markers came."""
        start = 0
        for k, t in enumerate(ids):
            if t in self._markers:
                self._text.add(ids[start:k])
                self._at.append((len(self._text.text), self._markers[t]))
                start = k + 1
        self._text.add(ids[start:])

    def _release(self, piece: str, final: bool) -> OutputDelta:
        """Parses the text just released (`piece`, ending at `sent`) with the markers up to its
        end in place."""
        text, sent = self._text.text, self._text.sent
        pieces, pos = [], sent - len(piece)
        while self._at and self._at[0][0] <= sent:
            at, name = self._at.pop(0)
            pieces += [text[pos:at], name]
            pos = at
        d = self._parser.feed("".join(pieces) + text[pos:sent])
        if final:
            d += self._parser.finish()
        calls = tuple(self._renumber(d.tool_calls))
        reasoning, content, kept = self._parts
        reasoning.append(d.reasoning)
        content.append(d.content)
        kept += calls
        return OutputDelta(d.reasoning, d.content, calls)

    def _renumber(self, calls: Iterable[ToolCallDelta]) -> Iterable[ToolCallDelta]:
        for c in calls:
            if c.index not in self._index:
                keep = self._only is None or c.name == self._only
                kept = sum(i is not None for i in self._index.values())
                self._index[c.index] = kept if keep else None
            index = self._index[c.index]
            if index is not None:
                yield dataclasses.replace(c, index=index)
