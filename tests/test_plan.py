"""graphs.plan on the real configs, no GPU: weight bytes per rank as stored, whether a GPU holds
them with room for KV, and a step's cost at Kimi's sizes that follows the live work."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from types import SimpleNamespace

import pytest

from graphs import plan

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
MODELS = CONFIGS.parent / "models"


def _plan(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "plan.json"
    assert plan.main([*args, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def captured_plan(tmp_path: Path, *args: str) -> SimpleNamespace:
    """`_plan` with what it printed (`out`, `err`): a plan run once for a module's tests."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        r = _plan(tmp_path, *args)
    return SimpleNamespace(r=r, out=out.getvalue(), err=err.getvalue())


K25_COST = ["--model", str(CONFIGS / "kimi-k2.5-text"), "--tp", "8", "--cost", "--batch-sizes",
            "1", "--budgets", "16", "--context", "4096", "--prompt-lens", "64"]


@pytest.fixture(scope="module")
def k25_cost(tmp_path_factory) -> SimpleNamespace:
    """K2.5 at tp 8 with its default (and full) context limit, with the cost table: its memory
    table is the plain `--tp 8` one's (the cost flags only add rows)."""
    return captured_plan(tmp_path_factory.mktemp("k25"), *K25_COST, "--max-model-len", "262144")


def test_kimi_k25_fits_an_h200_at_tp8(k25_cost):
    # NOTE: the model's own max_position_embeddings is 262144, so this is `--tp 8` alone
    r = k25_cost.r
    # 594 GB as stored over 8 ranks, less what every rank holds whole: about 76 GB
    assert r["weight_bytes_per_rank"] == pytest.approx(76e9, rel=0.03)
    assert r["weight_bytes_by_kind"]["int4_experts"] > 0.9 * r["weight_bytes_per_rank"]
    assert r["kv_bytes_per_token"] == 61 * 576 * 2
    assert r["fits"] is True and r["kv_tokens"] > 262144
    assert "fits               yes" in k25_cost.out
    # the vision tower and projector, 0.47e9 parameters in bf16, whole on every rank; the
    # largest image's encoding in the engine's reserve
    assert r["weight_bytes_by_kind"]["vision"] == pytest.approx(2 * 0.47e9, rel=0.02)
    assert r["activation_reserve_bytes"]["image"] > 2 * 16384 * 4304 * 2
    assert "the vision tower 0.94 GB whole" in k25_cost.out and "an image" in k25_cost.out


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


def test_step_cost_follows_the_live_work(tmp_path, k25_cost):
    """Batch 1, budget 16, 4096 tokens of context at K2.5's sizes on 8 ranks: the step reads at
    most 1.5x what its 17 tokens need (this rank's non-expert weights, at most 17 x top-k
    distinct experts per MoE layer as stored, the live KV), the same whatever the context
    limit; the block padding shows in executed FLOPs, not in useful ones."""
    short = _plan(tmp_path, *K25_COST, "--max-model-len", "8192")
    long = k25_cost.r
    tree = {r["mode"]: r for r in long["rows"]}["tree"]
    assert tree["budget"] == 16 and tree["batch_size"] == 1
    kinds = long["weight_bytes_by_kind"]
    # NOTE: a step reads no vision tower weight
    non_expert = long["weight_bytes_per_rank"] - kinds["int4_experts"] - kinds["vision"]
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
