"""Triton GEMM that decodes its weight in the kernel (weight-only quantization), over dense rows
or the blocks of an expert alignment; and the FP8 block-scaled linear built on it.

`_dequant_gemm_kernel` (launched by `dequant_gemm`) computes `C = A @ W.T` with fp32
accumulation, for a weight `[E, N, K]` (one matrix, `E = 1`, or a bank of experts) stored as

- `"plain"`: values in a float dtype, used as loaded;
- `"int4"`: `ops.quant.dequant_int4`'s packed words `[E, N, ceil(K/8)]` int32, scales `[E, N,
  ceil(K/group)]` (`SCALE_N = 1`, `SCALE_K = group`): a `[BLOCK_K, BLOCK_N]` tile reads the
  int32 word of each value (`k // 8`; eight values share one word, the repeats hit the cache),
  shifts by `4 * (k % 8)`, masks the nibble and subtracts 8;
- `"fp8"`: float8_e4m3fn `[E, N, K]`, block scales `[E, ceil(N/b0), ceil(K/b1)]` (`SCALE_N,
  SCALE_K = b0, b1`). FP8 bytes travel as `uint8` and are bitcast to `tl.float8e4nv` in the
  kernel: Triton's interpreter (3.9.0) handles that everywhere, while a masked load of a float8
  pointer with `other=0` fails there ("cannot cast ... to fp8e4nv"); on a GPU both are the
  same load.

A decoded tile is multiplied by its scales in fp32 and rounded to A's dtype (bit for bit
`dequant_int4` / `dequant_fp8_block` with `dtype=` A's dtype) before `tl.dot`; the accumulator
is stored in C's dtype. Rows are either dense (row `m` of A into row `m` of C, grid `(cdiv(M,
BLOCK_M), cdiv(N, BLOCK_N))`) or those of an expert alignment (`ops.moe.moe_align_block_size`,
grid `(cap // block, cdiv(N, BLOCK_N))`, `ops.moe_triton` describes its use): each row tile is
one block of one expert, row `r` the pair `p = sorted_ids[r]`, read from A's row `p // top_k`,
stored at C's row `p` (each pair once: no atomics);
padding rows load zeros and store nothing, and blocks at or past `num_padded` exit at once.
`GATED` (the experts' gate and up GEMM) reads gate rows and the matching up rows in one weight
tile and stores `silu(gate) * up`; `GROUP_M > 1` flattens either grid and walks it GROUP_M row
tiles at a time down each column of tiles (L2 reuse). Both grids depend on shapes only
(graph-safe, no host sync). `N` and `K` are constexpr: one
compile per weight shape, known trip counts, and Triton 3.6's interpreter with numpy >= 2.4
cannot take a runtime loop bound (`int()` of a 1-element array); row counts stay runtime.
Tiles are powers of two, at least 16 on every `tl.dot` dimension; 64-bit offsets come from the
int64 expert and pair ids, so banks past 2^31 elements work.

`fp8_linear_triton(x [..., K], w [N, K] float8_e4m3fn, scale_inv [ceil(N/b0), ceil(K/b1)])`
-> `[..., N]` in x's dtype, `W[i, j] = w[i, j] * scale_inv[i // b0, j // b1]`: the dense
`"fp8"` launch. The torch twin is `ops.quant.fp8_linear_torch`.

On CPU tensors the kernel runs under Triton's interpreter with the workarounds described in
`ops.triton_util` (launched through `kernel_for`): fp32 dot operands (`IEEE`), decoded bf16
weight tiles (`RNE_W`) and bf16 outputs (`RNE_C`) rounded to nearest even by hand.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ops.paged_grid import pow2_tile
from ops.triton_util import ieee_dots, kernel_for, rne_bf16


@triton.jit
def _dequant_gemm_kernel(
    a_ptr, w_ptr, s_ptr, c_ptr, ids_ptr, bexp_ptr, npad_ptr,
    M, top_k, m_blocks,
    s_am, s_ak, s_we, s_wn, s_wk, s_se, s_sn, s_sk, s_cm, s_cn,
    N: tl.constexpr, K: tl.constexpr, WEIGHT: tl.constexpr,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, ALIGNED: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    IEEE: tl.constexpr, RNE_W: tl.constexpr, RNE_C: tl.constexpr,
):
    if GROUP_M == 1:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
    else:
        # One flat grid walked GROUP_M row tiles at a time down each column of tiles: the
        # programs running together share GROUP_M row tiles and a few weight tiles in L2.
        n_blocks: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
        pid = tl.program_id(0)
        first_m = (pid // (GROUP_M * n_blocks)) * GROUP_M
        group = tl.minimum(m_blocks - first_m, GROUP_M)
        pid_m = first_m + (pid % (GROUP_M * n_blocks)) % group
        pid_n = (pid % (GROUP_M * n_blocks)) // group
    if ALIGNED:
        if pid_m * BLOCK_M >= tl.load(npad_ptr):
            return
        e = tl.load(bexp_ptr + pid_m)
        dst = tl.load(ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        src = dst // top_k
    else:
        e = 0
        dst = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        src = dst
    live = dst < M
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    if GATED:
        # Weight rows: the tile's BLOCK_N gate rows, then the up rows N further on.
        WN: tl.constexpr = 2 * BLOCK_N
        wj = tl.arange(0, WN)
        wn = pid_n * BLOCK_N + wj % BLOCK_N
        wn_ok = wn < N
        wn = wn + (wj // BLOCK_N) * N
    else:
        WN: tl.constexpr = BLOCK_N
        wn = rn
        wn_ok = n_ok
    w_base = w_ptr + e * s_we
    s_base = s_ptr + e * s_se
    acc = tl.full((BLOCK_M, WN), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        a = tl.load(a_ptr + src[:, None] * s_am + rk[None, :] * s_ak,
                    mask=live[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & wn_ok[None, :]
        # The [BLOCK_K, WN] weight tile, in A's dtype.
        if WEIGHT == "plain":
            b = tl.load(w_base + rk[:, None] * s_wk + wn[None, :] * s_wn, mask=w_mask, other=0.0)
        else:
            if WEIGHT == "int4":
                word = tl.load(w_base + (rk[:, None] // 8) * s_wk + wn[None, :] * s_wn,
                               mask=w_mask, other=0)
                q = (((word >> ((rk[:, None] % 8) * 4)) & 0xF) - 8).to(tl.float32)
            else:
                byte = tl.load(w_base + rk[:, None] * s_wk + wn[None, :] * s_wn, mask=w_mask,
                               other=0)
                q = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            sc = tl.load(s_base + (wn[None, :] // SCALE_N) * s_sn + (rk[:, None] // SCALE_K) * s_sk,
                         mask=w_mask, other=0.0)
            b = q * sc.to(tl.float32)
            if RNE_W:
                ub = b.to(tl.uint32, bitcast=True)
                b = ((ub + 0x7FFF + ((ub >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        b = b.to(a.dtype)
        if IEEE:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if GATED:
        # silu(gate) * up in fp32, rounded once to C's dtype below (as the twin rounds).
        gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
        acc = gate / (1.0 + tl.exp(-gate)) * up
    if RNE_C:
        uc = acc.to(tl.uint32, bitcast=True)
        acc = ((uc + 0x7FFF + ((uc >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    tl.store(c_ptr + dst[:, None] * s_cm + rn[None, :] * s_cn, acc.to(c_ptr.dtype.element_ty),
             mask=live[:, None] & n_ok[None, :])


def dequant_gemm(
    a: Tensor, w: Tensor, out: Tensor, *, weight: str = "plain", scale: Tensor | None = None,
    scale_block: tuple[int, int] = (1, 1), align: tuple[Tensor, Tensor, Tensor] | None = None,
    top_k: int = 1, gated: bool = False,
    tiles: tuple[int, int, int], group_m: int = 1, num_warps: int = 4, num_stages: int = 3,
) -> None:
    """Launch `_dequant_gemm_kernel` into `out [M, N]` for `a [rows, K]` and the weight `w
    [E, N, *]` of format `weight` ("plain", "int4", "fp8"; see the module docstring) with
    `scale [E, *, *]` per `scale_block = (SCALE_N, SCALE_K)`; `tiles = (BLOCK_M, BLOCK_N,
    BLOCK_K)`.

    Dense (`align is None`, `E = 1`): `out[m] = a[m] @ W.T`. Aligned (`align = (sorted_ids,
    block_expert, num_padded)` of `M` pairs, `BLOCK_M` its block): `out[p] = a[p // top_k] @
    W_e.T` for each pair `p` in a block of expert `e`; rows of
    `out` that belong to no block are left as they were. `gated`: the weight holds `2N` rows,
    gate rows then up rows, and `out[:, n] = silu(gate_n) * up_n` (computed in fp32, rounded
    once to out's dtype): a program computes BLOCK_N gate and the matching up columns.
    `group_m > 1` walks a flat grid `group_m` row tiles at a time down each column of tiles (L2
    reuse of the rows and the weight tiles); 1 keeps the 2-D grid `(row tiles, column tiles)`.
    """
    bm, bn, bk = tiles
    M, N = out.shape
    # Stand-ins for pointers a launch never reads: any tensor will do.
    s = scale if scale is not None else w
    if align is None:
        ids = bexp = npad = out
        m_blocks = triton.cdiv(M, bm)
    else:
        ids, bexp, npad = align
        m_blocks = ids.shape[0] // bm
    n_blocks = triton.cdiv(N, bn)
    grid = (m_blocks, n_blocks) if group_m == 1 else (m_blocks * n_blocks,)
    kernel_for(_dequant_gemm_kernel, a.device)[grid](
        a, w, s, out, ids, bexp, npad, M, top_k, m_blocks,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2),
        s.stride(0), s.stride(1), s.stride(2), out.stride(0), out.stride(1),
        N=N, K=a.shape[1], WEIGHT=weight, SCALE_N=scale_block[0], SCALE_K=scale_block[1],
        ALIGNED=align is not None, GATED=gated, BLOCK_M=bm,
        BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, IEEE=ieee_dots(a.dtype, a.device),
        RNE_W=rne_bf16(a.dtype, a.device), RNE_C=rne_bf16(out.dtype, out.device),
        num_warps=num_warps, num_stages=num_stages,
    )


def fp8_linear_triton(
    x: Tensor, w: Tensor, scale_inv: Tensor, block: tuple[int, int] = (128, 128), *,
    block_n: int = 64, block_k: int = 128,
) -> Tensor:
    """`x [..., K]` (bf16/fp16/fp32) times `w [N, K]` (float8_e4m3fn, or its bytes as uint8)
    with `scale_inv [ceil(N/b0), ceil(K/b1)]` fp32 -> `[..., N]` in x's dtype.

    Grid `(cdiv(M, block_m), cdiv(N, block_n))`, fixed by shapes (graph-safe, no host sync);
    `block_m` is the power of two covering `M` within `[16, 64]`; one compile per weight shape
    (see `dequant_gemm`).
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
    dequant_gemm(x2, wb.unsqueeze(0), y, weight="fp8", scale=scale_inv.unsqueeze(0),
                 scale_block=block, tiles=(pow2_tile(M, hi=64), block_n, block_k))
    return y.view(*lead, N)
