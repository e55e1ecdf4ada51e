"""RMSNorm of 16-bit rows as one Triton kernel (`torch.ops.kimi.rms_norm` on CUDA; its torch twin
is `ops.norm.rms_norm`).

The twin is transformers' DeepSeek-V3 norm: the row widened to fp32, scaled by the reciprocal
root of its mean square, rounded to the row's dtype, then multiplied by the weight (a 16-bit
product, rounded again). Run as torch ops that is six kernels and about nine passes over the
rows, half of them fp32; here one program reads its row once, keeps it in registers and writes
it once, rounding where the twin rounds. Its mean square sums in another order than torch's, so
the output may differ from the twin's in the last bit of a few values.

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
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, H, eps,
                     BLOCK: tl.constexpr, RNE: tl.constexpr):
    """One row a program: `out = w * round(x * rsqrt(mean(x^2) + eps))`, rounded."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
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


def rms_norm_triton(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`ops.norm.rms_norm` of `x [..., H]` (16-bit) with `weight [H]` of x's dtype, one launch."""
    H = x.shape[-1]
    if weight.shape != (H,) or weight.dtype != x.dtype:
        raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} must be [{H}] {x.dtype}")
    x2 = x.reshape(-1, H)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], H), dtype=x.dtype, device=x.device)
    block, warps = norm_launch(H)
    if x2.shape[0]:
        kernel_for(_rms_norm_kernel, x.device)[(x2.shape[0],)](
            x2, weight, out, x2.stride(0), out.stride(0), H, eps, BLOCK=block,
            RNE=rne_bf16(x.dtype, x.device), num_warps=warps)
    return out.view(x.shape)
