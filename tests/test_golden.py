"""Greedy output of the bundled pair, pinned token for token: whatever changes inside the engine,
these ids must not (regenerate only for a deliberate change of the model or its numerics:
`python -m tests.test_golden`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.tools.corpus import held_out_prompts

GOLDEN = Path(__file__).resolve().parent / "golden" / "bundled_greedy.json"
CHAT = [{"role": "user", "content": "Write a function that adds two numbers."}]


def prompts() -> list:
    return [*held_out_prompts(3, seed=5), {"messages": CHAT}, [100, 101, 102, 32, 109, 97]]


def generate(mode: str, **kw) -> list[list[int]]:
    llm = LLM(mode=mode, progress=False, **kw)
    outs = llm.generate(prompts(), SamplingParams(max_new_tokens=40, ignore_eos=True))
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("mode,kw", [("tree", dict(budget=16, max_batch_size=4)),
                                     ("chain", dict(max_batch_size=2)),
                                     ("ar", dict(max_batch_size=5))])
def test_bundled_greedy_matches_golden(mode, kw):
    assert generate(mode, **kw) == json.loads(GOLDEN.read_text())["token_ids"]


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps({"token_ids": generate("ar", max_batch_size=5)}) + "\n")
    print(f"wrote {GOLDEN}")
