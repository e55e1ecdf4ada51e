"""Train a small byte-level BPE vocabulary and write it in Kimi's tokenizer file layout.

    python -m tools.train_tokenizer --input FILE_OR_DIR --vocab-size 4000 --out DIR

Ranks 0..255 are the single bytes, so any text encodes and decodes back exactly.
"""

from __future__ import annotations

import argparse
import heapq
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

from engine.tokenizer import KIMI_PAT_STR, write_tokenizer_files

Pair = tuple[int, int]

# Used only when the `regex` module (a tiktoken dependency) is missing: Python's `re` cannot
# compile Kimi's pattern, so cut at roughly the same places (words with one leading
# non-letter, digit groups, punctuation runs, whitespace).
_FALLBACK_PAT = r"""[^\W\d_]+|\d{1,3}| ?[^\s\w]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+|_+"""


def _chunker(pat_str: str) -> Callable[[str], list[str]]:
    try:
        import regex
    except ImportError:
        return re.compile(_FALLBACK_PAT).findall
    # NOTE: V1 is needed for the nested set intersection `[...&&[^\p{Han}]]`; in the default
    # V0 mode `regex` reads `&&` literally.
    return regex.compile(pat_str, flags=regex.V1).findall


def _pairs(word: list[int]) -> Counter[Pair]:
    return Counter(zip(word, word[1:]))


def _merge_word(word: list[int], pair: Pair, new_id: int) -> list[int]:
    a, b = pair
    out: list[int] = []
    i = 0
    n = len(word)
    while i < n:
        if i + 1 < n and word[i] == a and word[i + 1] == b:
            out.append(new_id)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def train_bpe(
    texts: Iterable[str], vocab_size: int, pat_str: str = KIMI_PAT_STR
) -> dict[bytes, int]:
    """Learns byte-level BPE ranks (`bytes -> rank`, ranks 0..vocab_size-1 or fewer).

    Merges never cross pre-tokenizer chunks, matching how tiktoken applies the ranks. Each step
    merges the most frequent adjacent pair; ties go to the smallest (left id, right id), so the
    result depends only on the input.
    """
    if vocab_size < 256:
        raise ValueError(f"vocab_size must be at least 256 (the single bytes), got {vocab_size}")
    chunk = _chunker(pat_str)
    chunk_counts: Counter[str] = Counter()
    for text in texts:
        chunk_counts.update(chunk(text))

    # Work on unique chunks weighted by frequency; a repeated word costs one update per merge.
    words: list[list[int]] = []
    freqs: list[int] = []
    for piece, freq in sorted(chunk_counts.items()):
        encoded = list(piece.encode("utf-8"))
        if len(encoded) > 1:
            words.append(encoded)
            freqs.append(freq)

    id_bytes: list[bytes] = [bytes([b]) for b in range(256)]
    ranks: dict[bytes, int] = {tok: i for i, tok in enumerate(id_bytes)}

    pair_counts: dict[Pair, int] = {}
    pair_words: dict[Pair, set[int]] = {}
    for w, (word, freq) in enumerate(zip(words, freqs)):
        for pair, k in _pairs(word).items():
            pair_counts[pair] = pair_counts.get(pair, 0) + k * freq
            pair_words.setdefault(pair, set()).add(w)
    # Max-heap with lazy deletion: an entry is live only while its count is still current.
    heap = [(-c, pair) for pair, c in pair_counts.items()]
    heapq.heapify(heap)

    # Token ids are ranks: a new id is only made together with a new rank.
    while len(id_bytes) < vocab_size and heap:
        neg, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -neg:
            continue
        merged = id_bytes[pair[0]] + id_bytes[pair[1]]
        # NOTE: two different pairs can spell the same bytes ("ab"+"c", "a"+"bc"); reuse the
        # existing id so that every rank in the file is unique.
        new_id = ranks.get(merged)
        if new_id is None:
            new_id = len(id_bytes)
            id_bytes.append(merged)
            ranks[merged] = new_id
        changed: set[Pair] = set()
        for w in sorted(pair_words.pop(pair, ())):
            old = _pairs(words[w])
            words[w] = _merge_word(words[w], pair, new_id)
            new = _pairs(words[w])
            freq = freqs[w]
            for p, k in old.items():
                pair_counts[p] -= k * freq
                changed.add(p)
                if p not in new and p != pair:
                    pair_words.get(p, set()).discard(w)
            for p, k in new.items():
                pair_counts[p] = pair_counts.get(p, 0) + k * freq
                changed.add(p)
                pair_words.setdefault(p, set()).add(w)
        pair_counts.pop(pair, None)
        for p in changed:
            c = pair_counts.get(p, 0)
            if c > 0:
                heapq.heappush(heap, (-c, p))
            else:
                pair_counts.pop(p, None)
                pair_words.pop(p, None)
    return ranks


def _read_texts(path: Path) -> list[str]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    texts: list[str] = []
    for f in files:
        if any(part.startswith(".") for part in f.relative_to(path).parts):
            continue
        try:
            texts.append(f.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            print(f"skipping {f}: not UTF-8 text", file=sys.stderr)
    if not texts:
        raise SystemExit(f"no UTF-8 text found under {path}")
    return texts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, type=Path, help="a text file or a directory")
    parser.add_argument("--vocab-size", type=int, default=4000, help="ordinary tokens")
    parser.add_argument("--out", required=True, type=Path, help="directory to write into")
    parser.add_argument("--num-reserved-special", type=int, default=256)
    args = parser.parse_args(argv)
    if not args.input.exists():
        parser.error(f"--input {args.input} does not exist")
    ranks = train_bpe(_read_texts(args.input), args.vocab_size)
    write_tokenizer_files(args.out, ranks, num_reserved_special=args.num_reserved_special)
    print(f"wrote {len(ranks)} ranks + {args.num_reserved_special} specials to {args.out}")


if __name__ == "__main__":
    main()
