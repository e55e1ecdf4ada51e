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
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.dist import Group, world_of
from ops.moe import experts_dense, experts_sparse


@dataclass(frozen=True)
class Stored:
    """One checkpoint tensor as this rank holds it: `shape` is the whole stored shape, `dim` the
    dimension split across `world` ranks (None: every rank holds all of it), `dest` the tensor
    this rank's piece is loaded into (a view of a parameter or buffer)."""

    shape: tuple[int, ...]
    dim: int | None
    dest: Tensor
    rank: int = 0
    world: int = 1

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
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def Linear(in_features: int, out_features: int) -> nn.Linear:  # noqa: N802 - a layer factory
    """A replicated bias-free linear."""
    return nn.Linear(in_features, out_features, bias=False)


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

    def __init__(self, hidden: int, inter: int, tp: Group | None = None, reduce: bool = True):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden, inter, tp)
        self.up_proj = ColumnParallelLinear(hidden, inter, tp)
        self.down_proj = RowParallelLinear(inter, hidden, tp, reduce)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ExpertBank(nn.Module):
    """`E` SwiGLU experts stacked for dispatch: `w13 [E, 2I, H]` (each expert's gate rows, then
    its up rows) and `w2 [E, H, I]`, `I` this rank's share of the intermediate dimension. The
    checkpoint names each expert's linears (`{e}.gate_proj.weight`, ...); they load into views
    of the stacks. The output is this rank's partial sum (the caller all-reduces)."""

    def __init__(self, experts: int, hidden: int, inter: int, tp: Group | None = None):
        super().__init__()
        self.tp = tp
        self.inter = inter // world_of(tp)
        self.w13 = nn.Parameter(torch.empty(experts, 2 * self.inter, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, self.inter))

    def stored_tensors(self) -> dict[str, Stored]:
        out, i = {}, self.inter
        for e in range(self.w13.shape[0]):
            out[f"{e}.gate_proj.weight"] = _stored(self.w13[e, :i], 0, self.tp)
            out[f"{e}.up_proj.weight"] = _stored(self.w13[e, i:], 0, self.tp)
            out[f"{e}.down_proj.weight"] = _stored(self.w2[e], 1, self.tp)
        return out

    def forward(self, x: Tensor, idx: Tensor, w: Tensor, sparse: bool = False) -> Tensor:
        """`x [T, H]`, routing `idx / w [T, k]` -> `[T, H]`. `sparse`: each token through its
        chosen experts only (eager only: data-dependent shapes); else every expert on every
        token (fixed shapes)."""
        fn = experts_sparse if sparse else experts_dense
        return fn(x, idx, w, self.w13, self.w2)
