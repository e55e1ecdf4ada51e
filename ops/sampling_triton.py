"""The race of `ops.sampling.sample_from_probs`, and `ops.sampling.race_logits`, as Triton kernels.

Each program takes one row of probabilities `[V]` and its coin, hashes each token's unit
exponential from the coin as it loads the row (the same hash as `ops.sampling.race_noise`), and
keeps the largest `p / E`, the first on a tie: the row is read once and nothing of the
vocabulary's size is written. The torch twin writes the noise and the scores of every token, some
fifteen passes over `[rows, V]` in int64 and fp32: at Kimi's vocabulary (163,840) and 32 rows of
17 tree nodes, about 20 GB of memory traffic a step against this kernel's 0.36 GB read.

It draws the twin's token wherever no two tokens' scores lie within the rounding of `log` (the
interpreter's numpy `log` and a GPU's may round differently from torch's); every draw is an
exact sample either way, and on one device every mode draws through the same kernel, so seeded
output still agrees across modes there. On CPU tensors it runs under Triton's interpreter
(`ops.triton_util`), which reduces only with the max and sum combine functions: the first index
of a block's maximum is found as the maximum of the negated indices where the score equals it.
The same kernel, switched by a constexpr, writes `race_logits` (`logits - log E` for every token,
the raced draft logits of coupled drafting) in one read and one write of each element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ops.triton_util import kernel_for

_MAX = tl.standard._elementwise_max
BLOCK = 1024


@triton.jit
def _race_kernel(x_ptr, coin_ptr, out_ptr, stride, V: tl.constexpr, BLOCK_V: tl.constexpr,
                 LOGITS: tl.constexpr):
    """One row per program, `BLOCK_V` tokens at a time: with `LOGITS`, store `x - log E` (x:
    logits) for every token; else keep the first token of the largest `x / E` (x: probs)."""
    row = tl.program_id(0).to(tl.int64)
    c1 = tl.full([], 0x21F0AAAD, tl.uint32)
    c2 = tl.full([], 0x735A2D97, tl.uint32)
    golden = tl.full([], 0x9E3779B9, tl.uint32)
    k = tl.load(coin_ptr + row).to(tl.uint32, bitcast=True)
    k = k ^ (k >> 16)
    k = k * c1
    k = k ^ (k >> 15)
    k = k * c2
    k = k ^ (k >> 15)
    best = tl.full([], -1.0, tl.float32)
    best_id = tl.full([], 0, tl.int64)
    for start in range(0, V, BLOCK_V):
        ids = start + tl.arange(0, BLOCK_V)
        live = ids < V
        x = tl.load(x_ptr + row * stride + ids, mask=live, other=0.0).to(tl.float32)
        h = k + ids.to(tl.uint32) * golden
        h = h ^ (h >> 16)
        h = h * c1
        h = h ^ (h >> 15)
        h = h * c2
        h = h ^ (h >> 15)
        # NOTE: below 1, as the twin holds it (E = 0 would let a zero-probability token win)
        e = -tl.log(tl.minimum(((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0),
                               1.0 - 1.0 / 16777216.0))
        if LOGITS:
            tl.store(out_ptr + row * V + ids, x - tl.log(e), mask=live)
        else:
            s = tl.where(live, x / e, -1.0)
            top = tl.reduce(s, 0, _MAX)
            first = -tl.reduce(tl.where(s == top, -ids.to(tl.float32), -3.0e38), 0, _MAX)
            better = top > best
            best_id = tl.where(better, first.to(tl.int64), best_id)
            best = tl.where(better, top, best)
    if not LOGITS:
        tl.store(out_ptr + row, best_id)


def _launch(x: Tensor, coins: Tensor, out: Tensor, block: int, logits: bool) -> None:
    vocab = x.shape[-1]
    rows = x.reshape(-1, vocab)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    flat = coins.to(torch.float32).reshape(-1).contiguous()
    if flat.shape[0] != rows.shape[0]:
        raise ValueError(f"one coin per row: {tuple(coins.shape)} coins for "
                         f"{tuple(x.shape)}")
    if rows.shape[0]:
        kernel_for(_race_kernel, x.device)[(rows.shape[0],)](
            rows, flat, out, rows.stride(0), V=vocab,
            BLOCK_V=min(block, triton.next_power_of_2(vocab)), LOGITS=logits)


def race_sample_triton(probs: Tensor, coins: Tensor, block: int = BLOCK) -> Tensor:
    """`ops.sampling.sample_from_probs(probs [..., V], coins [...])` (int64 `[...]`) in one pass
    over the rows, `block` tokens at a time (a power of two); graph-safe (the grid is the row
    count)."""
    vocab = probs.shape[-1]
    if vocab >= 1 << 24:
        raise ValueError(f"the race kernel finds ids in fp32: vocabulary {vocab} >= 2**24")
    out = torch.empty(probs.shape[:-1].numel(), dtype=torch.int64, device=probs.device)
    _launch(probs, coins, out, block, logits=False)
    return out.view(probs.shape[:-1])


def race_logits_triton(logits: Tensor, coins: Tensor, block: int = BLOCK) -> Tensor:
    """`ops.sampling.race_logits(logits [..., V], coins [...])` (fp32 `[..., V]`) in one pass:
    each element read once and written once (equal to the twin up to the rounding of `log`)."""
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    _launch(logits, coins, out, block, logits=True)
    return out
