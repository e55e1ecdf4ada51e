"""RMSNorm of 16-bit rows as one Triton kernel (`torch.ops.kimi.rms_norm` on CUDA; its torch twin
is `ops.norm.rms_norm`), and with the residual add before it (`torch.ops.kimi.add_rms_norm`,
twin `ops.norm.add_rms_norm`: a decoder layer's `h + branch` and the next norm in one pass).

The twin is transformers' DeepSeek-V3 norm: the row widened to fp32, scaled by the reciprocal
root of its mean square, rounded to the row's dtype, then multiplied by the weight (a 16-bit
product, rounded again). Run as torch ops that is six kernels and about nine passes over the
rows, half of them fp32; here one program reads its row once, keeps it in registers and writes
it once, rounding where the twin rounds. With the add, the program reads the stream's row
and the branch's, rounds their sum to the row's dtype (as torch's add does), stores it and
normalizes it: four passes over the rows instead of the five of an add and a norm. The mean
square sums in another order than torch's, so the normalized output may differ from the twin's
in the last bit of a few values (the sum is exact).

Interpreter: on CPU tensors it runs under Triton's interpreter (`ops.triton_util`), reducing
with `tl.reduce` and rounding to bf16 by hand (`rne_bf16`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ops.triton_util import kernel_for, rne_bf16

_SUM = tl.standard._sum_combine


@triton.jit
def _rms_norm_kernel(x_ptr, d_ptr, s_ptr, w_ptr, out_ptr, stride_x, stride_d, stride_s, stride_o,
                     H, eps, BLOCK: tl.constexpr, ADD: tl.constexpr, RNE: tl.constexpr):
    """One row a program: `out = w * round(x * rsqrt(mean(x^2) + eps))`, rounded; with `ADD`,
    the row is first `x + d` rounded to x's dtype, and stored to `s` as well."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        x += tl.load(d_ptr + row * stride_d + cols, mask=mask, other=0.0).to(tl.float32)
        if RNE:
            u = x.to(tl.uint32, bitcast=True)
            x = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        x = x.to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + row * stride_s + cols, x, mask=mask)
        x = x.to(tl.float32)
    var = tl.reduce(x * x, 0, _SUM) / H
    y = x * (1.0 / tl.sqrt(var + eps))
    if RNE:
        u = y.to(tl.uint32, bitcast=True)
        y = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    o = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) * y
    if RNE:
        u = o.to(tl.uint32, bitcast=True)
        o = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    tl.store(out_ptr + row * stride_o + cols, o.to(out_ptr.dtype.element_ty), mask=mask)


def norm_launch(H: int) -> tuple[int, int]:
    """`(BLOCK, num_warps)` for rows `H` wide: the whole row in one block, about 16 values a
    thread (Kimi's 7,168: 8,192 on 16 warps)."""
    block = triton.next_power_of_2(H)
    return block, max(1, min(16, block // 512))


def _rows(t: Tensor, H: int) -> Tensor:
    t2 = t.reshape(-1, H)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float
            ) -> tuple[Tensor | None, Tensor]:
    H = x.shape[-1]
    if weight.shape != (H,) or weight.dtype != x.dtype:
        raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} must be [{H}] {x.dtype}")
    if delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype):
        raise ValueError(f"delta {tuple(delta.shape)} {delta.dtype} must be x's "
                         f"{tuple(x.shape)} {x.dtype}")
    x2 = _rows(x, H)
    d2 = x2 if delta is None else _rows(delta, H)
    out = torch.empty((x2.shape[0], H), dtype=x.dtype, device=x.device)
    s = None if delta is None else torch.empty_like(out)
    block, warps = norm_launch(H)
    if x2.shape[0]:
        s2 = out if s is None else s
        kernel_for(_rms_norm_kernel, x.device)[(x2.shape[0],)](
            x2, d2, s2, weight, out, x2.stride(0), d2.stride(0), s2.stride(0), out.stride(0),
            H, eps, BLOCK=block, ADD=delta is not None, RNE=rne_bf16(x.dtype, x.device),
            num_warps=warps)
    return (None if s is None else s.view(x.shape)), out.view(x.shape)


def rms_norm_triton(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`ops.norm.rms_norm` of `x [..., H]` (16-bit) with `weight [H]` of x's dtype, one launch."""
    return _launch(x, None, weight, eps)[1]


def add_rms_norm_triton(x: Tensor, delta: Tensor, weight: Tensor, eps: float
                        ) -> tuple[Tensor, Tensor]:
    """`ops.norm.add_rms_norm`: `(x + delta, rms_norm(x + delta))` of 16-bit rows `x, delta
    [..., H]`, one launch reading both rows once and writing both results once."""
    s, out = _launch(x, delta, weight, eps)
    assert s is not None
    return s, out
