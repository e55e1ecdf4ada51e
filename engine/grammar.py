"""Grammar-constrained decoding on the host: llguidance matchers over the engine's tokenizer.

A request with a grammar (`SamplingParams.grammar`: Lark text, or llguidance's JSON form) gets
a `Matcher` when the scheduler admits it; before each of its tokens the matcher writes the
bitmask of the tokens the grammar allows next (`ceil(V / 32)` int32 words, `ops.logits`'s
layout), and every token the request keeps is consumed by it. When the grammar is complete and
only an end token may follow (`Matcher.done`), the request stops.

The grammars the server builds (`json_schema_grammar`, `tool_call_grammar`,
`json_or_tool_call_grammar`) write JSON as `json.dumps` does (`", "` and
`": "`, no other whitespace), so a schema's bounds (maxLength, maxItems, an integer's range)
bound the output. A thinking model's reasoning comes first when its prompt opens it
(`reasoning`): any text up to `</think>`, which must then be a special token.

llguidance (no dependencies, a per-token mask in microseconds at Kimi's 163,840 tokens,
grammars compiled lazily as they are matched): docs/structured-output.md has the measurements
against xgrammar. It is the `serve` extra and imported only when a grammar is used.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from engine.tokenizer import Tokenizer
from engine.toolcalls import (
    ARGUMENT_BEGIN,
    CALL_BEGIN,
    CALL_END,
    SECTION_BEGIN,
    SECTION_END,
    THINK_END,
)

# How the built grammars write JSON (llguidance's JSON options): as json.dumps does.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar llguidance refuses, or a token it does not allow; the message says why."""


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.numpy
        import llguidance.tiktoken
    except ImportError as e:
        raise GrammarError("grammars need llguidance: pip install -e '.[serve]'") from e
    return llguidance


class Grammars:
    """Matchers for one tokenizer, over a model vocabulary of `vocab_size` ids (ids past the
    tokenizer's are never allowed). The end tokens are the tokenizer's stop ids. llguidance's
    view of the vocabulary is built on first use (about a second for Kimi's), once; each
    grammar compiles once (the last `CACHED` are kept), its matchers are copies of that one."""

    CACHED = 64

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.tok, self.vocab_size = tokenizer, vocab_size
        self._ll: Any = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, Matcher] = OrderedDict()  # grammar -> its start

    @property
    def words(self) -> int:
        """int32 words of a mask."""
        return -(-self.vocab_size // 32)

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._ll is None:
                llg = _llguidance()
                self._ll = llg.tiktoken.lltokenizer_from_encoding(
                    self.tok.encoding, n_vocab=self.vocab_size,
                    eos_token=sorted(self.tok.stop_ids) or None)
            return self._ll

    def check(self, grammar: str) -> None:
        """Raises GrammarError (saying what in the schema is wrong) when llguidance cannot
        compile `grammar`; else compiles it for `matcher`."""
        with self._lock:
            if grammar in self._compiled:
                return
        llg = _llguidance()
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar,
                                                                      self._tokenizer())
        if failed:
            raise GrammarError(_reason(messages[0]) if messages else "invalid grammar")
        self.matcher(grammar)

    def matcher(self, grammar: str) -> Matcher:
        """A matcher at the start of `grammar` (GrammarError when it cannot compile)."""
        with self._lock:
            start = self._compiled.get(grammar)
            if start is not None:
                self._compiled.move_to_end(grammar)
        if start is None:
            m = _llguidance().LLMatcher(self._tokenizer(), grammar, log_level=0)
            if m.is_error():
                raise GrammarError(m.get_error())
            start = Matcher(m, self.words)
            with self._lock:
                self._compiled[grammar] = start
                while len(self._compiled) > self.CACHED:
                    self._compiled.popitem(last=False)
        return start.copy()


def _reason(message: str) -> str:
    """llguidance's error without its position in the built grammar and the grammar's source
    it quotes after (numbered lines): what the client's schema did."""
    lines = []
    for line in message.splitlines():
        if re.match(r"\s*\d+ \| ", line):
            break
        lines.append(line.strip())
    return re.sub(r"^at \d+\(\d+\): ", "", " ".join(x for x in lines if x))


class Matcher:
    """One request's grammar state: `mask()` of its next token, `consume(token)` of each token
    it keeps, `done` once only an end token may follow."""

    def __init__(self, matcher: Any, words: int):
        self._m, self._words = matcher, words

    def mask(self) -> np.ndarray:
        """The tokens the grammar allows next: `[ceil(V / 32)]` int32, bit `t % 32` of word
        `t // 32` set for token `t`."""
        out = np.zeros((1, self._words), dtype=np.int32)
        _llguidance().numpy.fill_next_token_bitmask(self._m, out, 0)
        return out[0]

    def consume(self, token: int) -> None:
        """Advance past `token`; GrammarError when the grammar does not allow it."""
        if not self._m.consume_token(token):
            raise GrammarError(f"token {token} breaks the grammar: {self._m.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete and nothing but an end token may follow."""
        return self._m.is_stopped()

    def copy(self) -> Matcher:
        return Matcher(self._m.deep_copy(), self._words)


# ---- the grammars the server builds ------------------------------------------------------------


def _styled(schema: Mapping[str, Any]) -> dict[str, Any]:
    """`schema` with JSON_STYLE under its llguidance options (`x-guidance`: its own win)."""
    own = schema.get("x-guidance")
    return {**schema, "x-guidance": {**JSON_STYLE, **(own if isinstance(own, dict) else {})}}


def json_schema_grammar(schema: Mapping[str, Any], reasoning: str = "") -> str:
    """The grammar of a JSON value that validates against `schema` (after `reasoning`, a
    `reasoning_prefix`)."""
    return _lark(_json_rules(schema), "body", reasoning)


def _json_rules(schema: Mapping[str, Any]) -> str:
    return f"body: %json {json.dumps(_styled(schema))}"


def reasoning_prefix(tok: Tokenizer, opened: bool) -> str:
    """The Lark of a thinking model's reasoning before a constrained answer: when its prompt
    `opened` it (ends in `<think>`), any text up to `</think>`; "" when it did not, or when
    `</think>` is not a special token of `tok` (a model that does not think)."""
    end = tok.special_tokens.get(THINK_END)
    return f"/(?s:.*)/ <[{end}]>" if opened and end is not None else ""


def tool_call_grammar(tok: Tokenizer, tools: Sequence[Mapping[str, Any]],
                      parallel: bool = True, reasoning: str = "") -> str:
    """Kimi's tool-call section (`engine.toolcalls`) holding one call, or with `parallel` one
    or more, each of a function of `tools` (OpenAI's tool objects: give one to force that
    function) with arguments that validate against its `parameters`. A marker the tokenizer
    has as a special token is that token, else its text."""
    return _lark(_tool_rules(tok, tools, parallel), "section", reasoning)


def json_or_tool_call_grammar(tok: Tokenizer, schema: Mapping[str, Any],
                              tools: Sequence[Mapping[str, Any]], parallel: bool = True,
                              reasoning: str = "") -> str:
    """A JSON answer that validates against `schema`, or a tool-call section as
    `tool_call_grammar`'s (a JSON response format beside tools the model may call)."""
    rules = f"{_json_rules(schema)}\n{_tool_rules(tok, tools, parallel)}"
    return _lark(rules, "(body | section)", reasoning)


def _tool_rules(tok: Tokenizer, tools: Sequence[Mapping[str, Any]], parallel: bool) -> str:
    def marker(name: str) -> str:
        i = tok.special_tokens.get(name)
        return f"<[{i}]>" if i is not None else json.dumps(name)

    rules = []
    for k, t in enumerate(tools):
        f = t["function"]
        schema = f.get("parameters") or {"type": "object"}
        rules += [f"call_{k}: {marker(CALL_BEGIN)} {json.dumps('functions.' + f['name'] + ':')} "
                  f"INDEX {marker(ARGUMENT_BEGIN)} args_{k} {marker(CALL_END)}",
                  f"args_{k}: %json {json.dumps(_styled(schema))}"]
    calls = " | ".join(f"call_{k}" for k in range(len(tools)))
    rules += [f"call: {calls}", "INDEX: /0|[1-9][0-9]{0,3}/",
              f"section: {marker(SECTION_BEGIN)} call{'+' if parallel else ''} "
              f"{marker(SECTION_END)}"]
    return "\n".join(rules)


def _lark(rules: str, body: str, reasoning: str) -> str:
    return f"start: {reasoning} {body}\n{rules}\n" if reasoning else f"start: {body}\n{rules}\n"
