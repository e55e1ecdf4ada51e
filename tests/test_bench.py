"""`python -m bench.spec` end to end on a tiny random pair: every run appears once per round,
greedy outputs of every mode equal ar's, and the JSON and plot are written."""

from __future__ import annotations

import json
from pathlib import Path

from bench import spec


def test_bench_spec_random_pair(tmp_path: Path) -> None:
    spec.main(["--random", "--budgets", "2", "4", "--prompts", "2", "--max-new-tokens", "6",
               "--rounds", "2", "--no-transformers", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "spec.json").read_text())
    names = [r["name"] for r in data["runs"]]
    assert names == ["ar", "chain", "tree-2", "tree-4", "tree-16 T=0.7"]
    for r in data["runs"]:
        assert len(r["tokens_per_s_rounds"]) == 2
        assert r["tokens_per_s"] in r["tokens_per_s_rounds"]
        assert r["tokens"] == 2 * 6
    for r in data["runs"][:4]:
        assert r["same_as_ar"] == 2
    assert (tmp_path / "spec.png").stat().st_size > 0
