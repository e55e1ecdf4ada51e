"""graphs.plan's cost rows at Kimi's real sizes, no GPU: the FP8 step reads only the routed
experts, and `--tune` writes the budget policy its estimates imply."""

from __future__ import annotations

import pytest

from graphs import plan
from tests.test_plan import CONFIGS, _plan


def test_tune_writes_the_policy_its_estimates_imply(tmp_path, capsys):
    """`--cost --tune` at K2.5's sizes: budget 0 (one token a step) is among the rows, each row's
    tokens/s is its accepted length times the batch over its step time, and the table written
    (which the engine reads back) holds the best budget of each (mode, batch size)."""
    from engine.policy import best_budgets, load_budgets

    out = tmp_path / "budgets.toml"
    r = _plan(tmp_path, "--model", str(CONFIGS / "kimi-k2.5-text"), "--draft",
              str(CONFIGS / "kimi-k2.5-dflash"), "--tp", "8", "--cost", "--batch-sizes", "1,64",
              "--budgets", "4", "--tune", "--accept-lens", "4:3.0",
              "--sampled-accept-lens", "4:1.01", "--policy-out", str(out))
    rows = r["tune"]
    assert {(m["sample"], m["batch_size"], m["budget"]) for m in rows} == {
        (s, bs, b) for s in (False, True) for bs in (1, 64) for b in (0, 4)}
    for m in rows:
        assert m["tokens_per_s"] == pytest.approx(m["accept"] * m["batch_size"] * 1e3
                                                  / m["step_ms"])
        assert m["accept"] == {0: 1.0, 4: 3.0 if not m["sample"] else 1.01}[m["budget"]]
    assert load_budgets(out) == best_budgets(rows)
    # drafts that are hardly ever accepted do not pay for their step
    assert load_budgets(out)[True] == {1: 0, 64: 0}
    assert "estimated" in out.read_text() and str(out) in capsys.readouterr().err


def test_tune_needs_the_accepted_lengths(capsys):
    with pytest.raises(SystemExit):
        plan.main(["--model", str(CONFIGS / "kimi-k2.5-text"), "--cost", "--tune"])
    assert "--accept-lens" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan.main(["--model", str(CONFIGS / "kimi-k2.5-text"), "--accept-lens", "4:9.0"])
    assert "between 1 and budget + 1" in capsys.readouterr().err


def test_kimi_k2_fp8_step_reads_only_the_routed_experts(tmp_path):
    """K2's FP8 expert banks run `kimi::moe_experts_fp8` on the captured step: batch 1, budget
    16, 4096 tokens of context on 8 ranks read at most 1.5x what the tokens need (at most
    tokens x top-k distinct experts per MoE layer, a byte a value plus the block scales),
    never the whole bank dequantized."""
    r = _plan(tmp_path, "--model", str(CONFIGS / "kimi-k2-instruct"), "--tp", "8", "--cost",
              "--batch-sizes", "1", "--budgets", "16", "--context", "4096",
              "--max-model-len", "8192")
    # 60 MoE layers of 384 experts, each 3 x 256 x 7168 fp8 values on a rank with an fp32
    # scale per 128 x 128 block
    per_expert = 3 * 256 * 7168 + 4 * 3 * 2 * 56
    # the embedding's rank slice is only looked up, one row a token
    non_expert = r["weight_bytes_per_rank"] - 60 * 384 * per_expert - 163840 // 8 * 7168 * 2
    rows = {row["mode"]: row for row in r["rows"]}
    for mode, tokens in (("ar", 1), ("tree", 17)):
        need = non_expert + 60 * min(384, tokens * 8) * per_expert + 4096 * r["kv_bytes_per_token"]
        assert need <= rows[mode]["bytes"] <= 1.5 * need, mode
    assert rows["tree"]["peak_activation_bytes"] < 1e9
