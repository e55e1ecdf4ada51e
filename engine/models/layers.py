"""Layers shared by the target and the drafter, sharded from construction.

Every layer that splits takes the tensor-parallel group (`engine.dist.Group`, or None for one
process) when it is built and holds only its `1 / world` piece; with no group it is the plain
layer. Each layer also says which checkpoint tensors it holds (`stored_tensors`): the whole
stored shape, the dimension split across ranks, and the parameter view this rank's piece goes
into. `checkpoint_tensors(model)` collects them, so the module tree is the list of tensors a
checkpoint must have and the loader (`engine.weights`) reads only each rank's piece.

Split rules (Megatron's): column-parallel linears split output features (weight rows) and keep
their output split; row-parallel linears split input features (weight columns), so each rank's
output is a partial sum, all-reduced by the layer (or by its caller, once for several). The
embedding and the LM head split the vocabulary.

Quantized checkpoints stay as stored: FP8 block linears keep their float8_e4m3fn weight and
fp32 `weight_scale_inv` (`Fp8Linear`), routed experts keep INT4 words and bf16 group scales or
FP8 blocks (`ExpertBank`), and each call dequantizes what it needs (`ops.custom_ops` on the
static-shape path, Triton kernels on CUDA). Where a rank's piece would cut a scale block (or an
INT4 group) apart, that layer holds plain weights instead, dequantized at load.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import ops.custom_ops  # noqa: F401 - registers the kimi:: ops the quantized layers call
from engine.dist import Group, world_of
from ops.moe import (
    dequant_experts_fp8,
    dequant_experts_int4,
    experts_dense,
    experts_indexed,
    experts_sparse,
    experts_sparse_by,
    pick_experts,
)
from ops.norm import add_rms_norm, rms_norm

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Stored:
    """One checkpoint tensor as this rank holds it: `shape` is the whole stored shape, `dim` the
    dimension split across `world` ranks (None: every rank holds all of it), `dest` the tensor
    this rank's piece is loaded into (a view of a parameter or buffer). With `dest` None the
    tensor is only checked: it must hold exactly `value` (an INT4 linear's `weight_shape`)."""

    shape: tuple[int, ...]
    dim: int | None
    dest: Tensor | None
    rank: int = 0
    world: int = 1
    value: tuple[int, ...] | None = None

    def piece(self, src: Any) -> Tensor:
        """This rank's piece of `src` (a safetensors slice or a tensor of `shape`), reading only
        that piece from a slice."""
        if self.dim is None or self.world == 1:
            return src[:]
        n = self.shape[self.dim] // self.world
        part = slice(self.rank * n, (self.rank + 1) * n)
        return src[part] if self.dim == 0 else src[:, part]


def _stored(dest: Tensor, dim: int | None, tp: Group | None) -> Stored:
    shape = list(dest.shape)
    if dim is not None:
        shape[dim] *= world_of(tp)
    return Stored(tuple(shape), dim, dest, tp.rank if tp else 0, world_of(tp))


def checkpoint_tensors(model: nn.Module) -> dict[str, Stored]:
    """Every checkpoint tensor `model` holds, by checkpoint name, in module order. Layers with a
    `stored_tensors()` method speak for their own parameters; any other module's parameters and
    persistent buffers are whole on every rank under their own names."""
    out: dict[str, Stored] = {}
    for prefix, m in model.named_modules():
        p = f"{prefix}." if prefix else ""
        own = getattr(m, "stored_tensors", None)
        if own is not None:
            out.update({p + k: v for k, v in own().items()})
            continue
        buffers = ((n, b) for n, b in m._buffers.items()
                   if b is not None and n not in m._non_persistent_buffers_set)
        for name, t in chain(m.named_parameters(recurse=False), buffers):
            out[p + name] = Stored(tuple(t.shape), None, t)
    return out


def param_bytes(model: nn.Module) -> tuple[int, int]:
    """`(all, replicated)` bytes of the checkpoint tensors this rank holds."""
    total = rep = 0
    for s in checkpoint_tensors(model).values():
        if s.dest is None:
            continue
        n = s.dest.numel() * s.dest.element_size()
        total += n
        rep += n if s.dim is None or s.world == 1 else 0
    return total, rep


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == self.weight.dtype == torch.float32:
            # The same math as below in one op (fewer launches per step).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        if x.device.type != "cpu":
            # one kernel on a GPU (and costed as one on the meta device), not six
            return torch.ops.kimi.rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)

    def add(self, x: Tensor, delta: Tensor | None) -> tuple[Tensor, Tensor]:
        """`(x + delta, self(x + delta))`: a decoder layer's residual add and the norm that reads
        its result, one kernel on a GPU (`kimi::add_rms_norm`; the twin's ops on the CPU). With
        `delta` None, `(x, self(x))`."""
        if delta is None:
            return x, self(x)
        if x.dtype == self.weight.dtype == torch.float32:
            s = x + delta
            return s, self(s)
        if x.device.type != "cpu":
            return torch.ops.kimi.add_rms_norm(x, delta, self.weight, self.eps)
        return add_rms_norm(x, delta, self.weight, self.eps)


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Floating-point parameters to `dtype`, except in modules marked `keep_fp32` (the MoE
    router); buffers keep the dtype they were built with (fp32 router biases and rotary
    frequencies, checkpoint scales as stored)."""
    done: dict[int, nn.Parameter] = {}  # NOTE: a parameter two modules share stays shared
    for m in model.modules():
        if getattr(m, "keep_fp32", False):
            continue
        for name, p in m._parameters.items():
            if p is not None and p.is_floating_point():
                if id(p) not in done:
                    done[id(p)] = nn.Parameter(p.detach().to(dtype), p.requires_grad)
                m._parameters[name] = done[id(p)]


def linear(in_features: int, out_features: int, tp: Group | None = None, split: int | None = None,
           reduce: bool = True, fp8: tuple[int, int] | None = None) -> nn.Module:
    """A bias-free linear: replicated (`split` None), column-parallel (0) or row-parallel (1,
    all-reduced when `reduce`); with `fp8` (the checkpoint's weight block), kept FP8 as stored
    when this rank's piece is made of whole blocks."""
    w = world_of(tp) if split is not None else 1
    if fp8 and (w == 1 or (out_features // w if split == 0 else in_features // w)
                % fp8[split or 0] == 0):
        return Fp8Linear(in_features, out_features, tp, split, reduce, fp8)
    if split == 0:
        return ColumnParallelLinear(in_features, out_features, tp)
    if split == 1:
        return RowParallelLinear(in_features, out_features, tp, reduce)
    return nn.Linear(in_features, out_features, bias=False)


class Fp8Linear(nn.Module):
    """A linear whose weight stays float8_e4m3fn with an fp32 `weight_scale_inv` per `block`
    (`W = w * scale_inv` blockwise), dequantized per call (`kimi::fp8_linear`), split like the
    column (`split` 0) and row (1) parallel linears."""

    def __init__(self, in_features: int, out_features: int, tp: Group | None, split: int | None,
                 reduce: bool, block: tuple[int, int]):
        super().__init__()
        self.tp = tp if split is not None else None
        self.split, self.reduce, self.block = split, reduce, block
        w = world_of(self.tp)
        o, i = (out_features // (w if split == 0 else 1), in_features // (w if split == 1 else 1))
        self.register_buffer("weight", torch.empty(o, i, dtype=FP8))
        self.register_buffer("weight_scale_inv", torch.empty(-(-o // block[0]),
                                                             -(-i // block[1])))

    def stored_tensors(self) -> dict[str, Stored]:
        return {"weight": _stored(self.weight, self.split, self.tp),
                "weight_scale_inv": _stored(self.weight_scale_inv, self.split, self.tp)}

    def forward(self, x: Tensor) -> Tensor:
        y = torch.ops.kimi.fp8_linear(x, self.weight, self.weight_scale_inv, *self.block)
        return self.tp.all_reduce(y) if self.split == 1 and self.reduce and self.tp else y


class ColumnParallelLinear(nn.Linear):
    """`x W^T` with the output features split across ranks; the output stays split."""

    def __init__(self, in_features: int, out_features: int, tp: Group | None = None):
        super().__init__(in_features, out_features // world_of(tp), bias=False)
        self.tp = tp

    def stored_tensors(self) -> dict[str, Stored]:
        return {"weight": _stored(self.weight, 0, self.tp)}


class RowParallelLinear(nn.Linear):
    """`x W^T` with the input features split across ranks: each rank's output is a partial
    sum, all-reduced here when `reduce` (else by the caller, once for several)."""

    def __init__(self, in_features: int, out_features: int, tp: Group | None = None,
                 reduce: bool = True):
        super().__init__(in_features // world_of(tp), out_features, bias=False)
        self.tp, self.reduce = tp, reduce

    def stored_tensors(self) -> dict[str, Stored]:
        return {"weight": _stored(self.weight, 1, self.tp)}

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight)
        return self.tp.all_reduce(y) if self.reduce and self.tp is not None else y


class VocabParallelEmbedding(nn.Module):
    """Rank `r` holds rows `r * V / W ..`; other ids look up zeros, and the all-reduce sums the
    one real row with zeros (exact)."""

    def __init__(self, vocab: int, hidden: int, tp: Group | None = None):
        super().__init__()
        self.tp = tp
        self.n = vocab // world_of(tp)
        self.start = tp.rank * self.n if tp else 0
        self.weight = nn.Parameter(torch.empty(self.n, hidden))

    def stored_tensors(self) -> dict[str, Stored]:
        return {"weight": _stored(self.weight, 0, self.tp)}

    def forward(self, ids: Tensor) -> Tensor:
        if self.tp is None:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.n)
        e = F.embedding(local.clamp(0, self.n - 1), self.weight)
        return self.tp.all_reduce(e.masked_fill(~mine[..., None], 0))


class ParallelLMHead(ColumnParallelLinear):
    """Each rank's vocabulary slice of the logits, all-gathered into the full `[..., V]`."""

    def forward(self, h: Tensor) -> Tensor:
        y = F.linear(h, self.weight)
        return y if self.tp is None else self.tp.all_gather_last(y)


class MLP(nn.Module):
    """SwiGLU `down(silu(gate(x)) * up(x))`, intermediate dimension split across ranks."""

    def __init__(self, hidden: int, inter: int, tp: Group | None = None, reduce: bool = True,
                 fp8: tuple[int, int] | None = None):
        super().__init__()
        self.gate_proj = linear(hidden, inter, tp, 0, fp8=fp8)
        self.up_proj = linear(hidden, inter, tp, 0, fp8=fp8)
        self.down_proj = linear(inter, hidden, tp, 1, reduce, fp8)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ExpertBank(nn.Module):
    """`E` SwiGLU experts stacked for dispatch, `I` this rank's share of the intermediate
    dimension; the checkpoint names each expert's linears (`{e}.gate_proj.weight`, ...) and they
    load into views of the stacks. Kept as stored (`fmt`):

    - plain: `w13 [E, 2I, H]` (each expert's gate rows, then its up rows), `w2 [E, H, I]`;
    - "int4" (pack-quantized, `group` values a scale): `w13_packed [E, 2I, H/8]` int32 with
      `w13_scale [E, 2I, H/group]`, and `w2_packed [E, H, I/8]` with `w2_scale [E, H, I/group]`;
    - "fp8" (`block` weight blocks): `w13`, `w2` float8_e4m3fn with `w13_scale_inv [E, 2I/b0,
      H/b1]` and `w2_scale_inv [E, H/b0, I/b1]` fp32.

    The output is this rank's partial sum (the caller all-reduces)."""

    def __init__(self, experts: int, hidden: int, inter: int, tp: Group | None = None,
                 fmt: str | None = None, group: int = 32, block: tuple[int, int] = (128, 128)):
        super().__init__()
        self.tp, self.group, self.block = tp, group, block
        self.num_experts, self.hidden, self.inter = experts, hidden, inter // world_of(tp)
        E, H, i = experts, hidden, self.inter
        # NOTE: a rank's piece must hold whole INT4 groups / FP8 blocks (and FP8's gate and up
        # rows must not share a block); otherwise this bank is plain, dequantized at load.
        if (fmt == "int4" and world_of(tp) > 1 and i % group) or (fmt == "fp8" and i % block[0]):
            fmt = None
        self.fmt = fmt
        shapes = {"w13": (E, 2 * i, H), "w2": (E, H, i)}
        for name, (e, rows, cols) in shapes.items():
            if fmt == "int4":
                self.register_buffer(f"{name}_packed", torch.empty(
                    e, rows, -(-cols // 8), dtype=torch.int32))
                self.register_buffer(f"{name}_scale", torch.empty(
                    e, rows, -(-cols // group), dtype=torch.bfloat16))
            elif fmt == "fp8":
                self.register_buffer(name, torch.empty(e, rows, cols, dtype=FP8))
                self.register_buffer(f"{name}_scale_inv", torch.empty(
                    e, -(-rows // block[0]), -(-cols // block[1])))
            else:
                setattr(self, name, nn.Parameter(torch.empty(e, rows, cols)))

    def stored_tensors(self) -> dict[str, Stored]:
        w, i, H = world_of(self.tp), self.inter, self.hidden
        suffixes = {"int4": ("_packed", "_scale"), "fp8": ("", "_scale_inv")}.get(self.fmt, ("",))
        # NOTE: ~200k entries at Kimi's size: each is an int index into a stack already cut to
        # the projection (a slice per expert costs twice as much), beside its projection's
        # first expert's entry (the shape, split and rank every expert shares).
        views = []
        for suffix in suffixes:
            w13, w2 = getattr(self, "w13" + suffix), getattr(self, "w2" + suffix)
            # NOTE: FP8 scales hold a row per block of weight rows: the gate's end where the
            # up's begin because I is a whole number of blocks.
            j = i // self.block[0] if suffix == "_scale_inv" else i
            for proj, stack, dim in (("gate", w13[:, :j], 0), ("up", w13[:, j:], 0),
                                     ("down", w2, 1)):
                views.append((f".{proj}_proj.weight{suffix}", stack,
                              _stored(stack[0], dim, self.tp)))
        # INT4 linears' `weight_shape`s: only checked, the same for every expert
        shapes = [(f".{proj}_proj.weight_shape", Stored((2,), None, None, value=shape))
                  for proj, shape in (("gate", (i * w, H)), ("up", (i * w, H)),
                                      ("down", (H, i * w)))] if self.fmt == "int4" else []
        out = {}
        for e in range(self.num_experts):
            for name, stack, s in views:
                out[f"{e}{name}"] = Stored(s.shape, s.dim, stack[e], s.rank, s.world)
            for name, s in shapes:
                out[f"{e}{name}"] = s
        return out

    def weights(self, experts: Tensor | int | None, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """`(w13 [C, 2I, H], w2 [C, H, I])` of `experts [C]` (an int: that one, `C = 1`; None:
        all) as `dtype` floats, dequantized on the spot from a quantized bank (only those
        experts; `ops.moe.dequant_experts_*`). A plain bank gives its own dtype."""
        if self.fmt == "int4":
            return (dequant_experts_int4(self.w13_packed, self.w13_scale, experts, self.hidden,
                                         self.group, dtype),
                    dequant_experts_int4(self.w2_packed, self.w2_scale, experts, self.inter,
                                         self.group, dtype))
        if self.fmt == "fp8":
            return (dequant_experts_fp8(self.w13, self.w13_scale_inv, experts, self.block, dtype),
                    dequant_experts_fp8(self.w2, self.w2_scale_inv, experts, self.block, dtype))
        return pick_experts(self.w13, experts), pick_experts(self.w2, experts)

    def forward(self, x: Tensor, idx: Tensor, w: Tensor, mode: str = "dense",
                add: Tensor | None = None) -> Tensor:
        """`x [T, H]`, routing `idx / w [T, k]` -> `[T, H]`, plus `add [T, H]` when given (the
        shared experts' output: the aligned ops add it in their last kernel). `mode`: "sparse"
        sends each token through its chosen experts only (eager only: data-dependent shapes);
        "dense" runs every expert on every token (fixed shapes, cheap for a small bank; a
        quantized bank is dequantized whole); "aligned" runs only the chosen experts at fixed
        shapes (`ops.moe.moe_align_block_size`; Triton on CUDA), a quantized bank dequantizing
        only those; "indexed" runs only the chosen experts at fixed shapes with their weights
        read in place (`ops.moe.experts_indexed`: a plain bank; what a compiled CPU step runs).
        The caller chooses (`engine.runner`, `engine.cpu`)."""
        if mode == "aligned" and self.fmt == "int4":
            return torch.ops.kimi.moe_experts_w4a16(x, idx, w, self.w13_packed, self.w13_scale,
                                                   self.w2_packed, self.w2_scale, self.group,
                                                   add=add)
        if mode == "aligned" and self.fmt == "fp8":
            return torch.ops.kimi.moe_experts_fp8(x, idx, w, self.w13, self.w13_scale_inv,
                                                 self.w2, self.w2_scale_inv, *self.block, add=add)
        if mode == "aligned":
            return torch.ops.kimi.moe_experts(x, idx, w, self.w13, self.w2, add=add)
        y = self._unfused(x, idx, w, mode)
        return y if add is None else y + add

    def _unfused(self, x: Tensor, idx: Tensor, w: Tensor, mode: str) -> Tensor:
        if mode == "indexed":
            if self.fmt is not None:
                raise ValueError(f"the indexed expert pass reads plain weights, not {self.fmt}")
            return experts_indexed(x, idx, w, self.w13, self.w2)
        if mode == "sparse" and self.fmt is None:
            return experts_sparse(x, idx, w, self.w13, self.w2)
        if mode == "sparse":
            def load(e: int) -> tuple[Tensor, Tensor]:
                w13, w2 = self.weights(e, x.dtype)
                return w13[0], w2[0]

            return experts_sparse_by(x, idx, w, self.num_experts, load)
        return experts_dense(x, idx, w, *self.weights(None, x.dtype))
