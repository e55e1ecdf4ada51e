"""graphs.plan's cost rows at Kimi's real sizes, no GPU: the FP8 step reads only the routed
experts, `--tune` writes the budget policy its estimates imply, and the memory table of the
same run sizes the pool as the engine does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from graphs import plan
from tests.test_plan import CONFIGS, _plan, captured_plan


@pytest.fixture(scope="module")
def tuned(tmp_path_factory) -> SimpleNamespace:
    """K2.5 with its drafter at tp 8, every engine flag at its default, costed and tuned: the
    memory table is the plain plan's (the cost and tune flags only add rows; the prefill rows,
    which no test here reads, at one short prompt)."""
    tmp = tmp_path_factory.mktemp("tune")
    policy = tmp / "budgets.toml"
    got = captured_plan(tmp, "--model", str(CONFIGS / "kimi-k2.5-text"), "--draft",
                        str(CONFIGS / "kimi-k2.5-dflash"), "--tp", "8", "--cost",
                        "--batch-sizes", "1,64", "--budgets", "4", "--prompt-lens", "64",
                        "--tune", "--accept-lens", "4:3.0", "--sampled-accept-lens", "4:1.01",
                        "--policy-out", str(policy))
    got.policy = policy
    return got


def test_tune_writes_the_policy_its_estimates_imply(tuned):
    """`--cost --tune` at K2.5's sizes: budget 0 (one token a step) is among the rows, each row's
    tokens/s is its accepted length times the batch over its step time, and the table written
    (which the engine reads back) holds the best budget of each (mode, batch size)."""
    from engine.policy import best_budgets, load_budgets

    out, r = tuned.policy, tuned.r
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
    assert "estimated" in out.read_text() and str(out) in tuned.err


def test_the_plan_says_the_pool_the_engine_allocates(tuned):
    """The memory table sizes the KV pool with the engine's rule (`engine.memory`), its default
    flags and its widest captured step (the shipped CUDA budget policy), and the activations it
    measures (every captured step at the largest batch size, sampled variants included, and a
    prefill chunk at CUDA's default) stay within the engine's activation reserve for them."""
    from engine.config import EngineConfig
    from engine.kv_cache import pages_needed
    from engine.memory import GPU_MEMORY_UTILIZATION, PREFILL_CHUNK, size_kv_pool
    from engine.policy import load_budgets, policy_path

    r = tuned.r
    engine = EngineConfig()
    assert r["max_batch_size"] == engine.max_batch_size
    assert r["gpu_memory_utilization"] == engine.gpu_memory_utilization == GPU_MEMORY_UTILIZATION
    page = engine.page_size
    want = size_kv_pool(
        budget_bytes=int(r["gpu_memory_bytes"] * GPU_MEMORY_UTILIZATION),
        used_bytes=r["weight_bytes_per_rank"] + r["reserve_bytes"],
        reserve_bytes=sum(r["activation_reserve_bytes"].values()),
        bytes_per_token=r["kv_bytes_per_token"], page_size=page,
        max_model_len=r["max_model_len"], pages_per_context=r["kv_pages_per_context"],
        max_batch_size=engine.max_batch_size)
    assert r["kv_tokens"] == want.tokens and r["full_context_requests"] == want.contexts >= 1
    # the policy's widest budget at any size sets the page tables' width (a step emits at most
    # the drafter's block of 8)
    most = max(b for t in load_budgets(policy_path("cuda")).values() for b in t.values())
    assert r["budget"] == most
    assert r["kv_pages_per_context"] == pages_needed(262144 + min(most + 1, 8), page)
    steps = r["step_workspace_by_kind"]
    assert {"greedy", "mixed sort", "sampled/lagging sort"} <= set(steps)
    assert r["step_workspace_bytes"] == max(steps.values()) > steps["greedy"]
    assert r["prefill_chunk"] == PREFILL_CHUNK["cuda"]
    reserve = r["activation_reserve_bytes"]
    assert r["step_workspace_bytes"] <= reserve["step"]
    assert 0 < r["prefill_activation_bytes"] <= reserve["prefill"]
    assert r["reserve_warnings"] == []
    assert f"engine's KV pool   {want.tokens:,} tokens" in tuned.out


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
              "--max-model-len", "8192", "--prompt-lens", "64")
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
