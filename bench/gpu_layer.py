"""One Kimi-shape layer at its real size, one tensor-parallel rank's shard, prefilling a chunk
over a cached prefix on this GPU, timed against the cost model's figure for the same work.

    python -m bench.gpu_layer --out layer.json            # on a GPU: measured and modeled
    python -m bench.gpu_layer --model-only --out F.json   # anywhere: the cost model's figure

The layer is Kimi K2.5's (`--model`, default configs/kimi-k2.5-text) with one decoder layer,
a MoE one (MLA, the router and 384 INT4 experts, their `--tp` shard: 1.19 GB at tp 8), its
embeddings and LM head shards, random weights; `--chunk` tokens (default 4,096) prefill at
position `--prefix` (default 32,768) through the engine's own chunk forward
(`graphs.plan.prefill_chunk`: `engine.spec.prefill_chunk` with the grouped expert pass), over a
KV pool holding the prefix. The collectives are counted, not run (`graphs.plan.CountingGroup`):
what is timed is one rank's compute. The cost model's figure is `graphs.plan`'s for the same
chunk of the same one-layer model on the meta device: its ops one after another, each at the
slower of its FLOPs at its unit's peak, its HBM bytes and its L2 re-reads
(`graphs.plan.op_seconds`), on the `graphs.plan.GPUS` entry of this GPU (H100 or H200 by its
name; `--gpu` to choose). The report gives both, their ratio and the slowest ops modeled.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]


def layer_models(model: Path, tp: int, device: str, dtype: torch.dtype) -> Any:
    """Rank 0's shard of a one-layer (MoE) copy of `model`, on `device`: random weights on a
    GPU (normal at 0.02, INT4 words random, scales small), none on meta."""
    from engine.attention import PagedBackend
    from engine.config import ModelConfig
    from engine.models.kimi import KimiForCausalLM
    from engine.models.layers import cast_parameters
    from engine.spec import Models
    from graphs.plan import CountingGroup

    cfg = dataclasses.replace(ModelConfig.from_dir(model), num_hidden_layers=1,
                              first_k_dense_replace=0)
    group = CountingGroup(0, tp, device) if tp > 1 else None
    with torch.device(device):
        target = KimiForCausalLM(cfg, group)
    cast_parameters(target, dtype)
    target.requires_grad_(False)
    if device != "meta":
        gen = torch.Generator(device).manual_seed(0)
        for name, t in [*target.named_parameters(), *target.named_buffers()]:
            if name.endswith("_packed"):
                t.random_(-(1 << 31), (1 << 31) - 1, generator=gen)
            elif name.endswith(("_scale", "_scale_inv")):
                t.uniform_(0.002, 0.004, generator=gen)
            elif name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                t.fill_(1.0)
            elif t.is_floating_point() and name != "inv_freq" and "bias" not in name:
                t.normal_(0.0, 0.02, generator=gen)
            elif "bias" in name:
                t.zero_()
    # as the engine narrows a router its checkpoint stores in bf16 (Kimi's), and the planner's
    # build does
    target.narrow_routers(dtype, check=False)
    return Models(target, None, tp=group, attention=PagedBackend())


def _pool(models: Any, prefix: int, chunk: int, page_size: int, dtype: torch.dtype,
          device: str) -> tuple[Any, list[int]]:
    from engine.kv_cache import pages_needed

    n = pages_needed(prefix + chunk, page_size)
    pool = models.kv_pool(page_size, 1 + n, dtype, device)
    if device != "meta":
        pool.target.normal_(0.0, 0.5)
    return pool, list(range(1, 1 + n))


def modeled(model: Path, tp: int, prefix: int, chunk: int, page_size: int, gpu: str
            ) -> dict[str, Any]:
    """The cost model's seconds for the chunk on `gpu` (ops only; and with the all-reduces a
    real rank would make), and its slowest ops."""
    from torch.utils.flop_counter import FlopCounterMode

    from graphs.plan import GPUS, CostMode, _counts, comm_seconds, op_seconds, prefill_chunk

    dtype = torch.bfloat16
    models = layer_models(model, tp, "meta", dtype)
    pool, pages = _pool(models, prefix, chunk, page_size, dtype, "meta")
    flops = FlopCounterMode(display=False)
    cost = CostMode(prefix, flops)
    with flops, cost:
        prefill_chunk(models, pool, pages, prefix, chunk)
    row = _counts(models, flops, cost)
    g = GPUS[gpu]
    ops = sorted(({**op, "seconds": op_seconds(op, g)} for op in row["ops"]),
                 key=lambda op: -op["seconds"])
    seconds = sum(op["seconds"] for op in ops)
    return {"gpu": gpu, "seconds": seconds,
            "seconds_with_allreduce": seconds + comm_seconds(row, g, tp),
            "flops": row["flops"], "bytes": row["bytes"], "launches": row["launches"],
            "slowest_ops": ops[:8]}


def measured(model: Path, tp: int, prefix: int, chunk: int, page_size: int, reps: int
             ) -> dict[str, Any]:
    """Seconds of the chunk on this GPU: one warm-up (kernel compiles), then `reps` timed."""
    from graphs.plan import prefill_chunk

    dtype = torch.bfloat16
    models = layer_models(model, tp, "cuda", dtype)
    pool, pages = _pool(models, prefix, chunk, page_size, dtype, "cuda")
    with torch.no_grad():
        t0 = time.perf_counter()
        out = prefill_chunk(models, pool, pages, prefix, chunk)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            out = prefill_chunk(models, pool, pages, prefix, chunk)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    logits = out[0] if isinstance(out, tuple | list) else out
    finite = bool(torch.isfinite(logits.float()).all())
    return {"device": torch.cuda.get_device_name(), "first_seconds": first, "seconds": times,
            "finite": finite, "peak_bytes": torch.cuda.max_memory_allocated()}


def gpu_entry(name: str) -> str:
    """The `graphs.plan.GPUS` entry of a CUDA device name (H100 or H200; H200 otherwise)."""
    return "H100" if "H100" in name else "H200"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_layer",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "configs" / "kimi-k2.5-text")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=32768, help="cached tokens before the chunk")
    ap.add_argument("--chunk", type=int, default=4096, help="tokens the chunk prefills")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gpu", default=None, help="the graphs.plan GPUS entry (default: this "
                    "GPU's, H200 without one)")
    ap.add_argument("--model-only", action="store_true", help="the cost model's figure only")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    run = not a.model_only
    if run and not torch.cuda.is_available():
        ap.error("no CUDA device: pass --model-only for the cost model's figure")
    gpu = a.gpu or (gpu_entry(torch.cuda.get_device_name()) if run else "H200")
    report: dict[str, Any] = {"model": str(a.model), "tp": a.tp, "prefix": a.prefix,
                              "chunk": a.chunk, "layers": 1}
    report["modeled"] = modeled(a.model, a.tp, a.prefix, a.chunk, a.page_size, gpu)
    print(f"modeled on {gpu}: {report['modeled']['seconds'] * 1e3:.2f} ms "
          f"({report['modeled']['seconds_with_allreduce'] * 1e3:.2f} ms with the all-reduces)")
    ok = True
    if run:
        m = report["measured"] = measured(a.model, a.tp, a.prefix, a.chunk, a.page_size, a.reps)
        best = min(m["seconds"])
        report["measured_over_modeled"] = best / report["modeled"]["seconds"]
        ok = m["finite"] and math.isfinite(best)
        print(f"measured on {m['device']}: {best * 1e3:.2f} ms (best of {a.reps}; first "
              f"{m['first_seconds']:.1f} s), {report['measured_over_modeled']:.2f}x the model; "
              f"logits {'finite' if m['finite'] else 'NOT FINITE'}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))  # NOTE: the GPU check keeps stdout, not the file
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
