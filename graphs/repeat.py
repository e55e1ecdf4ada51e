"""Costing a stack of identical layers from a few of them (what keeps `graphs.plan --cost` at
Kimi's real size a matter of seconds: 60 of K2's 61 layers are the same MoE layer).

Layers that hold the same modules with the same parameter and buffer shapes and dtypes, fed
inputs of the same shapes, run the same ops at the same shapes: each adds the same FLOPs,
bytes, launches and collectives. So a run costs the same as one where the group's first layer
and its last `k` run and the others pass their input on as a fresh tensor of its shape (what
each layer hands the next), for `k` = 1 and 2: their difference is one layer less one
pass-through, and each count of the whole run is `run(1) + (n - 2) * (run(2) - run(1))` for a
group of `n`, exactly. Peaks are not sums: the live set only grows from one layer of the group
to the next (each layer's output, an aux layer's features, a prefill's cache rows stay live
until the forward ends), and the group's last layer runs in both, so the peak of either run is
the whole run's. `--every-layer` runs them all (`tests/test_plan.py` checks both agree).

NOTE: only on the meta device (a pass-through's values are garbage).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple, TypeVar

import torch
from torch import nn

T = TypeVar("T")

# Fields that are not sums over the ops: a cost row's peak and its attention kernels' programs
# a launch, a rehearsal tally's (`graphs.rehearse.Tally`) start, peak and largest workspace.
# Taken from either run (the larger).
NOT_SUMS = frozenset({"peak_activation_bytes", "attention_programs", "start", "peak",
                      "workspace"})


def signature(layer: nn.Module) -> tuple[Any, ...]:
    """What a layer's ops depend on besides its inputs: its modules' types, its parameters'
    and buffers' names, shapes and dtypes."""
    return (tuple(type(m).__name__ for m in layer.modules()),
            tuple((n, tuple(t.shape), t.dtype)
                  for n, t in [*layer.named_parameters(), *layer.named_buffers()]))


def repeated(layers: nn.ModuleList) -> list[int]:
    """The longest run of consecutive identical layers (`signature`), when longer than two."""
    best: list[int] = []
    run: list[int] = []
    prev = None
    for i, layer in enumerate(layers):
        sig = signature(layer)
        run = [*run, i] if sig == prev else [i]
        prev = sig
        if len(run) > len(best):
            best = run
    return best if len(best) > 2 else []


class _Like(NamedTuple):
    """A tensor's shape, dtype and device: what a pass-through layer makes fresh."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device


@contextmanager
def sampled(layers: nn.ModuleList, group: list[int], k: int) -> Iterator[None]:
    """Inside, the layers of `group` between its first and its last `k` pass their input on:
    fresh tensors of the shapes of the group's first layer's outputs."""
    first: list[Any] = []
    real = layers[group[0]].forward

    def head(*args: Any) -> Any:
        out = real(*args)
        # their shapes only: holding the tensors would keep them live
        first[:] = [_Like(t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else t
                    for t in out]
        return out

    def through(*args: Any) -> Any:
        ins = [t for a in args for t in (a if isinstance(a, list) else [a])]
        if any(isinstance(t, torch.Tensor) and t.device.type != "meta" for t in ins):
            raise RuntimeError("layers are sampled on the meta device only")
        return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device)
                     if isinstance(t, _Like) else t for t in first)

    patched = [layers[group[0]], *(layers[i] for i in group[1:len(group) - k])]
    layers[group[0]].forward = head
    for m in patched[1:]:
        m.forward = through
    try:
        yield
    finally:
        for m in patched:
            del m.forward


def combine(one: Any, two: Any, times: int, key: str = "") -> Any:
    """`one + times * (two - one)` field by field, of numbers, dicts (a key one lacks counts 0
    there), tuples and dataclasses (`NOT_SUMS`: the larger); the `ops` lists of cost rows
    matched by op and unit, dropping what is left with no count."""
    if key in NOT_SUMS:
        return max(one, two) if isinstance(one, int) else two
    if dataclasses.is_dataclass(one):
        return type(one)(**{f.name: combine(getattr(one, f.name), getattr(two, f.name), times,
                                            f.name) for f in dataclasses.fields(one)})
    if isinstance(one, dict):
        keys = [*one, *(k for k in two if k not in one)]
        return type(one)({k: combine(one.get(k, 0), two.get(k, 0), times, k) for k in keys})
    if isinstance(one, tuple):
        return tuple(combine(x, y, times) for x, y in zip(one, two, strict=True))
    if key == "ops":
        zero = dict.fromkeys(("flops", "bytes", "l2_bytes", "launches"), 0)
        by = [{(op["name"], op["dtype"]): op for op in ops} for ops in (one, two)]
        out = []
        for name, unit in {**by[1], **by[0]}:
            a, b = ({"name": name, "dtype": unit, **zero, **ops.get((name, unit), {})}
                    for ops in by)
            op = combine(a, b, times, "op")
            if any(op[f] for f in zero):
                out.append(op)
        return out
    if isinstance(one, bool) or not isinstance(one, int | float):
        return two
    return one + times * (two - one)


def extrapolated(layers: nn.ModuleList, run: Callable[[], T], every_layer: bool = False,
                 least: int = 3) -> T:
    """`run()`'s counts, the repeated layers (`repeated`) costed from two of them (see the
    module docstring) when there are at least `least` (where running them all costs more than
    running the rest twice), or every layer run with `every_layer`."""
    group = [] if every_layer else repeated(layers)
    if len(group) < least:
        return run()
    with sampled(layers, group, 1):
        one = run()
    with sampled(layers, group, 2):
        two = run()
    return combine(one, two, len(group) - 2)
