"""Triton FP8 block-scaled linear (weight-only dequantization in the kernel), and the launch
helpers the Triton kernels of `ops.moe_triton` share.

`fp8_linear_triton(x [..., K], w [N, K] float8_e4m3fn, scale_inv [ceil(N/b0), ceil(K/b1)])`
-> `[..., N]` in x's dtype, `W[i, j] = w[i, j] * scale_inv[i // b0, j // b1]`: each weight tile
is decoded to fp32, scaled per element by its block's scale, rounded to x's dtype (bit for bit
`ops.quant.dequant_fp8_block(..., dtype=x.dtype)`) and fed to `tl.dot` with fp32
accumulation. The torch twin is `ops.quant.fp8_linear_torch`.

FP8 bytes travel as `uint8` and are bitcast to `tl.float8e4nv` in the kernel: Triton's
interpreter (3.9.0) handles that everywhere, while a masked load of a float8 pointer with
`other=0` fails there ("cannot cast ... to fp8e4nv"); on a GPU both are the same load.

Interpreter: on CPU tensors the kernels always run under Triton's interpreter (the jitted
function's Python body is re-wrapped in `InterpretedFunction`), whether or not
`TRITON_INTERPRET=1` was set when this module was imported (triton reads the variable when
`@triton.jit` decorates, not at `import triton`); so tests need no environment setup and a
whole test session may mix CPU and CUDA runs. Two interpreter limits shape every kernel here:

- `tl.dot` on bf16 tiles is wrong in the interpreter (bf16 is held as uint16 and multiplied as
  integers), so on the CPU (`IEEE=True`) dot operands are widened to fp32; on a GPU bf16/fp16
  tiles go to the tensor cores as they are, and fp32 inputs use `input_precision="ieee"` (no
  TF32), so fp32 runs match the torch twins tightly everywhere.
- Rounding fp32 to bf16 with `.to(tl.bfloat16)` truncates in the interpreter (numpy has no
  bf16; even `fp_downcast_rounding="rtne"` misrounds half the values there), while a GPU rounds
  to nearest even as torch does. On the CPU (`RNE=True`, bf16 targets only) the kernels round
  by integer arithmetic on the fp32 bits first (`(u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000`,
  exact for finite values), so the cast that follows is exact and both match torch bit for bit.
- `tl.zeros`, `tl.sigmoid`, `tl.cdiv`, `tl.sum` are themselves `@triton.jit` functions
  decorated when triton is imported; the interpreter cannot call them unless triton was
  imported under `TRITON_INTERPRET=1`. The kernels use `tl.full` and `tl.exp` instead.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

_INTERPRETED: dict[Any, Any] = {}


def kernel_for(kernel: Any, device: torch.device) -> Any:
    """The compiled kernel on an accelerator; on the CPU the interpreter's version of it,
    whatever `TRITON_INTERPRET` was when the kernel was decorated."""
    if device.type != "cpu":
        return kernel
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernel, InterpretedFunction):
        return kernel
    if kernel not in _INTERPRETED:
        _INTERPRETED[kernel] = InterpretedFunction(kernel.fn)
    return _INTERPRETED[kernel]


def ieee_dots(x: Tensor) -> bool:
    """Whether kernels fed `x` must widen dot operands to fp32: on the CPU (interpreter, see the
    module docstring) and for fp32 inputs (IEEE fp32 instead of TF32)."""
    return x.device.type == "cpu" or x.dtype == torch.float32


def rne_bf16(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a kernel rounding to `dtype` must round to nearest even by hand (bf16 on the
    interpreter; see the module docstring)."""
    return device.type == "cpu" and dtype == torch.bfloat16


def pow2_tile(n: int, lo: int = 16, hi: int = 128) -> int:
    """A power-of-two tile for a dimension of size `n`, within `[lo, hi]` (`tl.dot` needs 16)."""
    return max(lo, min(hi, triton.next_power_of_2(max(n, 1))))


@triton.jit
def _fp8_linear_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr,
    M, N,
    s_xm, s_xk, s_wn, s_wk, s_sn, s_sk, s_ym, s_yn,
    K: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr, RNE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        a = tl.load(x_ptr + rm[:, None] * s_xm + rk[None, :] * s_xk,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        wb = tl.load(w_ptr + rn[None, :] * s_wn + rk[:, None] * s_wk, mask=w_mask, other=0)
        sc = tl.load(s_ptr + (rn[None, :] // SCALE_N) * s_sn + (rk[:, None] // SCALE_K) * s_sk,
                     mask=w_mask, other=0.0)
        # [BLOCK_K, BLOCK_N], rounded to x's dtype exactly as dequant_fp8_block(dtype=x.dtype).
        b = wb.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc
        if RNE:
            ub = b.to(tl.uint32, bitcast=True)
            b = ((ub + 0x7FFF + ((ub >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        b = b.to(a.dtype)
        if IEEE:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if RNE:
        ua = acc.to(tl.uint32, bitcast=True)
        acc = ((ua + 0x7FFF + ((ua >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    tl.store(y_ptr + rm[:, None] * s_ym + rn[None, :] * s_yn, acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def fp8_linear_triton(
    x: Tensor, w: Tensor, scale_inv: Tensor, block: tuple[int, int] = (128, 128), *,
    block_m: int | None = None, block_n: int = 64, block_k: int = 128,
) -> Tensor:
    """`x [..., K]` (bf16/fp16/fp32) times `w [N, K]` (float8_e4m3fn, or its bytes as uint8)
    with `scale_inv [ceil(N/b0), ceil(K/b1)]` fp32 -> `[..., N]` in x's dtype.

    Grid `(cdiv(M, block_m), cdiv(N, block_n))`, fixed by shapes (graph-safe, no host sync);
    `block_m` defaults to the power of two covering `M` within `[16, 64]`. `K` is a constexpr
    (one compile per weight shape; see `ops.moe_triton` on Triton 3.6's interpreter).
    """
    K = x.shape[-1]
    N = w.shape[0]
    if tuple(w.shape) != (N, K):
        raise ValueError(f"weight {tuple(w.shape)} does not match x's last dim {K}")
    expect = (-(-N // block[0]), -(-K // block[1]))
    if tuple(scale_inv.shape) != expect:
        raise ValueError(f"scale_inv {tuple(scale_inv.shape)} != {expect} for weight {(N, K)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y.view(*lead, N)
    wb = w.view(torch.uint8) if w.dtype != torch.uint8 else w
    bm = block_m or pow2_tile(M, hi=64)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, block_n))
    kernel_for(_fp8_linear_kernel, x.device)[grid](
        x2, wb, scale_inv, y, M, N,
        x2.stride(0), x2.stride(1), wb.stride(0), wb.stride(1),
        scale_inv.stride(0), scale_inv.stride(1), y.stride(0), y.stride(1),
        K=K, SCALE_N=block[0], SCALE_K=block[1], BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k,
        IEEE=ieee_dots(x2), RNE=rne_bf16(x.dtype, x.device), num_warps=4,
    )
    return y.view(*lead, N)
