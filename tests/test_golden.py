"""Greedy output of the bundled pair, pinned token for token: whatever changes inside the engine,
these ids must not (regenerate only for a deliberate change of the model or its numerics:
`python -m tests.test_golden`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.held_out import held_out_prompts

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




QUANTIZED = Path(__file__).resolve().parent / "golden" / "quantized_greedy.json"
QPROMPTS = [[5, 6, 7, 8, 9], list(range(100, 131)), [42] * 12]


def quantized_tokens(root: Path) -> dict[str, list[list[int]]]:
    """Greedy AR and tree tokens of tiny INT4-expert and FP8 checkpoints (fixed seeds)."""
    from tools.make_draft import make_draft
    from tools.make_tiny import make_tiny

    out = {}
    for kind in ("int4", "fp8"):
        t = make_tiny(root / kind, dtype="fp32", seed=11, int4_experts=kind == "int4",
                      fp8=kind == "fp8", layers=3, experts=8, first_dense=1)
        d = make_draft(t, root / f"{kind}-draft", layers=1, block_size=4, seed=12)
        params = SamplingParams(max_new_tokens=24, ignore_eos=True)
        for mode in ("ar", "tree"):
            llm = LLM(t, d, mode=mode, budget=6, max_batch_size=2, progress=False)
            out[f"{kind}-{mode}"] = [o.token_ids for o in llm.generate(QPROMPTS, params)]
    return out


def test_quantized_checkpoints_match_golden(tmp_path):
    got = quantized_tokens(tmp_path)
    assert got["int4-ar"] == got["int4-tree"] and got["fp8-ar"] == got["fp8-tree"]
    assert got == json.loads(QUANTIZED.read_text())


if __name__ == "__main__":
    import tempfile

    GOLDEN.write_text(json.dumps({"token_ids": generate("ar", max_batch_size=5)}) + "\n")
    with tempfile.TemporaryDirectory() as d:
        QUANTIZED.write_text(json.dumps(quantized_tokens(Path(d))) + "\n")
    print(f"wrote {GOLDEN} and {QUANTIZED}")
