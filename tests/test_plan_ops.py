"""The cost model charges what a GPU charges (`graphs.plan`): each op at the peak of the unit its
dtype runs on, its HBM bytes and its tiles' L2 re-reads; a kimi:: op's kernels counted from its
implementation; host-to-device copies counted as syncs (`graphs.rehearse`); prefill rows with
their ops and the roofline at the engine's sharding; the rehearsal's attention backend as the
engine would pick it on a GPU, and the step variants captured while serving."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from graphs import plan, rehearse
from graphs.plan import GPUS, CostMode, op_seconds, op_unit
from graphs.rehearse import DeviceMode, kimi_launches

REPO = Path(__file__).resolve().parent.parent
MINI = ["--model", str(REPO / "models" / "kimi-mini"), "--draft",
        str(REPO / "models" / "kimi-mini-dflash")]


@pytest.fixture(scope="module")
def mini_cost() -> dict:
    """The cost rows of `--cost` (without the memory table) on the bundled pair's configs."""
    a = plan.build_parser().parse_args([
        *MINI, "--cost", "--batch-sizes", "1", "--budgets", "4", "--context", "256",
        "--prompt-lens", "300", "--prefill-chunk", "128", "--cached-turn", "64,192"])
    models, _ = plan.build(a.model, a.draft, 1, torch.bfloat16)
    gpus = ["H200", "H100"]
    return {"rows": plan.costs(a, models, torch.bfloat16, gpus),
            "prefill_rows": plan.prefill_costs(a, models, torch.bfloat16, gpus)}


def test_every_op_costs_at_least_its_flops_at_its_units_peak_and_its_bytes(mini_cost):
    pre = mini_cost["prefill_rows"]
    # the prompts cold (the turn's among them, by length), then the turn over its cached prefix
    assert [r["prompt_len"] for r in pre] == [256, 300, 256] and pre[2]["cached"] == 192
    for r in pre + mini_cost["rows"]:
        assert r["ops"] and {"name", "dtype", "flops", "bytes", "seconds"} <= set(r["ops"][0])
        for g in ("H200", "H100"):
            gpu = GPUS[g]
            for op in r["ops"]:
                least = max(op["flops"] / gpu.peak(op["dtype"]), op["bytes"] / gpu.hbm)
                assert op["seconds"][g] >= least * (1 - 1e-12), (g, op)
            ops = sum(op["seconds"][g] for op in r["ops"])
            assert r["seconds"][g] == pytest.approx(ops) or r["seconds"][g] > ops
    for r in pre:
        assert set(r["roofline_seconds"]) == {"H200", "H100"}
        assert 0 < r["roofline_seconds"]["H200"] <= r["roofline_seconds"]["H100"]
    # the chunks' ops add up to the row's bytes; the executed FLOPs (the experts' padding too)
    for r in pre:
        assert sum(op["bytes"] for op in r["ops"]) == pytest.approx(r["bytes"], rel=1e-9)
    names = {op["name"] for op in pre[0]["ops"]}
    assert "kimi.moe_experts" in names or "kimi.moe_experts_w4a16" in names
    # a later chunk's re-reads: the paged prefix kernel's row tiles each stream the prefix
    # (the absorbed form), or none where the prefill takes another form
    assert all(op["l2_bytes"] >= 0 for op in pre[0]["ops"])


def test_op_units_follow_dtype_and_tf32():
    assert op_unit(torch.bfloat16, True) == op_unit(torch.float16, False) == "bf16"
    assert op_unit(torch.float8_e4m3fn, True) == "fp8"
    assert op_unit(torch.int64, False) == "int64"
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert op_unit(torch.float32, True) == "fp32"
        torch.set_float32_matmul_precision("high")
        assert op_unit(torch.float32, True) == "tf32" and op_unit(torch.float32, False) == "fp32"
    finally:
        torch.set_float32_matmul_precision(before)
    h = GPUS["H100"]
    assert h.peak("fp32") < h.peak("tf32") < h.peak("bf16") < h.peak("fp8")
    assert GPUS["H100"].hbm < GPUS["H200"].hbm and GPUS["H100"].memory == 80e9
    op = {"flops": 1e12, "bytes": 1e9, "l2_bytes": 1e11, "dtype": "fp32"}
    assert op_seconds(op, h) == pytest.approx(1e12 / 67e12)
    assert op_seconds({**op, "dtype": "bf16"}, h) == pytest.approx(1e11 / h.l2)


def test_an_fp32_matmul_is_charged_at_the_cuda_cores():
    """`linear` decomposes under the FLOP counter: its FLOPs still land on its own op."""
    x = torch.empty(512, 1024, device="meta")
    w = torch.empty(2048, 1024, device="meta")
    flops = FlopCounterMode(display=False)
    cost = CostMode(0, flops)
    with flops, cost:
        torch.nn.functional.linear(x, w)
        torch.nn.functional.linear(x.bfloat16(), w.bfloat16())
    by_unit = {u: [sum(v[i] for (_, unit), v in cost.ops.items() if unit == u) for i in (0, 1)]
               for u in ("fp32", "bf16")}
    assert by_unit["fp32"][0] == by_unit["bf16"][0] == 2 * 512 * 1024 * 2048
    # the fp32 matmul reads and writes twice the bytes (the casts to bf16 are bf16's: fp32 in)
    assert by_unit["fp32"][1] > by_unit["bf16"][1]
    assert op_seconds({"flops": by_unit["fp32"][0], "bytes": 0, "dtype": "fp32"}, GPUS["H200"]
                      ) > 10 * op_seconds({"flops": by_unit["bf16"][0], "bytes": 0,
                                           "dtype": "bf16"}, GPUS["H200"])


def test_a_kimi_op_counts_the_kernels_of_its_implementation():
    """The INT4 expert bank at a K2.5 tp-8 shard's shapes: its alignment's ops, the two grouped
    GEMMs (Triton), the activation and the reduction, from its own code on meta."""
    m = dict(device="meta")
    T, H, E, i2, k = 64, 7168, 384, 512, 8
    args = (torch.empty(T, H, dtype=torch.bfloat16, **m),
            torch.empty(T, k, dtype=torch.int64, **m), torch.empty(T, k, **m),
            torch.empty(E, i2, H // 8, dtype=torch.int32, **m),
            torch.empty(E, i2, H // 32, dtype=torch.bfloat16, **m),
            torch.empty(E, H, i2 // 16, dtype=torch.int32, **m),
            torch.empty(E, H, i2 // 64, dtype=torch.bfloat16, **m))
    n = kimi_launches(torch.ops.kimi.moe_experts_w4a16.default, args)
    assert n > 10
    counted = rehearse._Kernels()
    triton = counted.kernel_for(None, None)
    triton[(1,)]()
    assert counted.n == 1  # a Triton launch counts once, runs nothing


def test_host_to_device_copies_are_syncs():
    mode = DeviceMode()
    with mode.phase() as t:
        torch.tensor([1, 2, 3], device="meta")
        torch.arange(4).to("meta")
        dst = torch.empty(4, device="meta")
        dst.copy_(torch.ones(4), non_blocking=True)  # staged, pinned on a GPU: no wait
        dst.copy_(torch.ones(4))
    assert t.syncs == {"tensor to device": 1, "_to_copy to device": 1, "copy_ to device": 1}


def test_the_rehearsal_takes_the_engines_backend_and_the_late_variants(tmp_path, monkeypatch,
                                                                        capsys):
    out = tmp_path / "r.json"
    rc = plan.main([*MINI, "--rehearse", "--prompt-lens", "200", "--prefill-chunk", "128",
                    "--batch-sizes", "1", "--max-batch-size", "1", "--gpu-memory", "8GB",
                    "--json", str(out)])
    r = json.loads(out.read_text())
    assert rc == 0 and r["attention"] == "triton" and r["leaves_out"]
    late = [p for p in r["phases"] if p.get("late")]
    names = {p["name"] for p in late}
    assert {"step greedy +logprobs", "step greedy +adjust", "step mixed sort +adjust+logprobs"
            } <= names
    assert all(p["host_syncs"] == 0 for p in late)
    assert r["static_bytes"]["graphs_pool"] == max(
        p["activation_bytes"] for p in r["phases"] if p["kind"] == "step")
    assert r["graphs_pool_at_start"] <= r["static_bytes"]["graphs_pool"]
    assert "leaves out" in capsys.readouterr().out
    # flashinfer installed: taken where its MLA kernels plan (K2.5's widths), not at the mini
    # model's (64-wide latent)
    monkeypatch.setattr(rehearse, "flashinfer_imports", lambda: True)
    models, _ = plan.build(REPO / "configs" / "kimi-k2.5-text", None, 8, torch.bfloat16)
    pool = models.kv_pool(64, 4, torch.bfloat16, "meta")
    assert rehearse.cuda_backend(models, pool, [(1, 17), (8, 17)], 4) == "flashinfer"
    mini, _ = plan.build(REPO / "models" / "kimi-mini", None, 1, torch.bfloat16)
    pool = mini.kv_pool(16, 4, torch.bfloat16, "meta")
    assert rehearse.cuda_backend(mini, pool, [(1, 5)], 4) == "triton"
    monkeypatch.setattr(rehearse, "flashinfer_imports", lambda: False)
    assert rehearse.cuda_backend(models, pool, [(1, 17)], 4) == "triton"
