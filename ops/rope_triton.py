"""DeepSeek's interleaved rotary embedding of a head's last channels as one Triton kernel
(`torch.ops.kimi.rope_tail` on CUDA; its torch twin is `ops.rope.rope_tail`).

The twin, as the engine ran it: the rotary channels' even and odd values widened to fp32, four
products, a difference and a sum, a concatenation, a cast back, then another concatenation
with the channels that do not rotate: about a dozen kernels and passes, half of them fp32,
over every query head of every token of a prefill chunk. Here one program takes a token's
block of heads: it copies the channels that do not rotate and writes the rotated ones in the
twin's de-interleaved layout (all rotated evens, then all odds), computing each in fp32 and
rounding once, as the twin does. A GPU may fuse a product and the difference into one FMA, so
a value may differ from the twin's in its last bit; the interpreter computes as torch does.

Interpreter: CPU tensors run it under Triton's interpreter (`ops.triton_util`), rounding to
bf16 by hand (`rne_bf16`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ops.triton_util import kernel_for, rne_bf16


@triton.jit
def _rope_tail_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, s_xt, s_xh, s_ct,
                      D: tl.constexpr, NOPE: tl.constexpr, HALF: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_NOPE: tl.constexpr, BLOCK_HALF: tl.constexpr,
                      RNE: tl.constexpr):
    """Token `program_id(0)`, heads `program_id(1) * BLOCK_H ..`: `out[.., :NOPE] = x[..,
    :NOPE]`; for pair `i < HALF` of the rotary channels (`x[NOPE + 2i]`, `x[NOPE + 2i + 1]`),
    `out[NOPE + i] = even * cos_i - odd * sin_i` and `out[NOPE + HALF + i] = odd * cos_i +
    even * sin_i`."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < heads
    x_row = x_ptr + t * s_xt + h[:, None].to(tl.int64) * s_xh
    o_row = out_ptr + t * heads * D + h[:, None].to(tl.int64) * D
    if NOPE > 0:
        c = tl.arange(0, BLOCK_NOPE)
        m = h_ok[:, None] & (c[None, :] < NOPE)
        tl.store(o_row + c[None, :], tl.load(x_row + c[None, :], mask=m, other=0.0), mask=m)
    i = tl.arange(0, BLOCK_HALF)
    i_ok = i < HALF
    m = h_ok[:, None] & i_ok[None, :]
    even = tl.load(x_row + NOPE + 2 * i[None, :], mask=m, other=0.0).to(tl.float32)
    odd = tl.load(x_row + NOPE + 2 * i[None, :] + 1, mask=m, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + t * s_ct + i, mask=i_ok, other=0.0)[None, :]
    sin = tl.load(sin_ptr + t * s_ct + i, mask=i_ok, other=0.0)[None, :]
    first = even * cos - odd * sin
    second = odd * cos + even * sin
    if RNE:
        u = first.to(tl.uint32, bitcast=True)
        first = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        u = second.to(tl.uint32, bitcast=True)
        second = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    ty = out_ptr.dtype.element_ty
    tl.store(o_row + NOPE + i[None, :], first.to(ty), mask=m)
    tl.store(o_row + NOPE + HALF + i[None, :], second.to(ty), mask=m)


def rope_launch(heads: int, nope: int, rope: int) -> tuple[int, int, int]:
    """`(BLOCK_H, BLOCK_NOPE, BLOCK_HALF)` for `heads` heads of `nope` copied and `rope`
    rotated channels: up to 16 heads a program (K2.5's 8 query heads a rank at tp 8: one
    program a token)."""
    return (min(16, triton.next_power_of_2(heads)), triton.next_power_of_2(max(nope, 1)),
            triton.next_power_of_2(rope // 2))


def rope_tail_triton(x: Tensor, cos: Tensor, sin: Tensor, nope: int) -> Tensor:
    """`ops.rope.rope_tail` of 16-bit `x [..., heads, D]` (last dim contiguous) with fp32
    `cos/sin [..., (D - nope) // 2]`, one launch -> a new contiguous tensor of x's shape."""
    *lead, heads, D = x.shape
    half = (D - nope) // 2
    if nope < 0 or D - nope != 2 * half or half == 0:
        raise ValueError(f"{D} channels less {nope} that do not rotate leave no even rotary width")
    if tuple(cos.shape) != (*lead, half) or cos.shape != sin.shape:
        raise ValueError(f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} must be "
                         f"{(*lead, half)}")
    x3 = x.reshape(-1, heads, D)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    c2, s2 = (t.reshape(-1, half).float().contiguous() for t in (cos, sin))
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    bh, bn, bhalf = rope_launch(heads, nope, 2 * half)
    if x3.shape[0]:
        kernel_for(_rope_tail_kernel, x.device)[(x3.shape[0], triton.cdiv(heads, bh))](
            x3, c2, s2, out, heads, x3.stride(0), x3.stride(1), c2.stride(0), D=D, NOPE=nope,
            HALF=half, BLOCK_H=bh, BLOCK_NOPE=bn, BLOCK_HALF=bhalf,
            RNE=rne_bf16(x.dtype, x.device), num_warps=4 if heads * D >= 1024 else 1)
    return out.view(x.shape)
