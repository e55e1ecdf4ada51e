"""Memory and step cost of a real Kimi checkpoint at its real size, per tensor-parallel rank, with
no GPU: the models are built on the meta device from the checkpoint's own `config.json`.

    python -m graphs.plan --model configs/kimi-k2.5-text --tp 8 [--draft DIR] [--gpu-memory 141GB]
        [--max-model-len L] [--max-batch-size B] [--prefill-chunk C] [--kv-pages P] [--json FILE]
        [--cost --batch-sizes 1,8,32 --budgets 4,8,16,32 --context 4096 --gpus H200,RTX-PRO-6000
         --accept-len 3.7] [--tune --accept-lens 2:2.1,8:4.0 --sampled-accept-lens 2:1.4,8:1.7]
        [--rehearse --prompt-lens 1024,32768,262144 --batch-sizes 1,8,64]

Memory: weight bytes per rank as stored (INT4 experts as words and scales, FP8 with its block
scales, the rest bf16), KV bytes per token (target latent cache and drafter context), the step
buffers of every captured batch size, activations measured on the meta device (`graphs.rehearse`:
every step the engine captures at its largest batch size, sampling variants included, and a
prompt of two prefill chunks, each checked against the engine's estimate for it), and the KV
pool the engine will allocate with its default flags: its own rule (`engine.memory.size_kv_pool`:
`--gpu-memory-utilization` of the GPU, less the weights, the CUDA context and the engine's
activation reserve, for the widest step of its budget policy), and whether one full context
fits, with the knob to turn if not.

Rehearsal (`--rehearse`): the engine's own code at these sizes (`graphs.rehearse`): the pool
sized and allocated, every captured step at each `--batch-sizes` (`--max-batch-size` raised to
the largest), then each prompt of `--prompt-lens` prefilled alone in the scheduler's chunks; per
phase the peak device bytes, activations, host syncs and kernel launches, and whether every
phase fits the GPU (exit 1 when one does not, or when not one full context fits).

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

Kimi's 60 MoE layers are one layer 60 times: the costs and the rehearsal run the first and the
last one or two of such a run and extrapolate, with the same counts and peaks as running every
layer (`graphs.repeat`; `--every-layer` runs them all).
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
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry

import engine.spec as spec
from engine.attention import PagedBackend, prefill_score_bytes
from engine.config import DraftConfig, EngineConfig, ModelConfig, int_list
from engine.dist import Group
from engine.heap import frozen_heap
from engine.kv_cache import KVPool, pages_needed
from engine.media import MediaConfig
from engine.memory import (
    CUDA_RUNTIME_BYTES,
    GPU_MEMORY_UTILIZATION,
    PoolSize,
    Reserve,
    default_prefill_chunk,
    engine_pool,
    parse_size,
)
from engine.models.dflash import DFlashDrafter
from engine.models.kimi import KimiForCausalLM
from engine.models.layers import FP8, cast_parameters, checkpoint_tensors
from engine.models.vision import KimiVision, VisionConfig
from engine.policy import Policy, policy_path, write_tuned
from engine.runner import StepGraphRunner
from engine.scheduler import RequestRejected
from engine.spec import Models, StepBuffers, StepShape, spec_step
from graphs.rehearse import (
    DEVICE,
    DeviceMode,
    Tally,
    cuda_backend,
    engine_shapes,
    late_kinds,
    launches,
    rehearse_prefill,
    rehearse_step,
    step_kinds,
)
from graphs.repeat import extrapolated
from ops.custom_ops import register_flop_formulas
from ops.moe import expected_aligned_rows, expert_block, moe_bytes, moe_flops
from ops.paged_grid import launch_shape, programs_with_work
from ops.quant import fp8_linear_bytes

register_flop_formulas()  # the kimi:: ops' FLOPs in every FlopCounterMode below


@dataclass(frozen=True)
class GPU:
    """Dense peaks of each unit an op's dtype runs on (FLOP/s: FP32 CUDA cores, TF32, bf16 and
    FP8 tensor cores), HBM bandwidth, L2-to-SM read bandwidth (what a kernel's tiles re-reading
    one operand pay), per-direction link bandwidth for the all-reduces, a fixed latency per
    all-reduce, and memory: vendors' data sheets (L2: published microbenchmarks, about)."""

    flops: float  # bf16 / fp16 tensor cores
    hbm: float
    link: float
    latency: float
    memory: float
    fp32: float
    tf32: float
    fp8: float
    l2: float

    def peak(self, unit: str) -> float:
        """FLOP/s of `unit` ("fp32", "tf32", "bf16", "fp8"; `op_unit`)."""
        return {"fp32": self.fp32, "tf32": self.tf32, "bf16": self.flops,
                "fp8": self.fp8}.get(unit, self.fp32)


GPUS = {
    # HGX H200: 989 TFLOPS bf16 dense (TF32 495, FP8 1,979, FP32 67), 4.8 TB/s HBM3e, NVLink 4
    # 900 GB/s (450 each way), 141 GB; L2 about 10 TB/s
    "H200": GPU(989e12, 4.8e12, 450e9, 15e-6, 141e9, 67e12, 495e12, 1979e12, 10e12),
    # HGX H100 SXM: the H200's compute and links, 3.35 TB/s HBM3, 80 GB
    "H100": GPU(989e12, 3.35e12, 450e9, 15e-6, 80e9, 67e12, 495e12, 1979e12, 10e12),
    # HGX B300: 2.25 PFLOPS bf16 dense (TF32 1.1 P, FP8 4.5 P, FP32 about 75 T), 8 TB/s HBM3e,
    # NVLink 5 1.8 TB/s (900 each way), 288 GB; L2 about 20 TB/s
    "B300": GPU(2.25e15, 8.0e12, 900e9, 15e-6, 288e9, 75e12, 1.1e15, 4.5e15, 20e12),
    # RTX PRO 6000 Blackwell Server: about 500 TFLOPS bf16 dense (TF32 about 125 T, FP8 about
    # 1 P, FP32 about 120 T), 1.6 TB/s GDDR7, PCIe 5 x16 (64 GB/s each way, no NVLink), 96 GB;
    # L2 about 6 TB/s
    "RTX-PRO-6000": GPU(500e12, 1.6e12, 64e9, 30e-6, 96e9, 120e12, 125e12, 1e15, 6e12),
}
# Ops that run as a matrix multiply (TF32 tensor cores take their fp32 operands when torch
# allows it: `torch.get_float32_matmul_precision()` other than "highest").
MATMULS = frozenset({"mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "linear",
                     "convolution", "_scaled_mm", "_scaled_dot_product_efficient_attention",
                     "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
                     "_flash_attention_forward", "_efficient_attention_forward"})


# Views torch does not mark as views (a matmul's output reshaped): metadata only, no kernel.
FREE_VIEWS = frozenset({"_unsafe_view"})


def op_unit(dtype: torch.dtype, matmul: bool) -> str:
    """The unit an op over `dtype` runs on: "fp8", "bf16" (16-bit floats), "tf32" (an fp32
    matmul torch lets use TF32), "fp32" (CUDA cores), or the dtype's name (no FLOPs)."""
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return "fp8"
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16"
    if dtype == torch.float32:
        return "tf32" if matmul and torch.get_float32_matmul_precision() != "highest" else "fp32"
    return str(dtype).removeprefix("torch.")


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
    """The target (and drafter, and a K2.5's vision tower, whole on every rank) of rank 0 on the
    meta device, weights as stored."""
    group = CountingGroup(0, tp, "meta") if tp > 1 else None
    cfg = ModelConfig.from_dir(model)
    vision = VisionConfig.from_dir(model)  # K2.5 ships its tower: its config says so
    with torch.device("meta"):
        target = KimiForCausalLM(cfg, group)
        drafter = (DFlashDrafter(DraftConfig.from_dir(draft), cfg.hidden_size, group)
                   if draft is not None else None)
        tower = KimiVision(vision) if vision is not None else None
    for m in (target, drafter, tower):
        if m is not None:
            cast_parameters(m, dtype)
            m.requires_grad_(False)
    # NOTE: as the engine on CUDA narrows a router the checkpoint stores in the model's 16-bit
    # dtype (Kimi's do; `KimiForCausalLM.from_dir`)
    target.narrow_routers(dtype, check=False)
    return Models(target, drafter, tp=group, attention=PagedBackend(), vision=tower), group


# The rehearsal answers an op it has seen from a cache of its shapes (`graphs.rehearse`), so a
# layer costs it little beside the scheduler, the drafter and the sampling: it samples only
# groups of repeated layers at least this long (`graphs.repeat.extrapolated`), as Kimi's 60.
REHEARSE_SAMPLED = 24

# target -> (its drafter's id, their `weight_bytes`)
_WEIGHTS: weakref.WeakKeyDictionary[torch.nn.Module, tuple[int, dict[str, int]]] = \
    weakref.WeakKeyDictionary()


def weight_bytes(models: Models) -> dict[str, int]:
    """This rank's weight bytes by how they are stored (counted once a pair)."""
    drafter, got = _WEIGHTS.get(models.target, (None, None))
    if got is None or drafter != id(models.drafter):
        got = _weight_bytes(models)
        _WEIGHTS[models.target] = (id(models.drafter), got)
    return dict(got)


def rank_weight_bytes(weights: dict[str, int]) -> int:
    """The bytes one rank holds of `weight_bytes`' models (its shards, and the vision tower
    whole)."""
    return sum(weights.get(k, 0) for k in ("target", "drafter", "vision"))


def _weight_bytes(models: Models) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for name, m in (("target", models.target), ("drafter", models.drafter),
                    ("vision", models.vision)):
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
    the kimi:: ops by their formulas, attention over `context` tokens a row. Also the kernel
    launches (`graphs.rehearse.launches`: a kimi:: op's kernels, counted from its
    implementation) and, per paged attention kernel, the programs of one launch that have work
    at `context` tokens a row (`ops.paged_grid.programs_with_work`: the Triton kernels split
    each row's live keys). Per op (its name and the unit its dtype runs on, `op_unit`): FLOPs,
    HBM bytes and the bytes its tiles read again from L2 (`rereads`: the paged kernels' row
    tiles each stream the row's keys, from their launch geometry), in `ops`."""

    def __init__(self, context: int, counter: FlopCounterMode | None = None):
        super().__init__()
        self.context = context
        # NOTE: entered before this mode, `counter` sees each op after it, decomposed where
        # its registry has no formula (`linear` into a matmul): an op's FLOPs are what it
        # counted meanwhile; without one, the registry's formula of the op itself
        self.counter = counter
        self.bytes = 0
        self.attention_flops = 0
        self.padding_flops = 0
        self.launches = 0
        self.programs: dict[str, int] = {"mla_prefix": 0, "draft_context": 0}
        self.ops: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
        self._flops = 0  # FLOPs of the op being costed beyond its FLOP formula's
        self._rereads = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        counted = self._counted()
        out = func(*args, **kwargs)
        name = func._overloadpacket.__name__
        ns = func.namespace
        self._flops = self._rereads = 0
        nbytes = self._cost(ns, name, func, args, out)
        self.bytes += nbytes
        n = launches(func, args, kwargs)
        self.launches += n
        if func.is_view or name in FREE_VIEWS:
            return out
        if self.counter is not None:
            flops = self._counted() - counted
        else:
            formula = flop_registry.get(func._overloadpacket)
            flops = formula(*args, **kwargs, out_val=out) if formula is not None else 0
        flops += self._flops
        first = next((t for t in (*args, out) if isinstance(t, Tensor)), None)
        unit = op_unit(first.dtype, name in MATMULS) if first is not None else "none"
        rec = self.ops[(name if ns == "aten" else f"{ns}.{name}", unit)]
        rec[0] += flops
        rec[1] += nbytes
        rec[2] += self._rereads
        rec[3] += n
        return out

    def _counted(self) -> int:
        return sum(self.counter.flop_counts["Global"].values()) if self.counter else 0

    def _cost(self, ns: str, name: str, func: Any, args: Any, out: Any) -> int:
        if ns == "kimi":
            return self._kimi(name, args, out, func)
        if func.is_view or name in FREE_VIEWS:
            return 0
        if name in ("embedding", "index_select", "gather", "index", "take_along_dim"):
            return _bytes(out) + sum(_bytes(a) for a in args[1:])
        if name in ("index_put", "index_put_", "index_copy_", "index_copy", "scatter_",
                    "scatter", "scatter_add_", "scatter_add", "index_add_", "index_add"):
            return 2 * _bytes(args[-1]) + _bytes(args[1:-1])
        return sum(_bytes(a) for a in args) + _bytes(out)

    def _kimi(self, name: str, args: Any, out: Any, func: Any) -> int:
        if name in ("moe_experts", "moe_experts_w4a16", "moe_experts_fp8"):
            x, idx = args[0], args[1]
            T, H, k = x.shape[0], x.shape[1], idx.shape[1]
            E, i2 = args[3].shape[:2]
            # the alignment block the kernels take: the op's, else theirs for T tokens
            names = [a.name for a in func._schema.arguments]

            def arg(name: str, default: Any) -> Any:
                at = names.index(name)
                return args[at] if len(args) > at else default

            block = expert_block(T, arg("block", 0))
            add = arg("add", None)  # the shared experts' rows the reduction adds: read once
            # the kernels run the blocks in use, padding included: their expected rows
            rows = expected_aligned_rows(T, k, E, block)
            useful, _ = moe_flops(T, k, E, H, i2 // 2, block)
            self._flops = (rows - T * k) * (useful // (T * k)) if T * k else 0
            self.padding_flops += self._flops
            kind = "int4" if name.endswith("w4a16") else {1: "fp8", 2: "bf16", 4: "fp32"}[
                args[3].element_size()]
            return moe_bytes(T, k, E, H, i2 // 2, weights=kind, act_bytes=x.element_size(),
                             block=block, rows=rows)["total"] + _bytes(add)
        if name == "fp8_linear":
            x, w = args[0], args[1]
            return fp8_linear_bytes(math.prod(x.shape[:-1]), w.shape[0], w.shape[1],
                                    x.element_size())
        if name == "mla_prefix_attention":
            q_lat, q_pe, kv, table, page_size = args[0], args[1], args[2], args[3], args[5]
            bs, Q, heads, R = q_lat.shape
            self.programs["mla_prefix"] = programs_with_work(
                bs, Q, heads, [self.context] * bs, table.shape[1], page_size, kv.dtype,
                kv_heads=1, dv=R)
            self._flops = 2 * bs * Q * heads * self.context * (R + q_pe.shape[-1] + R)
            self.attention_flops += self._flops
            keys = bs * self.context * kv.shape[-1] * kv.element_size()
            self._rereads = (self._row_tiles(bs, Q, heads, table.shape[1] * page_size, kv.dtype,
                                             1, R) - 1) * keys
            return _bytes((q_lat, q_pe, out)) + keys
        if name == "draft_context_attention":
            q, cache, table, page_size = args[0], args[1], args[2], args[4]
            bs, M, nh, hd = q.shape
            self.programs["draft_context"] = programs_with_work(
                bs, M, nh, [self.context] * bs, table.shape[1], page_size, cache.dtype,
                kv_heads=cache.shape[-1] // (2 * hd), dv=hd)
            self._flops = 4 * bs * M * nh * self.context * hd
            self.attention_flops += self._flops
            kv_heads = cache.shape[-1] // (2 * hd)
            keys = bs * self.context * cache.shape[-1] * cache.element_size()
            self._rereads = (self._row_tiles(bs, M, nh, table.shape[1] * page_size, cache.dtype,
                                             kv_heads, hd) - 1) * keys
            return _bytes((q, out)) + keys
        if name == "mha_prefill":
            # each row tile of the flash pass streams the keys it sees (every key, or the
            # causal square's up to its rows): what it reads beyond once comes from L2
            from ops.prefill import mha_tiles

            q, k_nope, k_pe, v, causal = args[0], args[1], args[2], args[3], args[5]
            B, T, H, _ = q.shape
            N = k_nope.shape[1]
            bm = mha_tiles(q.dtype, q.shape[-1], v.shape[-1])[0]
            tiles = -(-T // bm)
            seen = bm * tiles * (tiles + 1) // 2 if causal else N * tiles
            per_key = B * H * (k_nope.shape[-1] + k_pe.shape[-1] + v.shape[-1]) * \
                k_nope.element_size()
            self._rereads = max(seen - N, 0) * per_key
        # NOTE: any other kimi:: op reads its inputs and writes its outputs once (its FLOPs
        # are its registered formula's)
        return _bytes(args) + _bytes(out)

    @staticmethod
    def _row_tiles(bs: int, rows: int, heads: int, capacity: int, dtype: torch.dtype,
                   kv_heads: int, dv: int) -> int:
        """Row tiles per KV head of a paged kernel's launch (`ops.paged_grid.launch_shape`):
        each streams its rows' keys whole."""
        return launch_shape(bs, rows, heads, capacity, dtype, kv_heads=kv_heads, dv=dv,
                            num_splits=None, block_n=None).row_tiles


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
             dtype: torch.dtype, context: int, every_layer: bool = False) -> dict[str, Any]:
    """One step on the meta device: its FLOPs, bytes, all-reduce bytes and peak activations
    (the target's repeated layers costed from two of them unless `every_layer`:
    `graphs.repeat`)."""
    pool, buf = step_inputs(models, shape, bs, max_pages, page_size, dtype)

    def run() -> dict[str, Any]:
        if models.tp is not None:
            models.tp.comm.reset()
        flops = FlopCounterMode(display=False)
        cost, peak = CostMode(context, flops), PeakMode()
        with no_drafter(models, models.target.cfg.vocab_size), flops, cost, peak:
            spec_step(models, pool, buf, shape)
        return {**_counts(models, flops, cost), "peak_activation_bytes": peak.peak,
                "attention_programs": dict(cost.programs)}

    return extrapolated(models.target.model.layers, run, every_layer)


def _counts(models: Models, flops: FlopCounterMode, cost: CostMode) -> dict[str, Any]:
    """What a forward under `flops` and `cost` did: FLOPs (useful, and executed with the
    grouped experts' padding), bytes, launches and this rank's collectives since the last
    `comm.reset()`."""
    useful = flops.get_total_flops() + cost.attention_flops
    comm = models.tp.comm if models.tp is not None else None
    ops = [{"name": name, "dtype": unit, "flops": f, "bytes": b, "l2_bytes": r, "launches": n}
           for (name, unit), (f, b, r, n) in cost.ops.items()]
    return {"flops": useful, "executed_flops": useful + cost.padding_flops, "bytes": cost.bytes,
            "launches": cost.launches, "ops": ops,
            "allreduce_bytes": comm.bytes.get("all_reduce", 0) if comm else 0,
            "allreduce_calls": comm.calls.get("all_reduce", 0) if comm else 0,
            "collective_bytes": sum(comm.bytes.values()) if comm else 0,
            "collective_calls": sum(comm.calls.values()) if comm else 0}


def cuda_prefill_chunk(a: argparse.Namespace) -> int:
    """The most prompt tokens one engine step prefills on CUDA: `--prefill-chunk`, else CUDA's
    default."""
    return a.prefill_chunk or default_prefill_chunk("cuda")


def prefill_chunk(models: Models, pool: KVPool, pages: list[int], start: int, n: int) -> Any:
    """The engine's forward of `n` prompt tokens at position `start` of one prompt whose pages
    are `pages`, with the grouped expert pass: the first chunk's (`engine.spec.prefill`), or a
    later chunk's over the cached context (`engine.spec.prefill_chunk`)."""
    if start == 0:
        return spec.prefill(models, pool, [[0] * n], [pages], expert_pass=spec.aligned_pass)
    return spec.prefill_chunk(models, pool, [0] * n, start, pages, spec.aligned_pass)


def prefill_costs(a: argparse.Namespace, models: Models, dtype: torch.dtype, gpus: list[str]
                  ) -> list[dict[str, Any]]:
    """The cost of prefilling one prompt of each `--prompt-lens`, alone, in the engine's chunks
    of `--prefill-chunk` (default: CUDA's) with the grouped expert pass: the first chunk's
    causal forward, and each later chunk's absorbed forward over the context before it. A
    later chunk costs what it does at any context plus what its attention reads of that
    context, linear in it: measured at one and two chunks of context, summed over the chunks
    (the last one counted whole)."""
    c = cuda_prefill_chunk(a)
    turn = cached_turn(a, models)
    lens = sorted({*a.prompt_lens, *([sum(turn)] if turn else [])})
    longest = max(3 * c, *lens)
    pool = models.kv_pool(a.page_size, 1 + pages_needed(longest, a.page_size), dtype, "meta")
    pages = list(range(1, pool.num_pages))

    def chunk(start: int, n: int = c) -> dict[str, Any]:
        def run() -> dict[str, Any]:
            if models.tp is not None:
                models.tp.comm.reset()
            flops = FlopCounterMode(display=False)
            cost = CostMode(start, flops)
            with flops, cost:
                prefill_chunk(models, pool, pages, start, n)
            return _counts(models, flops, cost)

        return extrapolated(models.target.model.layers, run, a.every_layer)

    firsts = {n: chunk(0, n) for n in sorted({min(n, c) for n in lens})}
    one, two = (chunk(c), chunk(2 * c)) if max(lens) > c else ({}, {})
    rows = []
    for n in lens:
        k = -(-n // c)
        first = firsts[min(n, c)]
        # later chunks i = 1 .. k - 1 at context i * c: (k - 1) x one + (sum of i - 1) x slope
        steps = k * (k - 1) // 2 - (k - 1)
        r: dict[str, Any] = {"prompt_len": n, "chunk": c, "chunks": k}
        for key, v in first.items():
            if key == "ops":
                continue
            if k == 1:
                r[key] = v
                continue
            r[key] = v + (k - 1) * one[key] + steps * (two[key] - one[key])
        ops = [first["ops"], *(later_chunk_ops(one["ops"], two["ops"], i) for i in range(1, k))]
        _priced(a, models, r, ops, [(i * c, min(c, n - i * c)) for i in range(k)], gpus)
        rows.append(r)
    if turn:
        rows.append(cached_turn_cost(a, models, gpus, turn, chunk))
    return rows


def _turn(s: str) -> tuple[int, int]:
    """`--cached-turn`'s NEW,CACHED: a positive count of new tokens and a count of cached ones."""
    try:
        new, cached = (int(x) for x in s.split(","))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected NEW,CACHED (two integers), got {s!r}") from e
    if new < 1 or cached < 0:
        raise argparse.ArgumentTypeError(f"expected NEW >= 1 and CACHED >= 0, got {s!r}")
    return new, cached


def cached_turn(a: argparse.Namespace, models: Models) -> tuple[int, int] | None:
    """`--cached-turn NEW,CACHED` (CACHED page-aligned), when the context holds it."""
    if not a.cached_turn:
        return None
    new, cached = a.cached_turn
    cached -= cached % a.page_size
    max_len = a.max_model_len or models.target.cfg.max_position_embeddings
    return (new, cached) if new + cached <= max_len else None


def cached_turn_cost(a: argparse.Namespace, models: Models, gpus: list[str],
                     turn: tuple[int, int], chunk: Any) -> dict[str, Any]:
    """An agent's turn of NEW tokens whose first CACHED tokens the prefix cache holds: only
    the NEW tokens computed, in chunks over the cached context, each measured (the same prompt
    prefilled cold is a row of its own)."""
    new, cached = turn
    c, total = cuda_prefill_chunk(a), cached + new
    warm: dict[str, Any] = {"prompt_len": total, "cached": cached, "chunk": c,
                            "chunks": -(-new // c)}
    ops, spans = [], [(start, min(c, total - start)) for start in range(cached, total, c)]
    for start, n in spans:
        for key, v in chunk(start, n).items():
            if key == "ops":
                ops.append(v)
            else:
                warm[key] = warm.get(key, 0) + v
    _priced(a, models, warm, ops, spans, gpus)
    return warm


def _priced(a: argparse.Namespace, models: Models, row: dict[str, Any],
            chunks: list[list[dict[str, Any]]], spans: list[tuple[int, int]], gpus: list[str]
            ) -> None:
    """`row`'s `ops` (`chunked_ops` of its chunks' ops), its `seconds` on each of `gpus` (its
    ops one after another plus its collectives) and its `roofline_seconds` (`prefill_roofline`
    of its chunks, each `(start, tokens)` in `spans`)."""
    row["ops"] = chunked_ops(chunks, gpus)
    row["seconds"] = {g: sum(op["seconds"][g] for op in row["ops"])
                      + comm_seconds(row, GPUS[g], a.tp) for g in gpus}
    row["roofline_seconds"] = {g: prefill_roofline(models, spans, GPUS[g], a.tp) for g in gpus}


def linear_flops_per_token(models: Models) -> int:
    """This rank's matmul FLOPs per prefilled token as the engine shards the weights (what a
    rank holds whole, `q_a`, `kv_a`, the router and the drafter's fc among them, counted whole):
    every 2-D weight of the target twice, the routed experts' at `top-k / E` of the bank,
    the drafter's fc and its layers' key and value projections (the context it caches); not
    the embeddings or the LM head (one row a prompt), nor `kv_b_proj` (`prefill_roofline`
    up-projects the keys with it)."""
    from engine.models.layers import ExpertBank

    t, c = models.target, models.target.cfg
    flops = 2 * sum(p.numel() for n, p in t.named_parameters()
                    if p.dim() == 2 and not any(x in n for x in (
                        "embed_tokens", "lm_head", "kv_b_proj", ".experts.")))
    for m in t.modules():
        if isinstance(m, ExpertBank):
            flops += 2 * 3 * m.hidden * m.inter * c.num_experts_per_tok
    if models.drafter is not None:
        flops += 2 * sum(p.numel() for n, p in models.drafter.named_parameters()
                         if p.dim() == 2 and (n.startswith("fc.") or "k_proj" in n
                                              or "v_proj" in n))
    return flops


def prefill_roofline(models: Models, spans: list[tuple[int, int]], gpu: GPU, tp: int) -> float:
    """The least one rank can take to prefill chunks of a prompt (each `(start, n)` in `spans`:
    `n` tokens at position `start`) at the engine's sharding, one after another. A chunk: its
    `linear_flops_per_token` a token and the causal attention in the MHA form (qk over
    `qk_nope + qk_rope`, pv over `v_head_dim`, this rank's heads) with the whole context
    up-projected through `kv_b_proj`, all at bf16 peak; or the weights read once and the
    cached context's latent rows, at HBM; plus two ring all-reduces of its hidden states a
    layer over the link."""
    t, c = models.target, models.target.cfg
    heads, layers = t.model.layers[0].self_attn.num_heads, c.num_hidden_layers
    per_pair = 2 * (c.qk_nope_head_dim + c.qk_rope_head_dim) + 2 * c.v_head_dim
    per_token = linear_flops_per_token(models)
    w = weight_bytes(models)
    embed = t.model.embed_tokens.weight
    weights = w.get("target", 0) + w.get("drafter", 0) - embed.numel() * embed.element_size()
    kv_token = models.kv_bytes_per_token(embed.dtype)
    ring = 2 * (tp - 1) / tp if tp > 1 else 0.0
    total = 0.0
    for start, n in spans:
        pairs = n * start + n * (n + 1) // 2
        up = 2 * (start + n) * c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)
        flops = n * per_token + layers * (heads * per_pair * pairs + up)
        comm = 2 * layers * n * c.hidden_size * embed.element_size() * ring / gpu.link
        total += max(flops / gpu.flops, (weights + start * kv_token) / gpu.hbm) + comm
    return total


def shape_cost(a: argparse.Namespace, models: Models, shape: StepShape, bs: int,
               dtype: torch.dtype) -> dict[str, Any]:
    """`run_step` of `shape` at `bs` rows with page tables for `--max-model-len` tokens."""
    max_len = a.max_model_len or models.target.cfg.max_position_embeddings
    max_pages = pages_needed(max_len + shape.max_emit, a.page_size)
    return run_step(models, shape, bs, max_pages, a.page_size, dtype, a.context, a.every_layer)


def op_seconds(op: dict[str, Any], gpu: GPU) -> float:
    """One op's seconds (or one kind of op's, in one forward): the slowest of its FLOPs at the
    peak of the unit its dtype runs on, its HBM bytes, and what its tiles re-read from L2."""
    return max(op["flops"] / gpu.peak(op["dtype"]), op["bytes"] / gpu.hbm,
               op.get("l2_bytes", 0) / gpu.l2)


def comm_seconds(row: dict[str, Any], gpu: GPU, tp: int) -> float:
    """The collectives over the link: ring all-reduces (`2 (W-1)/W` of the bytes), plus a
    fixed latency each."""
    ring = 2 * (tp - 1) / tp if tp > 1 else 0.0
    return row["collective_bytes"] * ring / gpu.link + row["collective_calls"] * gpu.latency


def roofline(row: dict[str, Any], gpu: GPU, tp: int) -> float:
    """Seconds of one forward: each op at the slower of its compute (at its unit's peak) and
    its memory, one after another, plus the collectives over the link; without per-op counts,
    the slower of the totals' compute (at bf16 peak) and memory."""
    if "ops" in row:
        return sum(op_seconds(op, gpu) for op in row["ops"]) + comm_seconds(row, gpu, tp)
    return max(row["flops"] / gpu.flops, row["bytes"] / gpu.hbm) + comm_seconds(row, gpu, tp)


def chunked_ops(chunks: list[list[dict[str, Any]]], gpus: list[str]) -> list[dict[str, Any]]:
    """The ops of forwards run one after another (a prompt's chunks): per op (name and unit),
    its totals and its `seconds` on each of `gpus`, summed over the forwards it ran in, slowest
    first."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for ops in chunks:
        for op in ops:
            o = out.setdefault((op["name"], op["dtype"]), {
                "name": op["name"], "dtype": op["dtype"], "flops": 0, "bytes": 0,
                "l2_bytes": 0, "launches": 0, "seconds": dict.fromkeys(gpus, 0.0)})
            for key in ("flops", "bytes", "l2_bytes", "launches"):
                o[key] += op[key]
            for g in gpus:
                o["seconds"][g] += op_seconds(op, GPUS[g])
    first = gpus[0] if gpus else None
    return sorted(out.values(), key=lambda o: -o["seconds"][first] if first else 0)


def later_chunk_ops(one: list[dict[str, Any]], two: list[dict[str, Any]], i: int
                    ) -> list[dict[str, Any]]:
    """A later chunk's ops at `i` chunks of context, from those at one and two chunks (each
    op's counts linear in the context, as the chunk's attention is)."""
    at_two = {(op["name"], op["dtype"]): op for op in two}
    out = []
    for op in one:
        t = at_two.get((op["name"], op["dtype"]), op)
        out.append({**op, **{k: op[k] + (i - 1) * (t[k] - op[k])
                             for k in ("flops", "bytes", "l2_bytes", "launches")}})
    return out


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
    ap.add_argument("--budget", type=int, default=None,
                    help="tree budget of the captured steps (default: the engine's, the shipped "
                         "CUDA budget policy)")
    ap.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                    action="store_false", help="size the pool as the engine does without the "
                    "prefix cache: at most every batch slot at full context")
    ap.add_argument("--kv-pages", type=int, default=None,
                    help="the engine's flag: the KV pool's pages (default: sized from memory)")
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="the engine's flag: prompt tokens one engine step prefills (default: "
                         f"{default_prefill_chunk('cuda')}, CUDA's)")
    ap.add_argument("--page-size", type=int, default=_ENGINE["page_size"].default)
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--cost", action="store_true", help="the step cost table")
    ap.add_argument("--every-layer", action="store_true",
                    help="cost every layer (default: a run of identical layers from two of "
                         "them, which gives the same counts: graphs.repeat)")
    ap.add_argument("--batch-sizes", type=int_list(1), default=[1, 8, 32],
                    help="for --cost and --rehearse")
    ap.add_argument("--rehearse", action="store_true",
                    help="run the engine's own code on the meta device at these sizes: every "
                         "captured step at --batch-sizes, then each prompt of --prompt-lens "
                         "prefilled in chunks; per phase peak bytes, activations, host syncs "
                         "and launches; exit 1 when one does not fit")
    ap.add_argument("--prompt-lens", type=int_list(1), default=[1024, 32768],
                    help="for --rehearse: prompt lengths, each prefilled alone")
    ap.add_argument("--cached-turn", type=_turn, default=(2048, 30720), metavar="NEW,CACHED",
                    help="with --cost: an agent's turn of NEW tokens over CACHED ones the prefix "
                         "cache holds, beside the same prompt prefilled cold, when the context "
                         "holds it (default: 2048,30720)")
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


@dataclass
class Sizing:
    """The engine's KV pool with these flags on one GPU of `gpu_memory` bytes, by its own rule
    (`engine.memory.engine_pool`), and what it is sized from."""

    shape: StepShape  # the runner's
    budgets: Policy | None  # its budget policy (`engine.policy`)
    widest: StepShape  # the step that can emit the most: it sets the page tables' width
    max_len: int
    page_size: int
    max_pages: int  # a page table's width: a full context plus the widest step's span
    max_batch_size: int
    chunk: int  # prompt tokens one engine step prefills
    weights: dict[str, int]  # `weight_bytes`
    kv_token: int
    reserve: Reserve  # the engine's activation reserve, estimated
    used: int  # weights and the CUDA context
    budget: int
    flag: str  # where the budget comes from
    pool: PoolSize | None  # None: not one full context fits
    error: str | None

    @property
    def per_rank(self) -> int:
        return rank_weight_bytes(self.weights)


def sizing(a: argparse.Namespace, models: Models, dtype: torch.dtype, gpu_memory: int,
           max_batch_size: int) -> Sizing:
    """What `engine.llm.LLM` sizes on CUDA with these flags and `--max-batch-size
    max_batch_size`: the CUDA context (`--reserve`) and the weights in use, its activation
    reserve for the widest step and a prefill chunk, at most every slot at full context, or
    `--kv-pages`."""
    c = models.target.cfg
    shape, budgets, widest = engine_shapes(models, a.budget)
    max_len = a.max_model_len or c.max_position_embeddings
    max_pages = pages_needed(max_len + widest.max_emit, a.page_size)
    chunk = cuda_prefill_chunk(a)
    weights = weight_bytes(models)
    kv_token = models.kv_bytes_per_token(dtype)
    used = rank_weight_bytes(weights) + a.reserve
    budget = int(gpu_memory * a.gpu_memory_utilization)
    flag = f"--gpu-memory-utilization {a.gpu_memory_utilization} of {_gb(gpu_memory)}"
    reserve, pool, err = engine_pool(
        c, kv_pages=a.kv_pages, budget_bytes=budget, used_bytes=used, budget_flag=flag, tp=a.tp,
        max_batch_size=max_batch_size, step_rows=widest.num_nodes + shape.block_size,
        prefill_tokens=chunk, dtype_bytes=torch.finfo(dtype).bits // 8, cuda=True,
        prefill_score_bytes=prefill_score_bytes("auto", torch.device("cuda")),
        bytes_per_token=kv_token, page_size=a.page_size, max_model_len=max_len,
        pages_per_context=max_pages, prefix_caching=a.enable_prefix_caching,
        vision=models.vision.cfg if models.vision is not None else None,
        image_patches=MediaConfig.from_dir(a.model).max_patches)
    return Sizing(shape, budgets, widest, max_len, a.page_size, max_pages, max_batch_size, chunk,
                  weights, kv_token, reserve, used, budget, flag, pool, str(err) if err else None)


def engine_runner(models: Models, z: Sizing, num_pages: int, dtype: torch.dtype
                  ) -> StepGraphRunner:
    """The runner the engine builds on CUDA, over a KV pool of `num_pages` pages, on the meta
    device (`graphs.rehearse`)."""
    pool = models.kv_pool(z.page_size, num_pages, dtype, DEVICE)
    runner = StepGraphRunner(models, pool, z.shape, max_batch_size=z.max_batch_size,
                             max_pages=z.max_pages, budgets=z.budgets)
    # NOTE: the meta device cannot capture; the runner is built without graphs and told
    # afterwards, so that its captured shapes (`shapes_of`: every sampling variant) are the
    # ones CUDA captures. Nothing here loads, captures or replays.
    runner.use_graphs = True
    return runner


def buffer_bytes(runner: StepGraphRunner) -> int:
    """The runner's static step buffers, every captured size's."""
    return sum(_bytes(getattr(buf, f)) for buf in runner.buffers.values()
               for f in buf.__dataclass_fields__)


def memory(a: argparse.Namespace, models: Models, group: CountingGroup | None,
           dtype: torch.dtype, gpu_memory: int) -> dict[str, Any]:
    """The memory table: the engine's KV pool with its default flags, what it is sized from,
    and the activations its reserve is for, measured."""
    z = sizing(a, models, dtype, gpu_memory, a.max_batch_size)
    # Measured on the meta device: every step the engine captures at its largest batch size
    # (the graphs' pool holds the largest), and a prompt of two chunks (the first chunk's
    # naive forward, then a chunk over the cached prefix).
    prompt = min(2 * z.chunk, z.max_len - 1)
    pages = max(z.pool.num_pages if z.pool else 0, 1 + z.max_pages)
    runner = engine_runner(models, z, pages, dtype)
    bs = max(runner.capture_sizes)
    mode = DeviceMode(group)
    layers = models.target.model.layers
    with frozen_heap():
        steps = {name: extrapolated(layers, partial(rehearse_step, mode, runner, bs, s),
                                    a.every_layer, REHEARSE_SAMPLED).activation_bytes
                 for name, s in step_kinds(runner, bs)}
        prefill = extrapolated(layers, partial(
            rehearse_prefill, mode, runner, prompt_len=prompt, chunk=z.chunk, num_pages=pages,
            max_model_len=z.max_len), a.every_layer, REHEARSE_SAMPLED)[0].activation_bytes
    workspace = max(steps.values())
    fits = z.error is None
    room = gpu_memory - z.used - z.reserve.total  # at full memory (utilization 1)
    fit_tokens = max(z.budget - z.used - z.reserve.total, 0) // z.kv_token
    buffers = buffer_bytes(runner)
    if fits:
        knob = None
    elif room <= 0:
        knob = (f"the weights alone need {z.per_rank / 1e9:.1f} GB a rank: raise --tp, or "
                f"lower --max-batch-size (step buffers {buffers / 1e9:.2f} GB, activation "
                f"reserve {z.reserve.total / 1e9:.2f} GB)")
    else:
        knob = (f"{fit_tokens:,} tokens of KV fit at {z.flag}, fewer than one request at "
                f"--max-model-len {z.max_len:,}: lower --max-model-len, or raise --tp or "
                f"--gpu-memory-utilization")
    warnings = [f"the measured {what} activations ({_gb(got)}) exceed the engine's estimate "
                f"({_gb(want)}, engine.memory.{fn})" for what, got, want, fn in (
                    ("step", workspace, z.reserve.step, "step_activation_bytes"),
                    ("prefill chunk", prefill, z.reserve.prefill, "prefill_activation_bytes"))
                if got > want]
    return {"weight_bytes_per_rank": z.per_rank, "weight_bytes_by_kind": z.weights,
            "kv_bytes_per_token": z.kv_token, "step_buffer_bytes": buffers,
            "step_workspace_bytes": workspace, "step_workspace_by_kind": steps,
            "prefill_chunk": z.chunk, "prefill_activation_bytes": prefill,
            "reserve_bytes": a.reserve,
            "activation_reserve_bytes": {"step": z.reserve.step, "prefill": z.reserve.prefill,
                                         "image": z.reserve.image,
                                         "overhead": z.reserve.overhead},
            "gpu_memory_utilization": a.gpu_memory_utilization,
            "gpu_memory_bytes": gpu_memory, "kv_room_bytes": room,
            "kv_pages": z.pool.num_pages if z.pool else 0,
            "kv_tokens": z.pool.tokens if z.pool else 0,
            "kv_cache_tokens": z.pool.cache_tokens if z.pool else 0,
            "kv_pool_bytes": z.pool.pool_bytes if z.pool else 0,
            "full_context_requests": z.pool.contexts if z.pool else 0, "fits": fits,
            "knob": knob, "kv_error": z.error, "reserve_warnings": warnings,
            "max_model_len": z.max_len, "kv_pages_per_context": z.max_pages,
            "capture_batch_size": bs, "max_batch_size": a.max_batch_size,
            "budget": z.widest.budget}


def rehearsal(a: argparse.Namespace, models: Models, group: CountingGroup | None,
              dtype: torch.dtype, gpu_memory: int) -> dict[str, Any]:
    """`--rehearse` (`graphs.rehearse`): the engine with its default flags (`--max-batch-size`
    raised to the largest `--batch-sizes`) on one GPU of `gpu_memory` bytes: every captured
    step at each batch size, then each prompt of `--prompt-lens` prefilled alone (at most
    `--max-model-len - 1` tokens, the longest the engine admits). A phase's peak is what the
    allocator holds: the CUDA context, weights, KV pool, step buffers and the graphs' pool
    (the largest step's activations), plus a prefill's own activations and kernel workspaces;
    not the allocator's rounding and fragmentation or cuBLAS's workspaces, which the engine's
    fixed overhead (`engine.memory.CUDA_OVERHEAD_BYTES`) is for."""
    from tqdm import tqdm

    z = sizing(a, models, dtype, gpu_memory, max(a.max_batch_size, *a.batch_sizes))
    out: dict[str, Any] = {
        "fits": False, "error": z.error, "gpu_memory_bytes": gpu_memory,
        "gpu_memory_utilization": a.gpu_memory_utilization, "weight_bytes": z.per_rank,
        "weight_bytes_by_kind": z.weights, "kv_bytes_per_token": z.kv_token,
        "max_model_len": z.max_len, "max_batch_size": z.max_batch_size,
        "prefill_chunk": z.chunk, "kv_budget_room_bytes": z.budget - z.used - z.reserve.total,
        "kv_pages": z.pool.num_pages if z.pool else 0,
        "kv_tokens": z.pool.tokens if z.pool else 0, "phases": []}
    if z.pool is None:
        return out
    runner = engine_runner(models, z, z.pool.num_pages, dtype)
    mode = DeviceMode(group)
    sizes = sorted({runner.padded_size(b) for b in a.batch_sizes} | {max(runner.capture_sizes)})
    backend = cuda_backend(models, runner.pool, [
        (bs, s.num_nodes) for bs in runner.capture_sizes for s in runner.shapes_of(bs)],
        runner.max_pages)
    steps = [(bs, name, s, False) for bs in sizes for name, s in step_kinds(runner, bs)]
    steps += [(bs, name, s, True) for bs in sizes for name, s in late_kinds(runner, bs)]
    layers = models.target.model.layers

    def counted(run: Any) -> Any:
        return extrapolated(layers, run, a.every_layer, REHEARSE_SAMPLED)

    notes: list[str] = []
    rejected: list[str] = []  # prompts the scheduler refuses (the pool is too small for them)
    with frozen_heap():
        phases = [{**_phase(f"step {name}", "step", bs, None, None,
                            counted(partial(rehearse_step, mode, runner, bs, s))), "late": late}
                  for bs, name, s, late in tqdm(steps, desc="rehearsing steps")]
        # NOTE: one pool holds every graph, those captured while serving too (largest first at
        # start; a late one reuses the blocks the others leave free while it is captured)
        graphs = max(p["activation_bytes"] for p in phases)
        at_start = max(p["activation_bytes"] for p in phases if not p["late"])
        for want in a.prompt_lens:
            n = min(want, z.max_len - 1)
            if n < want:
                notes.append(f"--prompt-lens {want:,}: {n:,} tokens, the longest prompt the "
                             f"engine admits at --max-model-len {z.max_len:,}")
            try:
                tally, chunks = counted(partial(
                    rehearse_prefill, mode, runner, prompt_len=n, chunk=z.chunk,
                    num_pages=z.pool.num_pages, max_model_len=z.max_len, progress=True))
            except RequestRejected as e:
                rejected.append(f"a {n:,}-token prompt: {e}")
                continue
            phases.append(_phase(f"prefill {n}", "prefill", 1, n, chunks, tally))
    static = {"cuda_context": a.reserve, "weights": z.per_rank, "kv_pool": z.pool.pool_bytes,
              "step_buffers": buffer_bytes(runner), "graphs_pool": graphs}
    leaves_out = [
        "the allocator's rounding and fragmentation, cuBLAS's and NCCL's workspaces (the "
        "engine's fixed overhead, engine.memory.CUDA_OVERHEAD_BYTES, is for them)",
        "Triton's and the CUDA graphs' own host and device bookkeeping",
        "what a kernel allocates beside its outputs, except the experts' pair rows and the "
        "paged attention kernels' partials (graphs.rehearse.kernel_workspace)"]
    if backend == "flashinfer":
        from ops.attention_gpu import mla_workspace_bytes

        static["attention_workspace"] = mla_workspace_bytes(models.target.cfg.kv_lora_rank, 132)
        leaves_out.insert(0, "flashinfer's kernels: the engine would take flashinfer here; "
                             "its MLA prefix pass is rehearsed as the Triton kernel over the "
                             "same shapes, with its workspace (at an H200's 132 SMs) added")
    for p in phases:
        p["peak_bytes"] = sum(static.values()) + (p["activation_bytes"] if p["kind"] ==
                                                  "prefill" else 0)
    out.update(fits=not rejected and all(p["peak_bytes"] <= gpu_memory for p in phases),
               static_bytes=static, kv_contexts=z.pool.contexts,
               budget_policy=z.budgets is not None, phases=phases, notes=notes,
               rejected=rejected, attention=backend, graphs_pool_at_start=at_start,
               leaves_out=leaves_out)
    return out


def _phase(name: str, kind: str, bs: int, prompt_len: int | None, chunks: int | None,
           t: Tally) -> dict[str, Any]:
    return {"name": name, "kind": kind, "batch_size": bs, "prompt_len": prompt_len,
            "chunks": chunks, "peak_bytes": 0, "activation_bytes": t.activation_bytes,
            "workspace_bytes": t.workspace, "host_syncs": t.host_syncs,
            "readbacks": t.readbacks,
            "sync_ops": dict(t.syncs), "launches": t.launches, "collectives": t.collectives}


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
            r["ops"] = chunked_ops([r["ops"]], gpus)
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
        models, group = build(a.model, a.draft, a.tp, dtype)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    gpu_memory = a.gpu_memory or int(GPUS[gpus[0]].memory)
    result: dict[str, Any] = {"model": str(a.model), "draft": str(a.draft) if a.draft else None,
                              "tp": a.tp}
    if a.rehearse:
        result.update(rehearsal(a, models, group, dtype, gpu_memory))
        print(rehearsal_table(result))
        if result["error"]:
            print(f"error: {result['error']}", file=sys.stderr)
        _write_json(a.json, result)
        return 0 if result["fits"] else 1
    result.update(memory(a, models, group, dtype, gpu_memory))
    print(memory_table(result))
    if a.cost:
        result["context"] = a.context
        result["accept_len"] = a.accept_len
        result["rows"] = costs(a, models, dtype, gpus)
        result["prefill_rows"] = prefill_costs(a, models, dtype, gpus)
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
    _write_json(a.json, result)
    return 0


def _write_json(path: Path | None, result: dict[str, Any]) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}", file=sys.stderr)


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def memory_table(r: dict[str, Any]) -> str:
    res, steps = r["activation_reserve_bytes"], r["step_workspace_by_kind"]
    kinds = ", ".join(f"{k} {_gb(v)}" for k, v in r["weight_bytes_by_kind"].items()
                      if k not in ("target", "drafter", "vision"))
    if r["weight_bytes_by_kind"].get("vision"):
        kinds += f"; the vision tower {_gb(r['weight_bytes_by_kind']['vision'])} whole"
    lines = [
        f"{r['model']} at --tp {r['tp']}, per rank:",
        f"  weights            {_gb(r['weight_bytes_per_rank'])} ({kinds})",
        f"  KV per token       {r['kv_bytes_per_token']:,} bytes",
        f"  step buffers       {_gb(r['step_buffer_bytes'])} (every captured batch size up to "
        f"{r['capture_batch_size']}, {r['max_model_len']:,}-token page tables)",
        f"  step activations   {_gb(r['step_workspace_bytes'])} (measured: the largest of "
        f"{len(steps)} captured steps at batch {r['capture_batch_size']}, "
        f"{max(steps, key=steps.get)})",
        f"  prefill chunk      {_gb(r['prefill_activation_bytes'])} ({r['prefill_chunk']:,} "
        f"tokens, measured: the first chunk's forward and one over a cached prefix)",
        f"  CUDA context       {_gb(r['reserve_bytes'])} (--reserve)",
        f"  engine's reserve   {_gb(sum(res.values()))} (step {_gb(res['step'])}, prefill "
        f"{_gb(res['prefill'])}, overhead {_gb(res['overhead'])}"
        + (f", an image {_gb(res['image'])}" if res.get("image") else "") + ": engine.memory)",
        f"  KV room            {_gb(r['kv_room_bytes'])} of {_gb(r['gpu_memory_bytes'])} "
        f"at full memory",
        f"  engine's KV pool   {r['kv_tokens']:,} tokens ({_gb(r['kv_pool_bytes'])}), "
        f"{r['full_context_requests']} full {r['max_model_len']:,}-token contexts at "
        f"--gpu-memory-utilization {r['gpu_memory_utilization']}, --max-batch-size "
        f"{r['max_batch_size']}",
        f"  prefix cache room  {r['kv_cache_tokens']:,} tokens past every batch slot at full "
        f"context" + ("" if r["kv_cache_tokens"] else " (none: the batch's contexts take the "
                                                        "whole pool; cached prefixes live in "
                                                        "pages no request holds)"),
        f"  fits               {'yes' if r['fits'] else 'no: ' + r['knob']}",
        *(f"  warning            {w}" for w in r["reserve_warnings"]),
    ]
    return "\n".join(lines)


def rehearsal_table(r: dict[str, Any]) -> str:
    draft = f" with {r['draft']}" if r["draft"] else ""
    lines = [f"rehearsal of {r['model']}{draft} at --tp {r['tp']} on one "
             f"{_gb(r['gpu_memory_bytes'])} GPU, per rank (the engine's code on the meta "
             f"device, --max-batch-size {r['max_batch_size']}, --prefill-chunk "
             f"{r['prefill_chunk']:,}, --max-model-len {r['max_model_len']:,}):",
             f"  weights            {_gb(r['weight_bytes'])}"]
    if r["error"]:
        room = r["kv_budget_room_bytes"]
        why = (f"the weights, the CUDA context and the activation reserve exceed the budget by "
               f"{_gb(-room)}" if room <= 0 else f"{_gb(room)} left, less than one context")
        return "\n".join([*lines, f"  KV pool            none: {why} (the error below)"])
    st = r["static_bytes"]
    lines[-1] += f", CUDA context {_gb(st['cuda_context'])}"
    lines += [
        f"  KV pool            {r['kv_tokens']:,} tokens in {r['kv_pages']:,} pages "
        f"({_gb(st['kv_pool'])}), {r['kv_contexts']} full {r['max_model_len']:,}-token "
        f"contexts",
        f"  step buffers       {_gb(st['step_buffers'])}; graphs' pool {_gb(st['graphs_pool'])} "
        f"(the largest step's activations; {_gb(r['graphs_pool_at_start'])} for the steps "
        f"captured at start, the rest for those captured while serving: late)",
        f"  attention          {r['attention']} (what --attention auto takes on a CUDA GPU)",
        f"{'phase':<46} {'bs':>3} {'prompt':>7} {'chunks':>6} {'act MB':>9} {'peak GB':>8} "
        f"{'free GB':>8} {'syncs':>5} {'launches':>9}"]
    for p in r["phases"]:
        lines.append(
            f"{p['name']:<46} {p['batch_size']:>3} {p['prompt_len'] or '-':>7} "
            f"{p['chunks'] or '-':>6} {p['activation_bytes'] / 1e6:9,.1f} "
            f"{p['peak_bytes'] / 1e9:8.2f} {(r['gpu_memory_bytes'] - p['peak_bytes']) / 1e9:8.2f} "
            f"{p['host_syncs']:>5} {p['launches']:>9,}")
    syncs = sorted({op for p in r["phases"] for op in p["sync_ops"]})
    over = ("no: a phase needs more than the GPU holds (lower --max-batch-size or "
            "--prefill-chunk, or raise --tp)" if not r["rejected"] else
            "no: the engine refuses a prompt")
    lines += [f"  host syncs by op   {', '.join(syncs) or 'none'}",
              *(f"  leaves out         {n}" for n in r["leaves_out"]),
              *(f"  note               {n}" for n in r["notes"]),
              *(f"  refused            {n}" for n in r["rejected"]),
              f"  fits               {'yes' if r['fits'] else over}"]
    return "\n".join(lines)


def cost_table(r: dict[str, Any], gpus: list[str]) -> str:
    head = (f"{'mode':>5} {'bs':>4} {'budget':>6} {'GFLOP':>9} {'exec GFLOP':>10} {'GB':>7} "
            f"{'allred MB':>9} {'launches':>8} {'attn progs':>10} "
            + " ".join(f"{g + ' ms':>14} {'x ar':>6}" for g in gpus))
    lines = [f"step cost per rank, context {r['context']} tokens a row, accepted length "
             f"{r['accept_len']} for the speed-ups" + (f" ({r['note']})" if r["note"] else ""),
             "(attn progs: programs with work per launch, MLA prefix / drafter context)", head]
    for x in r["rows"]:
        cells = " ".join(f"{x['seconds'][g] * 1e3:14.3f} {x.get('speedup', {}).get(g, 1.0):6.2f}"
                         for g in gpus)
        progs = "{mla_prefix}/{draft_context}".format(**x["attention_programs"])
        lines.append(f"{x['mode']:>5} {x['batch_size']:>4} {x['budget']:>6} "
                     f"{x['flops'] / 1e9:9.1f} {x['executed_flops'] / 1e9:10.1f} "
                     f"{x['bytes'] / 1e9:7.2f} {x['allreduce_bytes'] / 1e6:9.1f} "
                     f"{x['launches']:>8,} {progs:>10} {cells}")
    pre = r.get("prefill_rows") or []
    if pre:
        lines += ["", f"prefill cost per rank, one prompt alone in chunks of {pre[0]['chunk']:,}",
                  f"{'prompt':>8} {'chunks':>6} {'TFLOP':>9} {'GB':>8} {'launches':>10} "
                  + " ".join(f"{g + ' ms':>12}" for g in gpus)]
        for x in pre:
            lines.append(f"{x['prompt_len']:>8,} {x['chunks']:>6} {x['flops'] / 1e12:9.1f} "
                         f"{x['bytes'] / 1e9:8.1f} {x['launches']:>10,} "
                         + " ".join(f"{x['seconds'][g] * 1e3:12.1f}" for g in gpus)
                         + (f"  an agent's turn: {x['cached']:,} tokens cached, "
                            f"{x['prompt_len'] - x['cached']:,} new" if "cached" in x else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
