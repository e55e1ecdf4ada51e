"""Held-out prompts: text the bundled model never trained on, for benchmarks and profiles.

`models/kimi-mini/held_out.jsonl` holds, one JSON string a line, every prompt that the training
tools cut from the held-out files of their corpus (`tools.corpus.held_out_candidates`; written
by `tools.train_target` next to the model it trains). A seeded sample of that list is the list
`tools.corpus.held_out_prompts` returns, so the runtime gets the same prompts without reading the
training corpus (the Python standard library it was trained on) or importing the training tools.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HELD_OUT = Path(__file__).resolve().parent.parent / "models" / "kimi-mini" / "held_out.jsonl"


def sample_prompts(candidates: list[str], n: int, seed: int = 0) -> list[str]:
    """`n` of `candidates`, drawn without replacement by a generator seeded with `seed`."""
    if len(candidates) < n:
        raise ValueError(f"only {len(candidates)} held-out prompts available, {n} asked")
    return random.Random(seed).sample(candidates, n)


def read_candidates(path: Path = HELD_OUT) -> list[str]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def write_candidates(path: Path, candidates: list[str]) -> None:
    path.write_text("".join(json.dumps(c) + "\n" for c in candidates), encoding="utf-8")


def held_out_prompts(n: int, seed: int = 0, path: Path = HELD_OUT) -> list[str]:
    """`n` prompts from `path` (each a `def` line with the lines just above it, ending right after
    the signature); the same as `tools.corpus.held_out_prompts(n, seed)`."""
    return sample_prompts(read_candidates(path), n, seed)
