from __future__ import annotations

import base64
import json
import re
import shutil
from pathlib import Path

import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st
from tiktoken.load import load_tiktoken_bpe

from engine.tokenizer import (
    CONFIG_FILE,
    DEFAULT_SYSTEM_PROMPT,
    KIMI_PAT_STR,
    MAX_NO_WHITESPACES_CHARS,
    MODEL_FILE,
    NUM_RESERVED_SPECIAL,
    Tokenizer,
    TokenizerError,
    _parse_ranks,
    _split_long_runs,
    kimi_special_tokens,
    reserved_token_name,
    write_tokenizer_files,
)
from tools.train_tokenizer import main as train_main
from tools.train_tokenizer import train_bpe

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog didn't mind; it's a lazy dog.\n",
    "Speculative decoding drafts several tokens and verifies them in one forward pass.\n\n",
    "Numbers like 12345 and 2024-11-19 are split into groups of at most three digits.\n",
    "月之暗面的模型会说中文。我们今天测试分词器，分词器应该能处理中文。\n",
    "Émojis 🎉🎉 and accents: café, naïve, façade, déjà vu — all bytes in the end. 👩‍💻\n",
    "    def forward(self, x):\n        return self.linear(x)  # the quick brown fox\n",
]

BUNDLED = Path(__file__).resolve().parent.parent / "models" / "kimi-mini"

# K2-Instruct's tokenizer_config.json names only these 12 ids of the block (offsets from its
# first id, 163584); tokenization_kimi.py names every other one <|reserved_token_{id}|>.
K2_INSTRUCT_NAMED = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
    6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
    17: "<|im_middle|>", 254: "[UNK]", 255: "[PAD]",
}

UNICODE_SAMPLES = ["🎉", "👩‍👩‍👧", "🇯🇵", "世界", "中文", "é", "\u0301", "\r\n", "  ", "<|im_end|>"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(out, train_bpe(CORPUS * 3, 400))
    return out


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    # Only single bytes: every multi-byte character is spread over several tokens.
    out = tmp_path_factory.mktemp("bytes")
    write_tokenizer_files(out, {bytes([b]): b for b in range(256)})
    return Tokenizer.from_dir(out)


def _text_with_unicode() -> st.SearchStrategy[str]:
    piece = st.one_of(st.text(max_size=12), st.sampled_from(UNICODE_SAMPLES))
    return st.lists(piece, max_size=8).map("".join)


# ---------------------------------------------------------------- pattern


def _encoding(pat_str: str, ranks: dict[bytes, int]) -> tiktoken.Encoding:
    return tiktoken.Encoding(name="t", pat_str=pat_str, mergeable_ranks=ranks, special_tokens={})


def test_kimi_pattern_needs_tiktoken_regex_engine() -> None:
    with pytest.raises(re.error):
        re.compile(KIMI_PAT_STR)
    ranks = {bytes([b]): b for b in range(256)}
    han = "A世".encode()
    for k in (2, 3, 4):  # merges that would glue "A" to the Han character
        ranks[han[:k]] = len(ranks)
    kimi = _encoding(KIMI_PAT_STR, ranks)
    plain = _encoding(r"\p{L}+|\s+", ranks)
    assert plain.encode_ordinary("A世") == [ranks[han]]
    # the `&&[^\p{Han}]` intersection keeps Han out of the word chunk
    assert kimi.encode_ordinary("A世") == [ord("A"), *"世".encode()]


# ---------------------------------------------------------------- encode / decode


@settings(max_examples=200, deadline=None)
@given(_text_with_unicode())
def test_roundtrip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size and i not in tok.special_tokens.values() for i in ids)
    assert tok.decode(ids) == text


def test_trained_vocab_compresses_unicode(tok: Tokenizer) -> None:
    text = "分词器应该能处理中文 🎉🎉 the quick brown fox"
    assert len(tok.encode(text)) < len(text.encode())


def test_special_strings_in_text_stay_text(tok: Tokenizer) -> None:
    specials = set(tok.special_tokens.values())
    for name in ["<|im_end|>", "[EOS]", "<|im_user|>", "[BOS]", "<|reserved_token_5|>"]:
        text = f"say {name} now"
        ids = tok.encode(text)
        assert not specials & set(ids), name
        assert tok.decode(ids) == text


def test_decode_special_ids_and_bad_ids(tok: Tokenizer) -> None:
    assert tok.decode([tok.im_end_id]) == "<|im_end|>"
    with pytest.raises(TokenizerError, match="vocab_size"):
        tok.decode([tok.vocab_size])
    with pytest.raises(TokenizerError):
        tok.decode([-1])


def test_skip_special_tokens(byte_tok: Tokenizer) -> None:
    ids = [*byte_tok.encode("a"), byte_tok.im_end_id, byte_tok.vocab_size - 3,
           *byte_tok.encode("é")]
    assert byte_tok.decode(ids) == "a<|im_end|><|reserved_token_253|>é"
    assert byte_tok.decode(ids, skip_special_tokens=True) == "aé"
    dec = byte_tok.stream_decoder(skip_special_tokens=True)
    assert "".join(dec.push([i]) for i in ids) + dec.flush() == "aé"


def test_long_runs_split_like_kimi(tok: Tokenizer) -> None:
    text = "x" * (MAX_NO_WHITESPACES_CHARS + 7) + " " * 5 + "y"
    pieces = list(_split_long_runs(text))
    assert "".join(pieces) == text
    assert [len(p) for p in pieces] == [MAX_NO_WHITESPACES_CHARS, 13]
    assert tok.decode(tok.encode(text)) == text


def test_encode_allow_special(tok: Tokenizer) -> None:
    text = "a<|im_end|>b<|reserved_token_5|><|im_end|>"
    ids = tok.encode(text, allow_special=True)
    assert ids == [*tok.encode("a"), tok.im_end_id, *tok.encode("b"),
                   tok.special_tokens["<|reserved_token_5|>"], tok.im_end_id]
    assert tok.decode(ids) == text == tok.decode(tok.encode(text))
    assert tok.encode("plain", allow_special=True) == tok.encode("plain")
    assert tok.encode("") == tok.encode("", allow_special=True) == []


# ---------------------------------------------------------------- Kimi's special block


def _kimi_dir(tmp_path: Path, named: dict[int, str] | None) -> Path:
    """The bundled ranks, plus a config naming `named` (offsets in the block) or none."""
    shutil.copy(BUNDLED / MODEL_FILE, tmp_path / MODEL_FILE)
    if named is not None:
        n = len(_parse_ranks(tmp_path / MODEL_FILE))
        added = {str(n + off): {"content": name, "special": True} for off, name in named.items()}
        (tmp_path / CONFIG_FILE).write_text(json.dumps({"added_tokens_decoder": added}))
    return tmp_path


@pytest.mark.parametrize("named", [None, K2_INSTRUCT_NAMED], ids=["no-config", "k2-instruct"])
def test_every_id_of_a_kimi_tokenizer_decodes(tmp_path: Path, named: dict[int, str] | None
                                              ) -> None:
    tok = Tokenizer.from_dir(_kimi_dir(tmp_path, named))
    n = len(_parse_ranks(tmp_path / MODEL_FILE))
    assert tok.vocab_size == n + NUM_RESERVED_SPECIAL
    block = range(n, n + NUM_RESERVED_SPECIAL)
    assert sorted(tok.special_tokens.values()) == list(block)
    texts = [tok.decode([i]) for i in range(tok.vocab_size)]
    assert all(texts)
    assert tok.decode(list(range(tok.vocab_size))) == "".join(texts)
    # the whole block is special: skipped together, ordinary ids all kept
    assert tok.decode(list(block), skip_special_tokens=True) == ""
    assert tok.decode(list(range(n)), skip_special_tokens=True) == tok.decode(list(range(n)))
    # Kimi's names: the config's where given, the absolute id everywhere else
    layout = named or {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>",
                       4: "<|im_assistant|>", 10: "<|im_system|>", 17: "<|im_middle|>",
                       254: "[UNK]", 255: "[PAD]"}
    for off in range(NUM_RESERVED_SPECIAL):
        want = layout.get(off, f"<|reserved_token_{n + off}|>")
        assert texts[n + off] == want
        assert tok.special_tokens[want] == n + off
    assert (tok.bos_id, tok.eos_id, tok.im_end_id, tok.im_middle_id, tok.pad_id) == (
        n, n + 1, n + 2, n + 17, n + 255)
    with pytest.raises(TokenizerError, match="vocab_size"):
        tok.decode([tok.vocab_size])


def test_kimi_special_tokens_at_real_scale() -> None:
    block = kimi_special_tokens(163584, {163584 + k: v for k, v in K2_INSTRUCT_NAMED.items()})
    assert len(block) == 256
    assert block["<|reserved_token_163589|>"] == 163589
    assert block["<|im_middle|>"] == 163601 and block["[PAD]"] == 163839
    assert reserved_token_name(163838) not in block  # [UNK] is named
    with pytest.raises(TokenizerError, match="names both"):
        kimi_special_tokens(10, {10: "<|reserved_token_11|>"})


def test_config_ids_outside_the_block_and_gaps_still_decode(tmp_path: Path) -> None:
    _kimi_dir(tmp_path, None)
    n = len(_parse_ranks(tmp_path / MODEL_FILE))
    extra = n + NUM_RESERVED_SPECIAL + 10
    added = {str(n + 2): {"content": "<|im_end|>"}, str(extra): {"content": "<|extra|>"}}
    (tmp_path / CONFIG_FILE).write_text(json.dumps({"added_tokens_decoder": added}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.vocab_size == extra + 1
    assert tok.decode([extra - 1, extra]) == f"<|reserved_token_{extra - 1}|><|extra|>"
    assert tok.decode(list(range(n, extra + 1)), skip_special_tokens=True) == ""
    # a tokenizer built directly with gaps between its ids gets the same treatment
    direct = Tokenizer({bytes([b]): b for b in range(256)}, {"<|a|>": 300})
    assert direct.decode([260, 300]) == "<|reserved_token_260|><|a|>"


def test_ranks_must_be_contiguous(tmp_path: Path) -> None:
    lines = [base64.b64encode(bytes([b])) + b" " + str(b).encode() for b in range(256)]
    (tmp_path / MODEL_FILE).write_bytes(b"\n".join([*lines, b"YWI= 300"]) + b"\n")
    with pytest.raises(TokenizerError, match=r"ranks must be 0\.\.256"):
        Tokenizer.from_dir(tmp_path)


def _stdlib_corpus() -> str:
    import argparse
    import difflib
    import email
    import textwrap

    files = [Path(argparse.__file__), Path(difflib.__file__), Path(textwrap.__file__),
             *sorted(Path(json.__file__).parent.glob("*.py")),
             Path(email.__file__).parent / "_header_value_parser.py"]
    return "".join(f.read_text(encoding="utf-8") for f in files)


def test_roundtrip_on_python_sources(tmp_path: Path) -> None:
    text = _stdlib_corpus() + "".join(CORPUS) + "".join(UNICODE_SAMPLES)
    assert len(text) > 200_000
    for k, named in enumerate((None, K2_INSTRUCT_NAMED)):
        (tmp_path / str(k)).mkdir()
        tok = Tokenizer.from_dir(_kimi_dir(tmp_path / str(k), named))
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert not set(ids) & set(tok.special_tokens.values())
        with_specials = tok.encode(text, allow_special=True)
        assert tok.decode(with_specials) == text
        assert tok.im_end_id in with_specials  # UNICODE_SAMPLES holds one <|im_end|>
        dec = tok.stream_decoder()
        assert "".join(dec.push(ids[i:i + 7]) for i in range(0, len(ids), 7)) + dec.flush() == (
            text)


# ---------------------------------------------------------------- special ids / files


def test_special_ids_follow_kimi_relative_layout(tok: Tokenizer) -> None:
    n = 400
    assert tok.vocab_size == n + 256
    assert (tok.bos_id, tok.eos_id, tok.im_end_id, tok.im_user_id, tok.im_assistant_id) == (
        n, n + 1, n + 2, n + 3, n + 4
    )
    assert (tok.im_system_id, tok.im_middle_id, tok.pad_id) == (n + 10, n + 17, n + 255)
    assert tok.special_tokens["[UNK]"] == n + 254
    assert tok.special_tokens["<|reserved_token_5|>"] == n + 5
    assert tok.stop_ids == frozenset({n + 1, n + 2})


def test_written_files(tok_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lines = (tok_dir / MODEL_FILE).read_bytes().splitlines()
    assert [int(line.split()[1]) for line in lines] == list(range(400))
    assert base64.b64decode(lines[65].split()[0]) == b"A"
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # tiktoken would cache a copy in /tmp
    ranks = load_tiktoken_bpe(str(tok_dir / MODEL_FILE))
    assert len(ranks) == 400
    config = json.loads((tok_dir / CONFIG_FILE).read_text())
    added = config["added_tokens_decoder"]
    assert len(added) == 256
    assert added["402"] == {
        "content": "<|im_end|>",
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }
    assert added["417"]["content"] == "<|im_middle|>"
    assert added["655"]["content"] == "[PAD]"
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == (
        "[BOS]", "[EOS]", "[PAD]"
    )
    assert "<|im_assistant|>assistant<|im_middle|>" in config["chat_template"]
    assert config["model_max_length"] > 0


def test_special_ids_read_from_config(tok_dir: Path, tmp_path: Path) -> None:
    (tmp_path / MODEL_FILE).write_bytes((tok_dir / MODEL_FILE).read_bytes())
    names = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
             "<|im_middle|>", "[PAD]"]
    ids = [1000 + 7 * k for k in range(len(names))][::-1]
    added = {str(i): {"content": name, "special": True} for name, i in zip(names, ids)}
    (tmp_path / CONFIG_FILE).write_text(json.dumps({"added_tokens_decoder": added}))
    t = Tokenizer.from_dir(tmp_path)
    got = [t.bos_id, t.eos_id, t.im_end_id, t.im_user_id, t.im_assistant_id, t.im_system_id,
           t.im_middle_id, t.pad_id]
    assert got == ids
    assert t.vocab_size == max(ids) + 1
    assert t.decode([t.im_end_id]) == "<|im_end|>"


def test_no_config_falls_back_to_relative_layout(tok_dir: Path, tmp_path: Path) -> None:
    (tmp_path / MODEL_FILE).write_bytes((tok_dir / MODEL_FILE).read_bytes())
    t = Tokenizer.from_dir(tmp_path)
    assert (t.bos_id, t.im_end_id, t.im_middle_id, t.pad_id) == (400, 402, 417, 655)


def test_rewritten_model_file_is_reloaded(tmp_path: Path) -> None:
    write_tokenizer_files(tmp_path, {bytes([b]): b for b in range(256)})
    assert Tokenizer.from_dir(tmp_path).vocab_size == 256 + 256
    write_tokenizer_files(tmp_path, train_bpe(CORPUS, 300))
    assert Tokenizer.from_dir(tmp_path).vocab_size == 300 + 256


def _model_with_lines(tmp_path: Path, extra: list[bytes]) -> Path:
    lines = [base64.b64encode(bytes([b])) + b" " + str(b).encode() for b in range(256)]
    (tmp_path / MODEL_FILE).write_bytes(b"\n".join(lines + extra) + b"\n")
    return tmp_path


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ([b"not-a-valid-line"], r"tiktoken\.model:257: malformed"),
        ([base64.b64encode(b"ab") + b" x"], r"tiktoken\.model:257: malformed"),
        ([b"YWI= 300 7"], r"tiktoken\.model:257: malformed"),
        ([b"YWI= 300", b"YWJj 300"], r"tiktoken\.model:258: rank 300 already used on line 257"),
        ([b"YWI= 300", b"YWI= 301"], r"tiktoken\.model:258: token b'ab' listed twice"),
    ],
)
def test_malformed_model_file(tmp_path: Path, extra: list[bytes], match: str) -> None:
    with pytest.raises(TokenizerError, match=match):
        Tokenizer.from_dir(_model_with_lines(tmp_path, extra))


def test_missing_files(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "nope")
    with pytest.raises(TokenizerError, match=re.escape(str(tmp_path / MODEL_FILE))):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / MODEL_FILE).write_bytes(b"")
    with pytest.raises(TokenizerError, match="no tokens"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / MODEL_FILE).write_bytes(base64.b64encode(b"a") + b" 0\n")
    with pytest.raises(TokenizerError, match="single-byte tokens missing"):
        Tokenizer.from_dir(tmp_path)


def test_bad_config(tmp_path: Path) -> None:
    _model_with_lines(tmp_path, [])
    (tmp_path / CONFIG_FILE).write_text("{not json")
    with pytest.raises(TokenizerError, match=re.escape(CONFIG_FILE)):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / CONFIG_FILE).write_text(json.dumps({"added_tokens_decoder": {"12": {}}}))
    with pytest.raises(TokenizerError, match="entry '12'"):
        Tokenizer.from_dir(tmp_path)
    clash = {"added_tokens_decoder": {"12": {"content": "[EOS]"}}}
    (tmp_path / CONFIG_FILE).write_text(json.dumps(clash))
    with pytest.raises(TokenizerError, match="reuse ids of ordinary tokens"):
        Tokenizer.from_dir(tmp_path)


# ---------------------------------------------------------------- chat template


def _split_at_specials(tok: Tokenizer, ids: list[int]) -> tuple[list[int], list[str]]:
    specials = set(tok.special_tokens.values())
    marks: list[int] = []
    texts: list[str] = []
    seg: list[int] = []
    for i in ids:
        if i in specials:
            marks.append(i)
            texts.append(tok.decode(seg))
            seg = []
        else:
            seg.append(i)
    texts.append(tok.decode(seg))
    return marks, texts[1:]


def test_chat_template_layout(tok: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 12345 + 中文 <|im_end|>?"},
    ]
    ids = tok.apply_chat_template(messages)
    e = tok.encode
    assert ids == (
        [tok.im_system_id, *e("system"), tok.im_middle_id, *e("Be brief."), tok.im_end_id]
        + [tok.im_user_id, *e("user"), tok.im_middle_id]
        + [*e("What is 12345 + 中文 <|im_end|>?"), tok.im_end_id]
        + [tok.im_assistant_id, *e("assistant"), tok.im_middle_id]
    )
    marks, texts = _split_at_specials(tok, ids)
    assert marks == [
        tok.im_system_id, tok.im_middle_id, tok.im_end_id,
        tok.im_user_id, tok.im_middle_id, tok.im_end_id,
        tok.im_assistant_id, tok.im_middle_id,
    ]
    assert texts == ["system", "Be brief.", "", "user", messages[1]["content"], "", "assistant", ""]


def test_chat_template_default_system_and_options(tok: Tokenizer) -> None:
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    marks, texts = _split_at_specials(tok, ids)
    assert marks[:3] == [tok.im_system_id, tok.im_middle_id, tok.im_end_id]
    assert texts[:2] == ["system", DEFAULT_SYSTEM_PROMPT]
    assert texts[3:5] == ["user", "hi"]
    assert ids[-1] == tok.im_end_id  # no generation prompt
    parts = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
    assert tok.apply_chat_template([{"role": "user", "content": parts}]) == (
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    )
    convo = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"role": "tool", "content": "r"},
    ]
    marks, texts = _split_at_specials(tok, tok.apply_chat_template(convo))
    openers = [tok.im_user_id, tok.im_assistant_id, tok.im_system_id, tok.im_assistant_id]
    assert marks[3::3] == openers
    assert texts[3::3] == ["user", "assistant", "tool", "assistant"]


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "messages: List should have at least 1 item"),
        ("hello", "messages: Input should be a valid list"),
        ([{"role": "user", "content": "x"}, "oops"], r"messages\.1: Input should be a valid dict"),
        ([{"content": "x"}], r"messages\.0\.role: Field required"),
        ([{"role": "bot", "content": "x"}], r"messages\.0\.role: Input should be 'system'"),
        ([{"role": "user"}], r"messages\.0: content .* is required"),
        ([{"role": "user", "content": None}], r"messages\.0: content .* is required"),
        # an image part is rendered (engine.media reads its source); other kinds are refused
        ([{"role": "user", "content": [{"type": "audio"}]}], r"content\.0\.type: Input should be"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], r"content\.0\.text: Input"),
    ],
)
def test_bad_messages(tok: Tokenizer, messages: object, match: str) -> None:
    with pytest.raises(TokenizerError, match=match):
        tok.apply_chat_template(messages)  # type: ignore[arg-type]


# ---------------------------------------------------------------- streaming


def test_stream_one_id_at_a_time(byte_tok: Tokenizer, tok: Tokenizer) -> None:
    text = "a🎉b 世界 👩‍👩‍👧 café\n"
    for t in (byte_tok, tok):
        ids = t.encode(text)
        dec = t.stream_decoder()
        pieces = [dec.push([i]) for i in ids]
        assert all("\ufffd" not in p for p in pieces)
        assert "".join(pieces) + dec.flush() == t.decode(ids) == text
    # the 4-byte emoji really was spread over four tokens
    assert len(byte_tok.encode("🎉")) == 4
    dec = byte_tok.stream_decoder()
    assert [dec.push([i]) for i in byte_tok.encode("🎉")] == ["", "", "", "🎉"]


def test_pieces_are_each_ids_push(byte_tok: Tokenizer, tok: Tokenizer) -> None:
    """`pieces` gives what `push` of each id alone gives, however the ids come in steps: a
    character spread over ids comes with its last, a special id (skipped) gives nothing."""
    for t in (byte_tok, tok):
        ids = t.encode("a🎉b 世界 👩‍👩‍👧 café\n")
        special = next(iter(t.special_tokens.values()))
        ids = ids[:3] + [special] + ids[3:]  # within the emoji's bytes in `byte_tok`
        for step in (1, 2, 3, 5, len(ids)):
            one, many = t.stream_decoder(True), t.stream_decoder(True)
            want = [one.push([i]) for i in ids]
            got = [p for k in range(0, len(ids), step) for p in many.pieces(ids[k:k + step])]
            assert got == want and len(got) == len(ids)
            assert "".join(got) + many.flush() == t.decode(ids, True)


def test_stream_flush_of_truncated_character(byte_tok: Tokenizer) -> None:
    dec = byte_tok.stream_decoder()
    assert dec.push(byte_tok.encode("x🎉")[:3]) == "x"
    assert dec.flush() == "\ufffd"
    assert dec.push(byte_tok.encode("ok")) == "ok"


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 255), max_size=40), st.lists(st.integers(1, 5), max_size=40))
def test_stream_matches_decode_on_any_ids(
    byte_tok: Tokenizer, ids: list[int], cuts: list[int]
) -> None:
    dec = byte_tok.stream_decoder()
    out, pos = [], 0
    for k in cuts:
        out.append(dec.push(ids[pos : pos + k]))
        pos += k
    out.append(dec.push(ids[pos:]))
    assert "".join(out) + dec.flush() == byte_tok.decode(ids)


# ---------------------------------------------------------------- training


def test_train_bpe_deterministic_and_compresses() -> None:
    a = train_bpe(CORPUS, 320)
    b = train_bpe(list(CORPUS), 320)
    assert a == b
    assert sorted(a.values()) == list(range(320))
    assert all(a[bytes([x])] == x for x in range(256))
    enc = _encoding(KIMI_PAT_STR, a)
    text = "".join(CORPUS)
    assert len(enc.encode_ordinary(text)) < 0.7 * len(text.encode())
    with pytest.raises(ValueError, match="at least 256"):
        train_bpe(CORPUS, 100)


def test_train_bpe_stops_when_nothing_left_to_merge() -> None:
    ranks = train_bpe(["ab ab"], 1000)
    assert set(ranks) == {bytes([x]) for x in range(256)} | {b"ab", b" ab"}


def test_train_cli(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    for k, text in enumerate(CORPUS):
        (docs / f"{k}.txt").write_text(text * 2, encoding="utf-8")
    (docs / "blob.bin").write_bytes(b"\xff\xfe\x00")
    out = tmp_path / "out"
    train_main(["--input", str(docs), "--vocab-size", "300", "--out", str(out)])
    t = Tokenizer.from_dir(out)
    assert t.vocab_size == 300 + 256
    text = "Speculative 🎉 分词器 <|im_end|>"
    assert t.decode(t.encode(text)) == text


# ---------------------------------------------------------------- stop strings


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 255), st.just(-1)), min_size=1, max_size=60),
       st.lists(st.integers(1, 6), max_size=30), st.integers(0, 2**31))
def test_incremental_stop_check_agrees_with_whole_text(
    byte_tok: Tokenizer, raw: list[int], cuts: list[int], seed: int
) -> None:
    """Steps of a few tokens each (bytes and special ids, which leave no text), each decoded
    once as the scheduler does: the text so far is the whole decode of the ids (but for a
    character still split across them), and `find_stop` finds a stop string at the first step
    whose text holds one, where the whole text's search finds it, and never before."""
    import random

    from engine.scheduler import find_stop

    ids = [byte_tok.im_end_id if i < 0 else i for i in raw]
    text = byte_tok.decode(ids, skip_special_tokens=True)
    rng = random.Random(seed)
    a = rng.randrange(len(text) + 1)
    stops = [text[a:a + rng.randint(1, 5)] or "zz", "never-there"]
    dec = byte_tok.stream_decoder(skip_special_tokens=True)
    decoded, pos = "", 0
    for k in [*cuts, len(ids)]:
        new = ids[pos:pos + k]
        pos += len(new)
        if not new:
            break
        before = len(decoded)
        decoded += dec.push(new)
        assert byte_tok.decode(ids[:pos], skip_special_tokens=True).startswith(decoded)
        hits = [i for s in stops if (i := decoded.find(s)) >= 0]
        assert find_stop(decoded, before, stops) == (min(hits) if hits else None)
        if hits:
            break


def test_output_text_skips_special_ids_by_table(byte_tok: Tokenizer) -> None:
    """Output text (special ids skipped) from the precomputed table equals the ordinary ids'
    decode; ids outside the vocabulary are refused."""
    special = byte_tok.im_end_id
    ids = [104, 105, special, 33, special]
    assert byte_tok.decode(ids, skip_special_tokens=True) == byte_tok.decode([104, 105, 33])
    for bad in ([byte_tok.vocab_size], [-1]):
        with pytest.raises(TokenizerError):
            byte_tok.decode(bad, skip_special_tokens=True)
