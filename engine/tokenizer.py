"""Kimi K2 tokenizer: tiktoken BPE ranks + Kimi's special tokens, pre-tokenizer and chat format.

Everything is read from local files (`tiktoken.model`, `tokenizer_config.json`,
`chat_template.jinja`); nothing here may download an encoding.

Special block: ids n .. n+255 after the n ordinary ranks, as Kimi's tokenization_kimi.py builds
it: a name from the config's added_tokens_decoder where it gives one, `<|reserved_token_{id}|>`
(the absolute id) for every other id. Every id below `vocab_size` decodes; decoding with
`skip_special_tokens` drops the whole block. `encode(text)` is ordinary: special-token strings
in text stay plain text unless `allow_special=True`. Chat prompts are rendered by engine.chat
from the checkpoint's own jinja template.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import functools
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import tiktoken

from engine.chat import (
    CONFIG_FILE,
    DEFAULT_SYSTEM_PROMPT,
    ChatRenderer,
    TokenizerError,
    load_chat_template,
    named_special_tokens,
)

# Kimi K2's pre-tokenizer (tokenization_kimi.py). `&&` is character-class intersection: Han
# characters are letters (\p{Lo}) but must never join a Latin-style word chunk, so they are cut
# out of the letter classes and get a chunk of their own. Python's `re` cannot compile this
# (no \p{..}, no `&&`); tiktoken's Rust regex engine can.
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
        r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
        r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

MODEL_FILE = "tiktoken.model"
# Kimi's special tokens relative to the first id after the ordinary ranks; every other slot in
# the reserved block is "<|reserved_token_{i}|>". [UNK] and [PAD] take the last two slots.
_NAMED_SPECIAL_OFFSETS = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|im_end|>": 2,
    "<|im_user|>": 3,
    "<|im_assistant|>": 4,
    "<|im_system|>": 10,
    "<|im_middle|>": 17,
}
_MIN_RESERVED_SPECIAL = max(_NAMED_SPECIAL_OFFSETS.values()) + 3

NUM_RESERVED_SPECIAL = 256

# The chat template write_tokenizer_files embeds (and the bundled model ships): Kimi's format for
# plain system/user/assistant/tool text messages. engine.chat renders it (or any checkpoint's).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>"
    "{%- endif -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif message['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- elif message['role'] == 'tool' -%}<|im_system|>tool<|im_middle|>"
    "{%- endif -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}{{ part['text'] }}{%- endfor -%}"
    "{%- endif -%}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)

# Kimi feeds tiktoken at most this many characters at a time, and never a run of more than
# MAX_NO_WHITESPACES_CHARS all-space or all-non-space characters: the regex engine gets very
# slow on such runs. Splitting there changes tokens only for pathological inputs, and doing
# it the same way keeps ids identical to Kimi's own tokenizer.
TIKTOKEN_MAX_ENCODE_CHARS = 400_000
MAX_NO_WHITESPACES_CHARS = 25_000


def _parse_ranks(path: Path) -> dict[bytes, int]:
    """Reads a tiktoken.model (`base64 rank` per line, the format of load_tiktoken_bpe).

    NOTE: tiktoken's load_tiktoken_bpe caches even local files in a temp dir keyed by path, so a
    file rewritten in place (e.g. a retrained tokenizer) would load stale; it also cannot say
    which line is bad. Parse it here instead.
    """
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TokenizerError(f"cannot read {path}: {e}") from e
    ranks: dict[bytes, int] = {}
    seen_ranks: dict[int, int] = {}
    for lineno, line in enumerate(data.splitlines(), start=1):
        if not line:
            continue
        fields = line.split()
        try:
            if len(fields) != 2:
                raise ValueError("expected 'base64 rank'")
            token = base64.b64decode(fields[0], validate=True)
            rank = int(fields[1])
            if not token or rank < 0:
                raise ValueError("empty token or negative rank")
        except (ValueError, binascii.Error) as e:
            raise TokenizerError(f"{path}:{lineno}: malformed line {line[:80]!r}: {e}") from e
        if token in ranks:
            raise TokenizerError(f"{path}:{lineno}: token {token!r} listed twice")
        if rank in seen_ranks:
            raise TokenizerError(
                f"{path}:{lineno}: rank {rank} already used on line {seen_ranks[rank]}"
            )
        ranks[token] = rank
        seen_ranks[rank] = lineno
    if not ranks:
        raise TokenizerError(f"{path}: no tokens")
    # NOTE: byte-level BPE must be able to fall back to single bytes, otherwise tiktoken panics
    # on the first text containing a missing byte instead of raising.
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(f"{path}: single-byte tokens missing for bytes {missing[:8]}...")
    return ranks


def reserved_token_name(token_id: int) -> str:
    """Kimi's name for an unnamed id of the special block, numbered by its absolute id as
    tokenization_kimi.py numbers it (`<|reserved_token_163590|>` for id 163590)."""
    return f"<|reserved_token_{token_id}|>"


def _kimi_named_layout(first_id: int, num_reserved_special: int) -> dict[int, str]:
    if num_reserved_special < _MIN_RESERVED_SPECIAL:
        raise TokenizerError(
            f"num_reserved_special must be at least {_MIN_RESERVED_SPECIAL}, "
            f"got {num_reserved_special}"
        )
    named = {first_id + off: name for name, off in _NAMED_SPECIAL_OFFSETS.items()}
    named[first_id + num_reserved_special - 2] = "[UNK]"
    named[first_id + num_reserved_special - 1] = "[PAD]"
    return named


def kimi_special_tokens(
    first_id: int,
    named: Mapping[int, str] | None = None,
    num_reserved_special: int = NUM_RESERVED_SPECIAL,
) -> dict[str, int]:
    """The special block as Kimi's tokenization_kimi.py builds it: ids first_id ..
    first_id+num_reserved_special-1, each named by `named` (id -> content, e.g. the config's
    added_tokens_decoder) or else `<|reserved_token_{id}|>`.

    Without `named`, Kimi's layout of its named tokens is assumed (_NAMED_SPECIAL_OFFSETS, [UNK]
    and [PAD] last). Named ids outside the block are kept as extra special tokens.
    """
    if named is None:
        named = _kimi_named_layout(first_id, num_reserved_special)
    return _name_specials(named, range(first_id, first_id + num_reserved_special))


def _name_specials(named: Mapping[int, str], ids: Iterable[int]) -> dict[str, int]:
    """Name -> id for every id of `named` and `ids`: its name in `named`, else Kimi's reserved
    name. A name given to two ids raises."""
    specials: dict[str, int] = {}
    for token_id in sorted(set(ids) | set(named)):
        name = named.get(token_id) or reserved_token_name(token_id)
        if name in specials:
            raise TokenizerError(
                f"special token {name!r} names both id {specials[name]} and id {token_id}"
            )
        specials[name] = token_id
    return specials


def _relative_specials(first_id: int, num_reserved_special: int = 256) -> dict[str, int]:
    """The names write_tokenizer_files records for every slot of the block: Kimi's named layout,
    and `<|reserved_token_{offset}|>` (offset inside the block) for the other slots.

    NOTE: written names are data that loading reads back verbatim; they stay as they were so
    that retraining reproduces the shipped models/ files byte for byte.
    """
    named = _kimi_named_layout(0, num_reserved_special)
    return {
        named.get(i, f"<|reserved_token_{i}|>"): first_id + i for i in range(num_reserved_special)
    }


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"cannot read {path}: {e}") from e
    if not isinstance(config, dict):
        raise TokenizerError(f"{path}: not a JSON object")
    return config


def _named_specials(config: Mapping[str, Any], path: Path) -> dict[int, str]:
    """id -> content of the config's added_tokens_decoder."""
    decoder = config.get("added_tokens_decoder")
    if not isinstance(decoder, dict) or not decoder:
        raise TokenizerError(f"{path}: no 'added_tokens_decoder' mapping")
    named: dict[int, str] = {}
    seen: set[str] = set()
    for key, entry in decoder.items():
        try:
            token_id = int(key)
            content = entry["content"]
            if not isinstance(content, str) or not content or token_id < 0:
                raise ValueError("bad content or id")
        except (ValueError, TypeError, KeyError) as e:
            raise TokenizerError(f"{path}: bad added_tokens_decoder entry {key!r}: {e}") from e
        if content in seen:
            raise TokenizerError(f"{path}: special token {content!r} listed twice")
        seen.add(content)
        named[token_id] = content
    return named


def _split_long_runs(text: str) -> Iterator[str]:
    """Yields pieces of `text` as Kimi's tokenizer cuts them before handing them to tiktoken."""
    for start in range(0, len(text), TIKTOKEN_MAX_ENCODE_CHARS):
        piece = text[start : start + TIKTOKEN_MAX_ENCODE_CHARS]
        if len(piece) <= MAX_NO_WHITESPACES_CHARS:
            # no run can exceed the limit; skip the per-character scan
            yield piece
            continue
        run_len = 0
        run_is_space = piece[0].isspace()
        cut = 0
        for i, ch in enumerate(piece):
            is_space = ch.isspace()
            if is_space != run_is_space:
                run_len = 1
                run_is_space = is_space
            else:
                run_len += 1
                if run_len > MAX_NO_WHITESPACES_CHARS:
                    yield piece[cut:i]
                    cut = i
                    run_len = 1
        yield piece[cut:]


class Tokenizer:
    """Kimi tokenizer over a tiktoken Encoding; special ids come from tokenizer_config.json.

    `chat_template`: the checkpoint's jinja template(s) (None: engine.chat's fallback);
    `special_tokens_map`: the named special tokens templates see (`bos_token`, ...).
    """

    def __init__(
        self,
        mergeable_ranks: dict[bytes, int],
        special_tokens: Mapping[str, int],
        name: str = "kimi",
        pat_str: str = KIMI_PAT_STR,
        *,
        chat_template: str | Mapping[str, str] | None = None,
        special_tokens_map: Mapping[str, str] | None = None,
    ) -> None:
        ordinary_ids = set(mergeable_ranks.values())
        clash = sorted(n for n, i in special_tokens.items() if i in ordinary_ids)
        if clash:
            raise TokenizerError(f"special tokens {clash[:4]} reuse ids of ordinary tokens")
        named = {token_id: name for name, token_id in special_tokens.items()}
        if len(named) != len(special_tokens):
            raise TokenizerError("two special tokens share one id")
        # NOTE: every id below vocab_size must decode: an id that is neither an ordinary rank
        # nor a named special gets Kimi's reserved name.
        gaps = set(range(max(ordinary_ids | set(named)) + 1)) - ordinary_ids
        specials = _name_specials(named, gaps)
        self.encoding = tiktoken.Encoding(
            name=name,
            pat_str=pat_str,
            mergeable_ranks=mergeable_ranks,
            special_tokens=specials,
        )
        self.special_tokens: dict[str, int] = specials
        self.special_names: dict[int, str] = {i: n for n, i in specials.items()}
        self._special_ids = frozenset(self.special_tokens.values())
        self._special_re: re.Pattern[str] | None = None
        self.vocab_size: int = self.encoding.max_token_value + 1
        get = self.special_tokens.get
        self.bos_id: int | None = get("[BOS]")
        self.eos_id: int | None = get("[EOS]")
        self.im_end_id: int | None = get("<|im_end|>")
        self.im_user_id: int | None = get("<|im_user|>")
        self.im_assistant_id: int | None = get("<|im_assistant|>")
        self.im_system_id: int | None = get("<|im_system|>")
        self.im_middle_id: int | None = get("<|im_middle|>")
        self.pad_id: int | None = get("[PAD]")
        self.stop_ids: frozenset[int] = frozenset(
            i for i in (self.im_end_id, self.eos_id) if i is not None
        )
        self.chat_template = chat_template
        self.special_tokens_map: dict[str, str] = dict(special_tokens_map or {})

    @classmethod
    def of_model(cls, model_dir: str | os.PathLike[str]) -> Tokenizer | None:
        """A model directory's tokenizer (`from_dir`), None when it has none (no
        `tiktoken.model`: the model takes and gives token ids)."""
        return cls.from_dir(model_dir) if (Path(model_dir) / MODEL_FILE).is_file() else None

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Loads `tiktoken.model`, and when present `tokenizer_config.json` (special tokens, named
        special tokens, chat template) and `chat_template.jinja` (wins over the config's).

        The special block follows the ordinary ranks (Kimi's layout); without a config, Kimi's
        names for its named specials are assumed.
        """
        root = Path(path)
        if not root.is_dir():
            raise TokenizerError(f"tokenizer directory {root} does not exist")
        model = root / MODEL_FILE
        if not model.is_file():
            raise TokenizerError(f"{model} not found")
        ranks = _parse_ranks(model)
        n = len(ranks)
        if max(ranks.values()) != n - 1:
            raise TokenizerError(
                f"{model}: ranks must be 0..{n - 1} (the special block follows them)"
            )
        config_path = root / CONFIG_FILE
        config = _read_config(config_path) if config_path.exists() else None
        named = _named_specials(config, config_path) if config is not None else None
        specials = kimi_special_tokens(n, named)
        try:
            return cls(
                ranks,
                specials,
                name=root.name or "kimi",
                chat_template=load_chat_template(root, config or {}),
                special_tokens_map=named_special_tokens(config),
            )
        except TokenizerError as e:
            raise TokenizerError(f"{root}: {e}") from e

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Encodes `text`. By default special-token strings inside it stay plain text; with
        `allow_special=True` each exact special-token string becomes its special id."""
        if not allow_special:
            return self._encode_ordinary(text)
        ids: list[int] = []
        last = 0
        for m in self.special_pattern.finditer(text):
            ids.extend(self._encode_ordinary(text[last : m.start()]))
            ids.append(self.special_tokens[m.group(0)])
            last = m.end()
        ids.extend(self._encode_ordinary(text[last:]))
        return ids

    def _encode_ordinary(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in _split_long_runs(text):
            ids.extend(self.encoding.encode_ordinary(piece))
        return ids

    @property
    def special_pattern(self) -> re.Pattern[str]:
        """Regex matching any special-token string, longest first."""
        if self._special_re is None:
            ordered = sorted(self.special_tokens, key=lambda s: (-len(s), s))
            self._special_re = re.compile("|".join(map(re.escape, ordered)) or "(?!)")
        return self._special_re

    @functools.cached_property
    def _text_bytes(self) -> list[bytes]:
        """Each id's bytes in output text, special ids none (made once, at the first decode
        that skips them)."""
        enc, special = self.encoding, self._special_ids
        return [b"" if i in special else enc.decode_single_token_bytes(i)
                for i in range(self.vocab_size)]

    def decode_bytes(self, ids: Sequence[int], skip_special_tokens: bool = False) -> bytes:
        ids = list(ids)
        if skip_special_tokens:
            # NOTE: one lookup an id in a precomputed table, no filter over the ids
            if ids and not 0 <= min(ids) <= max(ids) < self.vocab_size:
                raise TokenizerError(f"cannot decode ids (vocab_size {self.vocab_size}): "
                                     f"{min(ids)}..{max(ids)}")
            return b"".join(map(self._text_bytes.__getitem__, ids))
        try:
            return self.encoding.decode_bytes(ids)
        except (KeyError, OverflowError, TypeError) as e:
            raise TokenizerError(f"cannot decode ids (vocab_size {self.vocab_size}): {e}") from e

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; with `skip_special_tokens`, special ids (`<|im_end|>`, reserved ones)
        leave no text, as in generated output."""
        # Python's decoder, not tiktoken's, so that a stream_decoder gives the same string.
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special_tokens: bool = False) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens)

    def special_id(self, name: str) -> int:
        try:
            return self.special_tokens[name]
        except KeyError as e:
            raise TokenizerError(f"tokenizer has no special token {name!r}") from e

    @functools.cached_property
    def chat(self) -> ChatRenderer:
        """The renderer of this tokenizer's chat template (engine.chat.ChatRenderer)."""
        return ChatRenderer(self, self.chat_template, self.special_tokens_map)

    def apply_chat_template(
        self,
        /,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of a conversation rendered with the checkpoint's chat template (or the
        fallback), as engine.chat.ChatRenderer.encode describes: only the template's own special
        tokens become special ids. `template_kwargs` (e.g. `thinking=False`) reach the template.
        Malformed messages raise TokenizerError naming the field."""
        return self.chat.encode(messages, tools, add_generation_prompt, **template_kwargs)

    def render_chat_template(
        self,
        /,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text apply_chat_template encodes (transformers' rendering)."""
        return self.chat.render(messages, tools, add_generation_prompt, **template_kwargs)


class IncrementalDecoder:
    """Streams text from ids; bytes of a character split across tokens wait for the rest."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: Sequence[int]) -> str:
        """Returns the text completed by `ids`; an unfinished UTF-8 sequence is held back."""
        return self._utf8.decode(self._tokenizer.decode_bytes(ids, self._skip), final=False)

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """`push` of each of `ids` alone: the text each one completes (a character split
        across ids comes with its last), one table lookup and one UTF-8 step an id."""
        if not self._skip:
            return [self.push([i]) for i in ids]
        table, utf8 = self._tokenizer._text_bytes, self._utf8
        out = []
        try:
            if not utf8.buffer:
                try:  # NOTE: most steps' ids each end whole characters: all in one pass
                    return [table[i].decode() for i in ids]
                except UnicodeDecodeError:
                    pass  # a character split across ids: one id at a time
            for i in ids:
                b = table[i]
                if not utf8.buffer:  # NOTE: no character pending: most tokens end whole
                    try:
                        out.append(b.decode())
                        continue
                    except UnicodeDecodeError:
                        pass
                out.append(utf8.decode(b, False))
        except (IndexError, TypeError) as e:
            raise TokenizerError(f"cannot decode ids {list(ids)} (vocab_size "
                                 f"{self._tokenizer.vocab_size})") from e
        return out

    def flush(self) -> str:
        """Returns what is held back (as replacement characters) and resets the stream."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text


class TextStream:
    """The text of a growing list of ids, released as it becomes final: a character split across
    tokens waits for the rest, and with `stop` strings the last (longest stop - 1) characters wait
    until later ids show they do not start one, so no text past a stop ever leaves. `end` gives
    the rest: the pieces add up to one decode of every id, cut at `text_end` (where a stop string
    matched), exactly the text a non-streamed answer has. `sent` is how much of the text has
    left; only the rest is kept, so each call's work follows what is new, not the text's length
    (`length` is the whole text's, offsets count from its start)."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (),
                 skip_special_tokens: bool = True) -> None:
        self._dec = tokenizer.stream_decoder(skip_special_tokens)
        self._hold = max(map(len, stop), default=1) - 1
        self._rest, self.sent = "", 0  # the text past `sent`

    @property
    def length(self) -> int:
        return self.sent + len(self._rest)

    def add(self, ids: Sequence[int]) -> None:
        """Decodes `ids` without releasing anything."""
        self._rest += self._dec.push(ids)

    def append(self, text: str) -> None:
        """Text the caller decoded (`IncrementalDecoder.pieces`), without releasing anything."""
        self._rest += text

    def push(self, ids: Sequence[int] = ()) -> str:
        """The text that became final with `ids`."""
        self.add(ids)
        return self._release(self.length - self._hold)

    def end(self, ids: Sequence[int] = (), text_end: int | None = None,
            decoded: bool = False) -> str:
        """The rest of the text, the ids ending with `ids` (with `decoded`, the caller has
        added their text, and what a split character left, with `append`)."""
        if not decoded:
            self._rest += self._dec.push(ids) + self._dec.flush()
        return self._release(self.length if text_end is None else text_end)

    def _release(self, cut: int) -> str:
        n = max(cut - self.sent, 0)
        piece, self._rest = self._rest[:n], self._rest[n:]
        self.sent += len(piece)
        return piece


def write_tokenizer_files(
    out_dir: str | os.PathLike[str],
    mergeable_ranks: dict[bytes, int],
    num_reserved_special: int = 256,
    model_max_length: int = 131072,
) -> None:
    """Writes `tiktoken.model` and a Kimi-style `tokenizer_config.json` into `out_dir`.

    Ranks must be 0..n-1; the special tokens take ids n..n+num_reserved_special-1 in Kimi's
    relative layout, so a model's embedding rows line up the same way as Kimi's.
    """
    n = len(mergeable_ranks)
    if sorted(mergeable_ranks.values()) != list(range(n)):
        raise TokenizerError("mergeable_ranks must use each rank 0..n-1 exactly once")
    specials = _relative_specials(n, num_reserved_special)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        base64.b64encode(token) + b" " + str(rank).encode()
        for token, rank in sorted(mergeable_ranks.items(), key=lambda kv: kv[1])
    ]
    (out / MODEL_FILE).write_bytes(b"\n".join(lines) + b"\n")
    added = {
        str(token_id): {
            "content": name,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for name, token_id in sorted(specials.items(), key=lambda kv: kv[1])
    }
    config = {
        "added_tokens_decoder": added,
        "additional_special_tokens": [
            "<|im_end|>",
            "<|im_user|>",
            "<|im_assistant|>",
            "<|im_system|>",
            "<|im_middle|>",
        ],
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "tokenizer_class": "TikTokenTokenizer",
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
