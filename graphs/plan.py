"""Memory and step cost of a real Kimi checkpoint at its real size, per tensor-parallel rank, with
no GPU: the models are built on the meta device from the checkpoint's own `config.json`.

    python -m graphs.plan --model configs/kimi-k2.5-text --tp 8 [--draft DIR] [--gpu-memory 141GB]
        [--max-model-len L] [--max-batch-size B] [--json FILE]
        [--cost --batch-sizes 1,8,32 --budgets 4,8,16,32 --context 4096 --gpus H200,RTX-PRO-6000
         --accept-len 3.7] [--tune --accept-lens 2:2.1,8:4.0 --sampled-accept-lens 2:1.4,8:1.7]

Memory: weight bytes per rank as stored (INT4 experts as words and scales, FP8 with its block
scales, the rest bf16), KV bytes per token (target latent cache and drafter context), the step
buffers and the step's peak live activations (measured on the meta device) for the largest
captured batch, and the KV pool the engine will allocate with these flags: the engine's own
rule (`engine.memory.size_kv_pool`: `--gpu-memory-utilization` of the GPU, less the weights, the
CUDA context and the engine's activation reserve), and whether one full context fits, with the
knob to turn if not.

Cost (`--cost`): the real step function (`engine.spec.spec_step`: draft, build, verify, decide,
commit; attention over live pages, experts over aligned blocks, as on a GPU) runs on the meta
device for each (batch size, budget) and for plain decoding, under `FlopCounterMode` and a byte
counter (bytes each op reads and writes; the kimi:: ops by their formulas, attention by the
`--context` tokens each row holds). Without `--draft` the tree rows cost the target's verify
alone (drafts appear from nowhere). Each row gives per-rank FLOPs (useful: what the tokens need;
executed: with the expert blocks' padding), bytes, all-reduce bytes, and a roofline time on each
`--gpus` entry: `max(FLOPs / peak, bytes / HBM) + all-reduces` (ring: `2 (W-1)/W` of the bytes
over the link, plus a fixed latency each), and the tree/AR speed-up a mean accepted length of
`--accept-len` tokens per step implies.

Tune (`--cost --tune`): the budget policy (`engine.policy`) these costs imply until one is
measured on a GPU (`graphs.profile --tune` there): for greedy and sampled steps at each batch
size, the budget of the most tokens per second on the first `--gpus` entry (0, plain decoding,
unless a tree wins by `engine.policy.MARGIN`), from its roofline step time and the mean tokens
a step emits at that budget (`--accept-lens`, `--sampled-accept-lens`: measured elsewhere, say
by `bench.spec` or `graphs.profile --tune` on a smaller pair). Written to
`configs/budgets-cuda.toml`, the CUDA default, unless `--policy-out` says where.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import weakref
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import engine.spec as spec
from engine.attention import PagedBackend
from engine.config import DraftConfig, EngineConfig, ModelConfig, int_list
from engine.dist import Group
from engine.kv_cache import KVPool, pages_needed
from engine.memory import (
    CUDA_RUNTIME_BYTES,
    GPU_MEMORY_UTILIZATION,
    KVMemoryError,
    activation_reserve,
    default_prefill_chunk,
    parse_size,
    size_kv_pool,
)
from engine.models.dflash import DFlashDrafter
from engine.models.kimi import KimiForCausalLM
from engine.models.layers import FP8, cast_parameters, checkpoint_tensors
from engine.policy import policy_path, write_tuned
from engine.runner import default_capture_sizes
from engine.spec import Models, StepBuffers, StepShape, spec_step
from ops.moe import moe_bytes, moe_flops
from ops.quant import fp8_linear_bytes


@dataclass(frozen=True)
class GPU:
    """Dense tensor-core peak (bf16 FLOP/s), HBM bandwidth, per-direction link bandwidth for the
    all-reduces, a fixed latency per all-reduce, and memory: vendors' data sheets."""

    flops: float
    hbm: float
    link: float
    latency: float
    memory: float


GPUS = {
    # HGX H200: 989 TFLOPS bf16 dense, 4.8 TB/s HBM3e, NVLink 4 900 GB/s (450 each way), 141 GB
    "H200": GPU(989e12, 4.8e12, 450e9, 15e-6, 141e9),
    # HGX B300: 2.25 PFLOPS bf16 dense, 8 TB/s HBM3e, NVLink 5 1.8 TB/s (900 each way), 288 GB
    "B300": GPU(2.25e15, 8.0e12, 900e9, 15e-6, 288e9),
    # RTX PRO 6000 Blackwell Server: about 500 TFLOPS bf16 dense, 1.6 TB/s GDDR7, PCIe 5 x16
    # (64 GB/s each way, no NVLink), 96 GB
    "RTX-PRO-6000": GPU(500e12, 1.6e12, 64e9, 30e-6, 96e9),
}
_ENGINE = EngineConfig.__pydantic_fields__  # the engine's defaults, which the plan follows


def parse_bytes(s: str) -> int:
    try:
        return parse_size(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


class CountingGroup(Group):
    """Rank 0 of a `world`-rank group on the meta device: collectives move nothing, they are
    only counted (calls and bytes per kind)."""

    def _collective(self, op: str, nbytes: int, fn: Any) -> None:
        self.comm.calls[op] += 1
        self.comm.bytes[op] += nbytes


def build(model: Path, draft: Path | None, tp: int, dtype: torch.dtype
          ) -> tuple[Models, CountingGroup | None]:
    """The target (and drafter) of rank 0 on the meta device, weights as stored."""
    group = CountingGroup(0, tp, "meta") if tp > 1 else None
    cfg = ModelConfig.from_dir(model)
    with torch.device("meta"):
        target = KimiForCausalLM(cfg, group)
        drafter = (DFlashDrafter(DraftConfig.from_dir(draft), cfg.hidden_size, group)
                   if draft is not None else None)
    for m in (target, drafter):
        if m is not None:
            cast_parameters(m, dtype)
            m.requires_grad_(False)
    return Models(target, drafter, tp=group, attention=PagedBackend()), group


def weight_bytes(models: Models) -> dict[str, int]:
    """This rank's weight bytes by how they are stored."""
    out: dict[str, int] = defaultdict(int)
    for name, m in (("target", models.target), ("drafter", models.drafter)):
        if m is None:
            continue
        for key, s in checkpoint_tensors(m).items():
            if s.dest is None:
                continue
            n = s.dest.numel() * s.dest.element_size()
            if key.endswith(("_packed", "_scale")) and ".experts." in key:
                out["int4_experts"] += n
            elif s.dest.dtype == FP8 or key.endswith("_scale_inv"):
                out["fp8"] += n
            else:
                out[str(s.dest.dtype).removeprefix("torch.")] += n
            out[name] += n
    return dict(out)


# ---- counters ------------------------------------------------------------------------------


def _bytes(x: Any) -> int:
    if isinstance(x, Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, list | tuple):
        return sum(_bytes(t) for t in x)
    return 0


class CostMode(TorchDispatchMode):
    """Bytes each op reads and writes, and the FLOPs and padding `FlopCounterMode` cannot see:
    views move nothing, gathers read only what they pick, scatters write only what they put;
    the kimi:: ops by their formulas, attention over `context` tokens a row."""

    def __init__(self, context: int):
        super().__init__()
        self.context = context
        self.bytes = 0
        self.attention_flops = 0
        self.padding_flops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        ns = func.namespace
        self.bytes += self._cost(ns, name, func, args, out)
        return out

    def _cost(self, ns: str, name: str, func: Any, args: Any, out: Any) -> int:
        if ns == "kimi":
            return self._kimi(name, args, out)
        if func.is_view:
            return 0
        if name in ("embedding", "index_select", "gather", "index", "take_along_dim"):
            return _bytes(out) + sum(_bytes(a) for a in args[1:])
        if name in ("index_put", "index_put_", "index_copy_", "index_copy", "scatter_",
                    "scatter", "scatter_add_", "scatter_add", "index_add_", "index_add"):
            return 2 * _bytes(args[-1]) + _bytes(args[1:-1])
        return sum(_bytes(a) for a in args) + _bytes(out)

    def _kimi(self, name: str, args: Any, out: Any) -> int:
        if name in ("moe_experts", "moe_experts_w4a16", "moe_experts_fp8"):
            x, idx = args[0], args[1]
            T, H, k = x.shape[0], x.shape[1], idx.shape[1]
            E, i2 = args[3].shape[:2]
            useful, executed = moe_flops(T, k, E, H, i2 // 2, 16)
            self.padding_flops += executed - useful
            kind = "int4" if name.endswith("w4a16") else {1: "fp8", 2: "bf16", 4: "fp32"}[
                args[3].element_size()]
            return moe_bytes(T, k, E, H, i2 // 2, weights=kind,
                             act_bytes=x.element_size())["total"]
        if name == "fp8_linear":
            x, w = args[0], args[1]
            return fp8_linear_bytes(math.prod(x.shape[:-1]), w.shape[0], w.shape[1],
                                    x.element_size())
        if name == "mla_prefix_attention":
            q_lat, q_pe, kv = args[0], args[1], args[2]
            bs, Q, heads, R = q_lat.shape
            self.attention_flops += 2 * bs * Q * heads * self.context * (R + q_pe.shape[-1] + R)
            return _bytes((q_lat, q_pe, out)) + bs * self.context * kv.shape[-1] * \
                kv.element_size()
        if name == "draft_context_attention":
            q, cache = args[0], args[1]
            bs, M, nh, hd = q.shape
            self.attention_flops += 4 * bs * M * nh * self.context * hd
            return _bytes((q, out)) + bs * self.context * cache.shape[-1] * cache.element_size()
        raise NotImplementedError(f"no cost formula for kimi::{name}")


class PeakMode(TorchDispatchMode):
    """The peak of live tensor bytes the ops create (what a step's activations need)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0

    def _free(self, n: int) -> None:
        self.live -= n

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for t in out if isinstance(out, list | tuple) else (out,):
                if isinstance(t, Tensor) and not any(t is a for a in args):
                    n = t.numel() * t.element_size()
                    self.live += n
                    weakref.finalize(t, self._free, n)
            self.peak = max(self.peak, self.live)
        return out


@contextmanager
def no_drafter(models: Models, vocab: int) -> Iterator[None]:
    """Without a drafter checkpoint, drafts appear from nowhere: the tree rows cost the
    target's verify (and build, decide, commit) alone."""
    if models.drafter is not None:
        yield
        return
    real = spec.draft

    def free(models: Models, pool: KVPool, buf: StepBuffers, shape: StepShape, ctx: Any
             ) -> Tensor:
        return buf.coins.new_empty(buf.anchor.shape[0], shape.draft_depth, vocab)

    spec.draft = free
    try:
        yield
    finally:
        spec.draft = real


def step_inputs(models: Models, shape: StepShape, bs: int, max_pages: int, page_size: int,
                dtype: torch.dtype) -> tuple[KVPool, StepBuffers]:
    pool = models.kv_pool(page_size, 1 + bs * max_pages, dtype, "meta")
    return pool, StepBuffers.allocate(bs, max_pages, shape, models.target, "meta")


def run_step(models: Models, shape: StepShape, bs: int, max_pages: int, page_size: int,
             dtype: torch.dtype, context: int) -> dict[str, Any]:
    """One step on the meta device: its FLOPs, bytes, all-reduce bytes and peak activations."""
    pool, buf = step_inputs(models, shape, bs, max_pages, page_size, dtype)
    if models.tp is not None:
        models.tp.comm.reset()
    cost, peak = CostMode(context), PeakMode()
    flops = FlopCounterMode(display=False)
    with no_drafter(models, models.target.cfg.vocab_size), flops, cost, peak:
        spec_step(models, pool, buf, shape)
    useful = flops.get_total_flops() + cost.attention_flops
    comm = models.tp.comm if models.tp is not None else None
    return {"flops": useful, "executed_flops": useful + cost.padding_flops, "bytes": cost.bytes,
            "allreduce_bytes": comm.bytes.get("all_reduce", 0) if comm else 0,
            "allreduce_calls": comm.calls.get("all_reduce", 0) if comm else 0,
            "collective_bytes": sum(comm.bytes.values()) if comm else 0,
            "collective_calls": sum(comm.calls.values()) if comm else 0,
            "peak_activation_bytes": peak.peak}


def shape_cost(a: argparse.Namespace, models: Models, shape: StepShape, bs: int,
               dtype: torch.dtype) -> dict[str, Any]:
    """`run_step` of `shape` at `bs` rows with page tables for `--max-model-len` tokens."""
    max_len = a.max_model_len or models.target.cfg.max_position_embeddings
    max_pages = pages_needed(max_len + shape.max_emit, a.page_size)
    return run_step(models, shape, bs, max_pages, a.page_size, dtype, a.context)


def roofline(row: dict[str, Any], gpu: GPU, tp: int) -> float:
    """Seconds: the slower of compute and memory, plus the collectives over the link."""
    ring = 2 * (tp - 1) / tp if tp > 1 else 0.0
    comm = row["collective_bytes"] * ring / gpu.link + row["collective_calls"] * gpu.latency
    return max(row["flops"] / gpu.flops, row["bytes"] / gpu.hbm) + comm


# ---- the command -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m graphs.plan", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, type=Path, help="a checkpoint (or config) dir")
    ap.add_argument("--draft", type=Path, help="a DFlash drafter (or its config) dir")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    ap.add_argument("--gpu-memory", type=parse_bytes, default=None,
                    help="memory of one GPU (default: the first --gpus entry's, 141GB for H200)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=GPU_MEMORY_UTILIZATION,
                    help="the engine's flag: the share of the GPU it may take "
                         f"(default: {GPU_MEMORY_UTILIZATION})")
    ap.add_argument("--reserve", type=parse_bytes, default=CUDA_RUNTIME_BYTES,
                    help="the CUDA context and NCCL's buffers, which a real engine reads as used "
                         f"memory after loading its weights (default: {CUDA_RUNTIME_BYTES:,} "
                         f"bytes)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="context limit (default: the model's max_position_embeddings)")
    ap.add_argument("--max-batch-size", type=int, default=_ENGINE["max_batch_size"].default,
                    help=f"the engine's flag (default: {_ENGINE['max_batch_size'].default})")
    ap.add_argument("--budget", type=int, default=16, help="tree budget of the captured steps")
    ap.add_argument("--page-size", type=int, default=_ENGINE["page_size"].default)
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--cost", action="store_true", help="the step cost table")
    ap.add_argument("--batch-sizes", type=int_list(1), default=[1, 8, 32])
    ap.add_argument("--budgets", type=int_list(1), default=[4, 8, 16, 32])
    ap.add_argument("--context", type=int, default=4096, help="committed tokens per row")
    ap.add_argument("--gpus", default="H200", help=f"comma-separated, of {', '.join(GPUS)}")
    ap.add_argument("--accept-len", type=float, default=3.7,
                    help="mean tokens a tree step emits, for the implied speed-up")
    ap.add_argument("--tune", action="store_true", help="with --cost: write the budget policy "
                    "these costs imply (the CUDA default until one is measured on a GPU)")
    ap.add_argument("--accept-lens", type=accept_lens, default=None,
                    help="for --tune, greedy: budget:mean tokens a step emits, e.g. 2:2.1,8:4.0")
    ap.add_argument("--sampled-accept-lens", type=accept_lens, default=None,
                    help="for --tune, the same for sampled steps")
    ap.add_argument("--policy-out", type=Path, default=None,
                    help="where --tune writes (default: configs/budgets-cuda.toml)")
    return ap


def memory(a: argparse.Namespace, models: Models, dtype: torch.dtype, gpu_memory: int
           ) -> dict[str, Any]:
    c, d = models.target.cfg, models.drafter
    weights = weight_bytes(models)
    per_rank = weights.get("target", 0) + weights.get("drafter", 0)
    kv_token = models.kv_bytes_per_token(dtype)
    max_len = a.max_model_len or c.max_position_embeddings
    block = d.c.block_size if d is not None else 8
    shape = StepShape("tree", a.budget, block, False)
    max_pages = pages_needed(max_len + shape.max_emit, a.page_size)
    bs = max(default_capture_sizes(a.max_batch_size))
    _, buf = step_inputs(models, shape, bs, max_pages, a.page_size, dtype)
    buffers = sum(_bytes(getattr(buf, f)) for f in buf.__dataclass_fields__)
    step = run_step(models, shape, bs, max_pages, a.page_size, dtype, a.context)
    workspace = step["peak_activation_bytes"]
    # The engine's rule with what it would read on the GPU: the weights and the CUDA context in
    # use, its activation reserve (estimated, as the engine does; the measured peak is checked
    # against it below).
    reserve = activation_reserve(c, tp=a.tp, max_batch_size=a.max_batch_size,
                                 step_rows=shape.num_nodes + block,
                                 prefill_tokens=default_prefill_chunk("cuda"),
                                 dtype_bytes=torch.finfo(dtype).bits // 8, cuda=True)
    used = per_rank + a.reserve
    budget = int(gpu_memory * a.gpu_memory_utilization)
    flag = f"--gpu-memory-utilization {a.gpu_memory_utilization} of {_gb(gpu_memory)}"
    try:
        size = size_kv_pool(budget_bytes=budget, used_bytes=used, reserve_bytes=reserve.total,
                            bytes_per_token=kv_token, page_size=a.page_size,
                            max_model_len=max_len, pages_per_context=max_pages,
                            max_batch_size=a.max_batch_size, budget_flag=flag, tp=a.tp)
        tokens, contexts, error = size.tokens, size.contexts, None
    except KVMemoryError as e:
        tokens, contexts, error = 0, 0, str(e)
    room = gpu_memory - used - reserve.total  # at full memory (utilization 1)
    fit_tokens = max(budget - used - reserve.total, 0) // kv_token
    fits = error is None
    if fits:
        knob = None
    elif room <= 0:
        knob = (f"the weights alone need {per_rank / 1e9:.1f} GB a rank: raise --tp, or lower "
                f"--max-batch-size (step buffers {buffers / 1e9:.2f} GB, activation reserve "
                f"{reserve.total / 1e9:.2f} GB)")
    else:
        knob = (f"{fit_tokens:,} tokens of KV fit at {flag}, fewer than one request at "
                f"--max-model-len {max_len:,}: lower --max-model-len, or raise --tp or "
                f"--gpu-memory-utilization")
    warning = None if workspace <= reserve.step else (
        f"the measured step activations ({_gb(workspace)}) exceed the engine's estimate "
        f"({_gb(reserve.step)}, engine.memory.step_activation_bytes): raise it")
    return {"weight_bytes_per_rank": per_rank, "weight_bytes_by_kind": weights,
            "kv_bytes_per_token": kv_token, "step_buffer_bytes": buffers,
            "step_workspace_bytes": workspace, "reserve_bytes": a.reserve,
            "activation_reserve_bytes": {"step": reserve.step, "prefill": reserve.prefill,
                                         "overhead": reserve.overhead},
            "gpu_memory_utilization": a.gpu_memory_utilization,
            "gpu_memory_bytes": gpu_memory, "kv_room_bytes": room, "kv_tokens": tokens,
            "kv_pool_bytes": (tokens // a.page_size + 1) * a.page_size * kv_token if fits
            else 0, "full_context_requests": contexts, "fits": fits, "knob": knob,
            "kv_error": error, "reserve_warning": warning, "max_model_len": max_len,
            "kv_pages_per_context": max_pages,
            "capture_batch_size": bs, "max_batch_size": a.max_batch_size, "budget": a.budget}


def _block(models: Models) -> int:
    return models.drafter.c.block_size if models.drafter is not None else 8


def costs(a: argparse.Namespace, models: Models, dtype: torch.dtype, gpus: list[str]
          ) -> list[dict[str, Any]]:
    rows, ar_time = [], {}
    for bs in a.batch_sizes:
        for mode, budget in [("ar", 0), *(("tree", b) for b in a.budgets)]:
            shape = StepShape(mode, max(budget, 1), _block(models), False)
            r = {"mode": mode, "batch_size": bs, "budget": budget,
                 **shape_cost(a, models, shape, bs, dtype)}
            r["seconds"] = {g: roofline(r, GPUS[g], a.tp) for g in gpus}
            if mode == "ar":
                ar_time[bs] = r["seconds"]
            else:
                r["speedup"] = {g: a.accept_len * ar_time[bs][g] / r["seconds"][g] for g in gpus}
            rows.append(r)
    return rows


def tune(a: argparse.Namespace, models: Models, dtype: torch.dtype, gpu: str
         ) -> list[dict[str, Any]]:
    """Estimated tokens per second of every (greedy/sampled, batch size, budget), budget 0
    included (one token a step), in `engine.policy.best_budgets`' rows."""
    from tqdm import tqdm

    todo = [(sample, bs, budget, acc)
            for sample, lens in ((False, a.accept_lens), (True, a.sampled_accept_lens))
            for bs in a.batch_sizes for budget, acc in [(0, 1.0), *sorted(lens.items())]]
    rows = []
    for sample, bs, budget, acc in tqdm(todo, desc="costing budgets"):
        shape = StepShape("tree", budget, _block(models), sample)
        seconds = roofline(shape_cost(a, models, shape, bs, dtype), GPUS[gpu], a.tp)
        rows.append({"sample": sample, "batch_size": bs, "budget": budget, "accept": acc,
                     "step_ms": seconds * 1e3, "tokens_per_s": acc * bs / seconds})
    return rows


def accept_lens(s: str) -> dict[int, float]:
    """An argparse type: `budget:tokens,...`, the mean tokens a tree step of each budget emits
    (bonus included: at least 1, at most budget + 1)."""
    out = {}
    for item in filter(None, (x.strip() for x in s.split(","))):
        try:
            k, v = item.split(":")
            budget, acc = int(k), float(v)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"expected budget:tokens pairs, got {item!r}") from e
        if budget < 1 or not 1.0 <= acc <= budget + 1:
            raise argparse.ArgumentTypeError(
                f"{item!r}: a budget >= 1 emits between 1 and budget + 1 tokens a step")
        out[budget] = acc
    if not out:
        raise argparse.ArgumentTypeError("expected budget:tokens pairs, got nothing")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.tune and not (a.cost and a.accept_lens and a.sampled_accept_lens and a.draft):
        ap.error("--tune needs --cost, --draft, --accept-lens and --sampled-accept-lens")
    gpus = [g.strip() for g in a.gpus.split(",") if g.strip()]
    bad = [g for g in gpus if g not in GPUS]
    if bad or a.tp < 1:
        print(f"error: unknown --gpus {bad} (known: {', '.join(GPUS)})" if bad else
              "error: --tp must be >= 1", file=sys.stderr)
        return 2
    dtype = getattr(torch, a.dtype)
    try:
        models, _ = build(a.model, a.draft, a.tp, dtype)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    gpu_memory = a.gpu_memory or int(GPUS[gpus[0]].memory)
    result: dict[str, Any] = {"model": str(a.model), "draft": str(a.draft) if a.draft else None,
                              "tp": a.tp, **memory(a, models, dtype, gpu_memory)}
    print(memory_table(result))
    if a.cost:
        result["context"] = a.context
        result["accept_len"] = a.accept_len
        result["rows"] = costs(a, models, dtype, gpus)
        result["note"] = None if a.draft else \
            "no --draft: tree rows cost the target's verify, build, decide and commit alone"
        print(cost_table(result, gpus))
    if a.tune:
        result.update(write_tuned(
            a.policy_out or policy_path("cuda"), tune(a, models, dtype, gpus[0]),
            source="estimated (roofline step time)", note=(
                f"estimated by `python -m graphs.plan --cost --tune`, not measured: "
                f"{a.model.name} with {a.draft.name} at --tp {a.tp} on {gpus[0]}, {a.dtype}, "
                f"context {a.context} tokens a row;\naccepted lengths given: greedy "
                f"{a.accept_lens}, sampled {a.sampled_accept_lens}. Measure on a GPU with "
                f"`python -m graphs.profile --tune`.")))
        print(f"wrote {result['policy']['path']}", file=sys.stderr)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {a.json}", file=sys.stderr)
    return 0


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def memory_table(r: dict[str, Any]) -> str:
    res = r["activation_reserve_bytes"]
    kinds = ", ".join(f"{k} {_gb(v)}" for k, v in r["weight_bytes_by_kind"].items()
                      if k not in ("target", "drafter"))
    lines = [
        f"{r['model']} at --tp {r['tp']}, per rank:",
        f"  weights            {_gb(r['weight_bytes_per_rank'])} ({kinds})",
        f"  KV per token       {r['kv_bytes_per_token']:,} bytes",
        f"  step buffers       {_gb(r['step_buffer_bytes'])} (batch {r['capture_batch_size']}, "
        f"budget {r['budget']}, {r['max_model_len']:,}-token page tables)",
        f"  step activations   {_gb(r['step_workspace_bytes'])} (peak, measured on meta)",
        f"  CUDA context       {_gb(r['reserve_bytes'])} (--reserve)",
        f"  engine's reserve   {_gb(sum(res.values()))} (step {_gb(res['step'])}, prefill "
        f"{_gb(res['prefill'])}, overhead {_gb(res['overhead'])}: engine.memory)",
        f"  KV room            {_gb(r['kv_room_bytes'])} of {_gb(r['gpu_memory_bytes'])} "
        f"at full memory",
        f"  engine's KV pool   {r['kv_tokens']:,} tokens ({_gb(r['kv_pool_bytes'])}), "
        f"{r['full_context_requests']} full {r['max_model_len']:,}-token contexts at "
        f"--gpu-memory-utilization {r['gpu_memory_utilization']}, --max-batch-size "
        f"{r['max_batch_size']}",
        f"  fits               {'yes' if r['fits'] else 'no: ' + r['knob']}",
        *([f"  warning            {r['reserve_warning']}"] if r["reserve_warning"] else []),
    ]
    return "\n".join(lines)


def cost_table(r: dict[str, Any], gpus: list[str]) -> str:
    head = (f"{'mode':>5} {'bs':>4} {'budget':>6} {'GFLOP':>9} {'exec GFLOP':>10} {'GB':>7} "
            f"{'allred MB':>9} " + " ".join(f"{g + ' ms':>14} {'x ar':>6}" for g in gpus))
    lines = [f"step cost per rank, context {r['context']} tokens a row, accepted length "
             f"{r['accept_len']} for the speed-ups" + (f" ({r['note']})" if r["note"] else ""),
             head]
    for x in r["rows"]:
        cells = " ".join(f"{x['seconds'][g] * 1e3:14.3f} {x.get('speedup', {}).get(g, 1.0):6.2f}"
                         for g in gpus)
        lines.append(f"{x['mode']:>5} {x['batch_size']:>4} {x['budget']:>6} "
                     f"{x['flops'] / 1e9:9.1f} {x['executed_flops'] / 1e9:10.1f} "
                     f"{x['bytes'] / 1e9:7.2f} {x['allreduce_bytes'] / 1e6:9.1f} {cells}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
