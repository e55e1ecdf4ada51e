"""Kimi K2 tool-call and reasoning parsing of generated text (decoded with special tokens kept).

Pure Python parsers (no torch, no server imports; OutputStream decodes ids with engine.tokenizer).
Every parser is incremental: `feed(text_delta)` returns what became certain, `finish()` flushes
what was held back. The whole-text functions feed the full text once and finish, so whole and
streamed parsing agree by construction, for any split of the text. No input raises.

Tool calls (vLLM/SGLang `kimi_k2` format)::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:{i}
    <|tool_call_argument_begin|>{JSON arguments}<|tool_call_end|>...<|tool_calls_section_end|>

- `parse_tool_calls(text, tools=None) -> ToolParseResult(content, tool_calls: list[ToolCall])`;
  `tools` is the request's tools (OpenAI format), used only to name calls (below).
- `ToolCallParser(tools).feed(delta) / .finish() -> ToolParseDelta(content, tool_calls:
  tuple[ToolCallDelta, ...])`. OpenAI streaming semantics: a call's first delta carries its
  `index` (0-based position among this output's calls), `id` (`functions.get_weather:0`, as
  generated) and `name` (`get_weather`: the id without a leading `functions.` and the trailing
  `:{i}`); later deltas carry the same `index` and argument fragments only. Concatenating a
  call's fragments gives its arguments (surrounding whitespace stripped; the JSON is passed on
  as generated, not validated). `ToolCallDelta.to_openai()` gives the
  `choices[].delta.tool_calls[]` dict, `merge_tool_call_deltas` the finished calls.
- A call exists once its id is complete (at `<|tool_call_argument_begin|>`): from then on its
  arguments stream, and a missing `<|tool_call_end|>` is implied by the next
  `<|tool_call_begin|>`, by a section marker or by the end of the text (arguments as far as
  generated). An id that names no function (a bare counter `0`, as K2.5 emits; a client's
  `call_3`, `toolu_01...` or UUID, after a client rewrote the history's ids: letters, digits,
  `_` and `-`) takes its name from the request's tools: the only one, else, once its arguments
  are complete, the one whose schema they fit (a JSON object whose keys are all declared
  properties and hold every required one); such a call then arrives in one delta.
- Nothing is lost to a malformed call but the call itself, and no marker ever reaches the
  content: a call whose id is neither form (or has no tools to name it, or fits no single
  tool), is longer than MAX_ID_CHARS, or never reaches `<|tool_call_argument_begin|>` is
  dropped, and the calls around it are kept; text inside a section that is not a call (noise
  before the first call, `", "` between calls, an empty or unparseable section) is dropped at
  the marker that follows it; whitespace right after a section is dropped unless text follows.
- No text is lost to a section that never closes (the answer ran out of tokens, the model
  wandered): the text after its last marker is content when the output ends there (unless only
  whitespace), or as soon as it runs past MAX_SECTION_TEXT characters without a marker (the
  section is then over), as vLLM's parser recovers; an id cut at MAX_ID_CHARS counts as such
  text. A call cut short keeps its arguments as far as generated (above). A bare
  `<|tool_call_begin|>` outside a section opens one call as if a section had begun (K2.5 may
  emit one without the section); if that call never gets its arguments, its text is content.
  Other markers outside a section are dropped. Text after a section is content.

Reasoning (`<think>...</think>`):

- `parse_reasoning(text, in_reasoning=False) -> ReasoningResult(reasoning: str | None,
  content)`; `ReasoningParser(in_reasoning).feed / .finish -> ReasoningDelta(reasoning,
  content)`.
- Reasoning starts with a leading `<think>` in the output (whitespace before it is dropped too,
  as vLLM's Kimi parsers do), or implicitly when the prompt ended with `<think>`
  (`in_reasoning=True`; `prompt_opens_reasoning(prompt_text)` tells, e.g. K2.5's thinking
  generation prompt; K2.5's instant prompt ends with `<think></think>`). It ends at `</think>`
  (dropped) or where tool calls begin, at `<|tool_calls_section_begin|>` or a bare
  `<|tool_call_begin|>` (kept: it begins the content, for the tool parser); other tool-call
  markers inside it are dropped. Output that never enters reasoning is all content (`reasoning`
  None).

Both together: `parse_output(text, *, tools=None, in_reasoning=False) -> ParsedOutput(reasoning,
content, tool_calls)` (`.to_openai()`: the `content`, `reasoning_content` and `tool_calls` of
an OpenAI chat message) and `OutputParser(...).feed / .finish -> OutputDelta(reasoning, content,
tool_calls)`: the reasoning parser first, the tool parser on its content.

From token ids (what a server streams): `OutputStream(tokenizer, prompt_ids, stop, tools=,
reasoning=, only=, request_tools=)` (`request_tools`: the request's tools, to name calls);
`push(ids)` and `end(ids, text_end)` return `OutputDelta`s, `result()` the whole `ParsedOutput`,
`finish_reason(reason)` says `tool_calls` for a stop after calls. The text is `tokenizer.decode(ids,
skip_special_tokens=True)`, released by an `engine.tokenizer.TextStream` (the longest stop string
less one character waits, and `end` cuts at `text_end`, an offset in that text), plus the names of
the special ids among the parsers' markers (tool-call markers with `tools`, `<think>`/`</think>`
with `reasoning`) where they were generated; a marker id leaves with the text before it (one right
at a cut comes before it). Without markers to parse, the content is exactly the TextStream text.
Reasoning is implicit when the prompt ids end in `<think>`. `only` keeps the calls of that function
(others are dropped) and renumbers them from 0. `to_openai()` of a delta or a result gives the
fields of an OpenAI chat `delta` or `message`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Mapping, Sequence
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
# Text inside a section that is not a call, longer than this without a marker, means the
# section was not one (the model wandered): it is content, as vLLM's parser gives it up at 8192.
MAX_SECTION_TEXT = 8192

_ALL_MARKERS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END)
_ARGS_ENDS = (CALL_END, CALL_BEGIN, SECTION_END, SECTION_BEGIN)
_INDEX_RE = re.compile(r"[0-9]+")
# Ids that name no function: a bare counter (`0`, from K2.5) or a client's (`call_3`,
# `toolu_01...`, a UUID), after a client rewrote the ids in the history.
_CLIENT_ID_RE = re.compile(r"[A-Za-z0-9_-]+")


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
# How a call's name is known: from its id, from the request's tools at its end, or not at all.
_NAMED, _PENDING, _DROPPED = range(3)


def function_tools(tools: Iterable[Mapping[str, Any]] | None) -> list[Mapping[str, Any]]:
    """The `function` entries of a request's OpenAI-style tools (others skipped)."""
    out = []
    for t in tools or ():
        f = t.get("function") if isinstance(t, Mapping) else None
        if (isinstance(f, Mapping) and t.get("type", "function") == "function"
                and isinstance(f.get("name"), str)):
            out.append(f)
    return out


def _fits(arguments: Any, function: Mapping[str, Any]) -> bool:
    """Whether parsed `arguments` fit `function`'s parameters: an object whose keys are all
    declared properties and that has every required one."""
    params = function.get("parameters")
    params = params if isinstance(params, Mapping) else {}
    props = params.get("properties")
    required = params.get("required")
    props = set(props) if isinstance(props, Mapping) else set()
    required = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
    return set(arguments) <= props and required <= set(arguments)


def resolve_name(arguments: str, functions: Sequence[Mapping[str, Any]]) -> str | None:
    """The function a call without a usable name belongs to: the only one, else the only one
    whose schema its arguments (a JSON object) fit; None when that is not one function."""
    if len(functions) == 1:
        return functions[0]["name"]
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return None
    if not isinstance(parsed, dict):
        return None
    fit = [f["name"] for f in functions if _fits(parsed, f)]
    return fit[0] if len(fit) == 1 else None


class ToolCallParser:
    """Incremental Kimi tool-call parser (see the module docstring for the rules).

    `tools`: the request's tools (OpenAI format), to name calls whose id has no name."""

    def __init__(self, tools: Iterable[Mapping[str, Any]] | None = None) -> None:
        self._functions = function_tools(tools)
        self._buf = ""  # text not yet consumed
        self._state = _NORMAL
        self._implicit = False  # the section was opened by a bare <|tool_call_begin|>
        self._after = False  # a section just ended: whitespace up to the next text is dropped
        self._id = ""  # id text of the call being read
        self._mode = _NAMED
        self._call_id = ""
        self._count = 0  # calls so far: the index of the next one
        self._raw: list[str] = []  # arguments of a call waiting for its name
        self._args_started = False
        self._pending_ws = ""  # trailing whitespace of the arguments, held back
        self._noise = ""  # text inside a section since its last marker, not a call (yet)
        self._content: list[str] = []  # what the current feed()/finish() produces
        self._calls: list[ToolCallDelta] = []

    def feed(self, text: str) -> ToolParseDelta:
        """Consumes a text delta; returns the content and call pieces it made certain."""
        self._buf += text
        return self._run(final=False)

    def finish(self) -> ToolParseDelta:
        """Flushes held-back text (the output ended); the parser may then be fed again."""
        delta = self._run(final=True)
        self._state, self._buf, self._after, self._implicit = _NORMAL, "", False, False
        return delta

    def _run(self, final: bool) -> ToolParseDelta:
        self._content, self._calls = [], []
        while self._step(final):
            pass
        if final and self._noise:  # the output ended inside a section: its text was the answer
            if self._noise.strip():
                self._content.append(self._noise)
            self._noise, self._after = "", False
        return ToolParseDelta("".join(self._content), _merge(self._calls))

    def _text(self, text: str) -> None:
        """Ordinary text outside sections: content, but whitespace right after a section is
        held until text follows (dropped before a marker or at the end)."""
        if self._after:
            if not text.strip():
                return
            self._after = False
        self._content.append(text)

    def _marker(self, marker: str) -> None:
        """A marker outside a call's id and arguments (the call before it, if any, is over)."""
        if marker == SECTION_BEGIN:
            self._state, self._implicit = _OPEN, False
        elif marker == CALL_BEGIN:
            if self._state == _NORMAL:
                self._implicit = True  # a call without its section: as if the section began
            self._state, self._id = _ID, ""
        elif marker == SECTION_END or (marker == CALL_END and self._implicit):
            self._state, self._after, self._implicit = _NORMAL, True, False
        elif self._state != _NORMAL:
            self._state = _OPEN
        # NOTE: a stray marker in ordinary text is dropped: no marker ever reaches the content

    def _step(self, final: bool) -> bool:
        buf = self._buf
        if self._state == _OPEN:
            return self._section_text(buf, final)
        if self._state == _NORMAL:
            found = _first(buf, _ALL_MARKERS)
            if found is not None:
                i, marker = found
                self._text(buf[:i])
                self._buf = buf[i + len(marker) :]
                self._marker(marker)
                return True
            keep = 0 if final else _held_suffix(buf, _ALL_MARKERS)
            if self._after and not final and not buf[: len(buf) - keep].strip():
                return False  # only whitespace so far: wait for what follows it
            self._text(buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep :]
            return False
        if self._state == _ID:
            found = _first(buf, _ALL_MARKERS)
            end = found[0] if found is not None else len(buf) - (
                0 if final else _held_suffix(buf, _ALL_MARKERS))
            # NOTE: an id is cut at a fixed length, wherever the chunks fall
            room = MAX_ID_CHARS + 1 - len(self._id)
            if end > room:
                self._id += buf[:room]
                self._buf = buf[room:]
                self._drop_id(text=True)
                return True
            self._id += buf[:end]
            self._buf = buf[end:]
            if found is not None:
                self._buf = buf[end + len(found[1]) :]
                if found[1] == ARGUMENT_BEGIN:
                    self._begin_call()
                else:
                    self._drop_id()
                    self._marker(found[1])
                return True
            if final:
                self._drop_id()
            return False
        # _ARGS
        found = _first(buf, _ARGS_ENDS)
        if found is not None:
            i, marker = found
            self._arguments(buf[:i], end=True)
            self._end_call()
            self._buf = buf[i + len(marker) :]
            self._state = _OPEN
            self._marker(marker)
            return True
        keep = 0 if final else _held_suffix(buf, _ARGS_ENDS)
        self._arguments(buf[: len(buf) - keep], end=final)
        self._buf = buf[len(buf) - keep :]
        if final:
            self._end_call()
            self._state = _NORMAL
        return False

    def _section_text(self, buf: str, final: bool) -> bool:
        """Text inside a section, outside calls: held as noise (before the first call, between
        calls), dropped at the next marker; content when the output ends with the section still
        open, or once it runs past MAX_SECTION_TEXT (the section is then over)."""
        found = _first(buf, _ALL_MARKERS)
        end = found[0] if found is not None else len(buf) - (
            0 if final else _held_suffix(buf, _ALL_MARKERS))
        if len(self._noise) + end > MAX_SECTION_TEXT:
            # NOTE: decided on the run's length alone, wherever the chunks fall
            text, self._noise = self._noise + buf[:end], ""
            self._buf = buf[end:]
            self._state, self._implicit, self._after = _NORMAL, False, False
            self._content.append(text)
            return True
        if found is not None:
            self._noise = ""
            self._buf = buf[end + len(found[1]) :]
            self._marker(found[1])
            return True
        self._noise += buf[:end]
        self._buf = buf[end:]
        if final:
            self._state = _NORMAL
        return False

    def _drop_id(self, text: bool = False) -> None:
        """The call being read never got its arguments: inside a section it is dropped (its
        `text`, when it was cut for its length, is the section's text); after a bare
        <|tool_call_begin|> its text is content (the marker alone is dropped)."""
        if self._implicit:
            self._state, self._implicit = _NORMAL, False
            self._text(self._id)
        else:
            self._state = _OPEN
            if text:
                self._noise += self._id
        self._id = ""

    def _begin_call(self) -> None:
        raw = self._id.strip()
        name = parse_call_id(raw)
        self._call_id, self._raw, self._mode = raw, [], _NAMED
        self._args_started, self._pending_ws = False, ""
        self._state, self._id = _ARGS, ""
        if (name is None and len(raw) <= MAX_ID_CHARS and _CLIENT_ID_RE.fullmatch(raw)
                and self._functions):
            if len(self._functions) == 1:
                name = self._functions[0]["name"]
            else:
                self._mode = _PENDING  # named by its arguments, once they are complete
                return
        if name is None:
            self._mode = _DROPPED
            return
        self._calls.append(ToolCallDelta(self._count, raw, name))
        self._count += 1

    def _end_call(self) -> None:
        if self._mode == _PENDING:
            arguments = "".join(self._raw).strip()
            name = resolve_name(arguments, self._functions)
            if name is not None:
                self._calls.append(ToolCallDelta(self._count, self._call_id, name, arguments))
                self._count += 1
        self._mode, self._raw = _DROPPED, []

    def _arguments(self, text: str, end: bool) -> None:
        if self._mode != _NAMED:
            if self._mode == _PENDING:
                self._raw.append(text)
            return
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


def parse_tool_calls(text: str, tools: Iterable[Mapping[str, Any]] | None = None
                     ) -> ToolParseResult:
    """Content and tool calls of a whole generated text (`tools`: the request's)."""
    parser = ToolCallParser(tools)
    d = parser.feed(text) + parser.finish()
    return ToolParseResult(d.content, merge_tool_call_deltas(d.tool_calls))


# ---------------------------------------------------------------- reasoning

_START, _REASONING, _CONTENT = range(3)
# Reasoning ends at </think> (dropped) or where tool calls begin (kept for the tool parser:
# a section, or a bare <|tool_call_begin|>, as vLLM's K2.5 parser has it); the other tool-call
# markers are dropped from it.
_REASONING_DROPS = (ARGUMENT_BEGIN, CALL_END, SECTION_END)
_REASONING_ENDS = (THINK_END, SECTION_BEGIN, CALL_BEGIN, *_REASONING_DROPS)


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
                # NOTE: whitespace before a leading <think> is dropped with it (vLLM's Kimi
                # parsers do so on the whole text; here streaming waits to know)
                rest = buf.lstrip()
                if rest.startswith(THINK_BEGIN):
                    self._buf = rest[len(THINK_BEGIN) :]
                    self._state, self.started = _REASONING, True
                    continue
                if THINK_BEGIN.startswith(rest) and not final:
                    break
                self._state = _REASONING if self._implicit else _CONTENT
                continue
            if self._state == _CONTENT:
                content.append(buf)
                self._buf = ""
                break
            found = _first(buf, _REASONING_ENDS)
            if found is not None:
                i, marker = found
                reasoning.append(buf[:i])
                if marker in _REASONING_DROPS:  # a stray marker: never in the reasoning
                    self._buf = buf[i + len(marker) :]
                    continue
                self._buf = buf[i + len(THINK_END) :] if marker == THINK_END else buf[i:]
                self._state = _CONTENT
                continue
            keep = 0 if final else _held_suffix(buf, _REASONING_ENDS)
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


Tools = Sequence[Mapping[str, Any]] | bool | None


class OutputParser:
    """Reasoning, content and tool calls of a streamed output. `tools`: the request's tools
    (OpenAI format; they name calls whose id does not), None or True to parse calls without
    them, False to leave tool-call markup in the content (no parsing). `reasoning=False`
    treats all text as content (instant mode)."""

    def __init__(
        self, *, tools: Tools = None, in_reasoning: bool = False, reasoning: bool = True
    ) -> None:
        self._reasoning = ReasoningParser(in_reasoning) if reasoning else None
        self._tools = None if tools is False else ToolCallParser(
            None if tools is True else tools)

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
    text: str, *, tools: Tools = None, in_reasoning: bool = False, reasoning: bool = True
) -> ParsedOutput:
    """Reasoning, content and tool calls of a whole generated text (options as OutputParser's;
    `in_reasoning`: the prompt ended inside <think>)."""
    parser = OutputParser(tools=tools, in_reasoning=in_reasoning, reasoning=reasoning)
    d = parser.feed(text) + parser.finish()
    return ParsedOutput(d.reasoning if parser.reasoning_started else None, d.content,
                        merge_tool_call_deltas(d.tool_calls))


# ---------------------------------------------------------------- token ids

# Prompt ids decoded to see whether the prompt ends in `<think>` (ordinary text needs up to 7).
PROMPT_TAIL_IDS = 16


def ids_open_reasoning(tokenizer: Tokenizer, prompt_ids: Sequence[int]) -> bool:
    """`prompt_opens_reasoning` of a prompt's token ids (its last few decoded)."""
    return prompt_opens_reasoning(tokenizer.decode(list(prompt_ids[-PROMPT_TAIL_IDS:])))


class OutputStream:
    """Reasoning, content and tool calls of generated token ids (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 stop: Sequence[str] = (), *, tools: bool = False, reasoning: bool = False,
                 only: str | None = None,
                 request_tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        names = (_ALL_MARKERS if tools else ()) + ((THINK_BEGIN, THINK_END) if reasoning else ())
        specials = tokenizer.special_tokens
        self._markers = {specials[m]: m for m in names if m in specials}
        opens = reasoning and ids_open_reasoning(tokenizer, prompt_ids)
        self._parser = OutputParser(reasoning=reasoning, in_reasoning=opens,
                                    tools=(request_tools or True) if tools else False)
        self._text = TextStream(tokenizer, stop)  # the text without special ids
        self._at: list[tuple[int, str]] = []  # markers not yet released: (offset in text, name)
        self._only = only
        self._index: dict[int, int | None] = {}  # the parser's call index -> ours (None: dropped)
        self._parts: tuple[list[str], list[str], list[ToolCallDelta]] = ([], [], [])

    def push(self, ids: Sequence[int], pieces: Sequence[str] | None = None) -> OutputDelta:
        """What the new `ids` made certain. `pieces`: their text as the engine decoded it (a
        piece an id, `engine.scheduler.StepEvent.pieces`), which is then not decoded again."""
        self._take(ids, pieces)
        return self._release(self._text.push(), final=False)

    def end(self, ids: Sequence[int], text_end: int | None = None,
            pieces: Sequence[str] | None = None) -> OutputDelta:
        """The rest, the output ending with `ids` (cut at `text_end`, where a stop string
        matched); `pieces` as in `push`, with the text a split character left after them."""
        self._take(ids, pieces)
        return self._release(self._text.end(text_end=text_end, decoded=pieces is not None),
                             final=True)

    def result(self) -> ParsedOutput:
        """Everything released so far."""
        reasoning, content, calls = self._parts
        return ParsedOutput("".join(reasoning) if self._parser.reasoning_started else None,
                            "".join(content), merge_tool_call_deltas(calls))

    def finish_reason(self, reason: str) -> str:
        """`tool_calls` when the model stopped after calling tools, else `reason`."""
        return "tool_calls" if reason == "stop" and self._parts[2] else reason

    def _take(self, ids: Sequence[int], pieces: Sequence[str] | None) -> None:
        """`ids`' text (their `pieces`, or decoded here, each run between marker ids at once),
        noting where the markers came."""
        text = self._text
        if pieces is not None:
            start = 0
            for k, t in enumerate(ids):
                if t in self._markers:
                    text.append("".join(pieces[start:k]))
                    self._at.append((text.length, self._markers[t]))
                    start = k
            text.append("".join(pieces[start:]))  # with what a split character left, if any
            return
        start = 0
        for k, t in enumerate(ids):
            if t in self._markers:
                text.add(ids[start:k])
                self._at.append((text.length, self._markers[t]))
                start = k + 1
        text.add(ids[start:])

    def _release(self, piece: str, final: bool) -> OutputDelta:
        """Parses the text just released (`piece`, ending at `sent`) with the markers up to its
        end in place."""
        begin = self._text.sent - len(piece)  # where `piece` starts in the whole text
        parts, pos = [], 0
        while self._at and self._at[0][0] <= self._text.sent:
            at, name = self._at.pop(0)
            parts += [piece[pos:at - begin], name]
            pos = at - begin
        d = self._parser.feed("".join(parts) + piece[pos:])
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
