"""graphs.plan on the real configs, no GPU: weight bytes per rank as stored, whether a GPU holds
them with room for KV, and a step's cost at Kimi's sizes that follows the live work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from graphs import plan

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
MODELS = CONFIGS.parent / "models"


def _plan(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "plan.json"
    assert plan.main([*args, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_kimi_k25_fits_an_h200_at_tp8(tmp_path, capsys):
    r = _plan(tmp_path, "--model", str(CONFIGS / "kimi-k2.5-text"), "--tp", "8")
    # 594 GB as stored over 8 ranks, less what every rank holds whole: about 76 GB
    assert r["weight_bytes_per_rank"] == pytest.approx(76e9, rel=0.03)
    assert r["weight_bytes_by_kind"]["int4_experts"] > 0.9 * r["weight_bytes_per_rank"]
    assert r["kv_bytes_per_token"] == 61 * 576 * 2
    assert r["fits"] is True and r["kv_tokens"] > 262144
    assert "fits               yes" in capsys.readouterr().out


def test_kimi_k2_fp8_at_tp8_says_how_little_kv_room_is_left(tmp_path, capsys):
    r = _plan(tmp_path, "--model", str(CONFIGS / "kimi-k2-instruct"), "--tp", "8",
              "--gpu-memory", "141GB")
    assert r["weight_bytes_per_rank"] == pytest.approx(129e9, rel=0.03)
    assert r["weight_bytes_by_kind"]["fp8"] > 0.9 * r["weight_bytes_per_rank"]
    assert 0 < r["kv_room_bytes"] < 12e9 and r["fits"] is False
    assert "lower --max-model-len, or raise --tp" in r["knob"]
    assert "KV room" in capsys.readouterr().out
    r16 = _plan(tmp_path, "--model", str(CONFIGS / "kimi-k2-instruct"), "--tp", "16")
    assert r16["fits"] is True and r16["weight_bytes_per_rank"] < 0.55 * r["weight_bytes_per_rank"]


def test_step_cost_follows_the_live_work(tmp_path):
    """Batch 1, budget 16, 4096 tokens of context at K2.5's sizes on 8 ranks: the step reads at
    most 1.5x what its 17 tokens need (this rank's non-expert weights, at most 17 x top-k
    distinct experts per MoE layer as stored, the live KV), the same whatever the context
    limit; the block padding shows in executed FLOPs, not in useful ones."""
    args = ["--model", str(CONFIGS / "kimi-k2.5-text"), "--tp", "8", "--cost", "--batch-sizes",
            "1", "--budgets", "16", "--context", "4096", "--prompt-lens", "64"]
    short = _plan(tmp_path, *args, "--max-model-len", "8192")
    long = _plan(tmp_path, *args, "--max-model-len", "262144")
    tree = {r["mode"]: r for r in long["rows"]}["tree"]
    assert tree["budget"] == 16 and tree["batch_size"] == 1
    kinds = long["weight_bytes_by_kind"]
    non_expert = long["weight_bytes_per_rank"] - kinds["int4_experts"]
    experts = 60 * min(384, 17 * 8) * kinds["int4_experts"] / (60 * 384)
    need = non_expert + experts + 4096 * long["kv_bytes_per_token"]
    assert need <= tree["bytes"] <= 1.5 * need
    for a, b in zip(short["rows"], long["rows"]):
        assert a["bytes"] == pytest.approx(b["bytes"], rel=0.05)
    assert tree["executed_flops"] > tree["flops"] > 0
    assert tree["allreduce_bytes"] == 2 * 61 * 17 * 7168 * 2 + 17 * 7168 * 2  # + embedding
    ar = {r["mode"]: r for r in long["rows"]}["ar"]
    assert ar["bytes"] < tree["bytes"] and tree["speedup"]["H200"] > 0


def test_cost_rows_count_launches_attention_programs_and_prefills(tmp_path, capsys):
    """The bundled pair's configs: each step row says its launches and the paged attention
    programs with work at the context (the drafter's too in tree mode), and each prompt length
    gets a prefill row in the engine's chunks, whose cost grows with the chunks' context."""
    r = _plan(tmp_path, "--model", str(MODELS / "kimi-mini"), "--draft",
              str(MODELS / "kimi-mini-dflash"), "--cost", "--batch-sizes", "1", "--budgets", "8",
              "--context", "4096", "--prompt-lens", "300,1000,1500", "--prefill-chunk", "512")
    rows = {x["mode"]: x for x in r["rows"]}
    assert rows["tree"]["attention_programs"]["mla_prefix"] >= 64
    assert rows["tree"]["attention_programs"]["draft_context"] >= 64
    assert rows["ar"]["attention_programs"]["draft_context"] == 0
    assert rows["tree"]["launches"] > rows["ar"]["launches"] > 0
    pre = {x["prompt_len"]: x for x in r["prefill_rows"]}
    assert [pre[n]["chunks"] for n in (300, 1000, 1500)] == [1, 2, 3]
    assert pre[300]["flops"] < pre[1000]["flops"] < pre[1500]["flops"]
    assert pre[1500]["launches"] > pre[1000]["launches"] > pre[300]["launches"]
    out = capsys.readouterr().out
    assert "attn progs" in out and "prefill cost per rank" in out


def test_the_plan_says_the_pool_the_engine_allocates(tmp_path, capsys):
    """The memory table sizes the KV pool with the engine's rule (`engine.memory`), its default
    flags and its widest captured step (the shipped CUDA budget policy), and the activations it
    measures (every captured step at the largest batch size, sampled variants included, and a
    prefill chunk at CUDA's default) stay within the engine's activation reserve for them."""
    from engine.config import EngineConfig
    from engine.kv_cache import pages_needed
    from engine.memory import GPU_MEMORY_UTILIZATION, PREFILL_CHUNK, size_kv_pool
    from engine.policy import load_budgets, policy_path

    r = _plan(tmp_path, "--model", str(CONFIGS / "kimi-k2.5-text"), "--draft",
              str(CONFIGS / "kimi-k2.5-dflash"), "--tp", "8")
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
    assert f"engine's KV pool   {want.tokens:,} tokens" in capsys.readouterr().out


def test_the_plan_warns_when_a_measured_activation_outgrows_the_engines_estimate(
        tmp_path, capsys, monkeypatch):
    """Each part of the engine's reserve is checked against what the plan measures for it."""
    import engine.memory

    monkeypatch.setattr(engine.memory, "step_activation_bytes", lambda **kw: 0)
    r = _plan(tmp_path, "--model", str(MODELS / "kimi-mini"), "--draft",
              str(MODELS / "kimi-mini-dflash"), "--prefill-chunk", "64", "--max-batch-size", "2")
    assert r["activation_reserve_bytes"]["step"] == 0 < r["step_workspace_bytes"]
    assert any("step_activation_bytes" in w for w in r["reserve_warnings"])
    assert "warning            the measured step activations" in capsys.readouterr().out
