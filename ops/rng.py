"""Counter-based uniforms: graph-safe coins from `(seed, counter)` tensors.

A captured graph cannot call a host generator, and a device generator's state is shared by the
whole batch. Hashing `(seed, counter, index)` with integer tensor ops instead gives each request
its own reproducible stream, identical on the CPU and on a GPU, with no generator state: the
seeds and counters are ordinary step inputs (or are advanced inside the graph).
"""

from __future__ import annotations

import torch
from torch import Tensor

_GOLDEN = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15 as a signed int64
_MIX1 = -0x40A7B892E31B1A47  # 0xBF58476D1CE4E5B9
_MIX2 = -0x6B2FB644ECCEEE15  # 0x94D049BB133111EB


def _shr(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 (torch's `>>` is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64(z: Tensor) -> Tensor:
    """splitmix64's finalizer, in wrapping int64 arithmetic."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def counter_uniforms(seed: Tensor, counter: Tensor, n: int) -> Tensor:
    """`[bs, n]` float32 uniforms in [0, 1) from `seed [bs]` and `counter [bs]` (int64): the
    `n` numbers of draw number `counter` of stream `seed`. 24 random bits each, so every value
    is exact in fp32 and below 1."""
    idx = torch.arange(n, device=seed.device, dtype=torch.int64)
    key = _mix64(seed.to(torch.int64) * _GOLDEN + counter.to(torch.int64))
    z = _mix64(key[:, None] + (idx[None, :] + 1) * _GOLDEN)
    return _shr(z, 40).to(torch.float32) * (1.0 / (1 << 24))
