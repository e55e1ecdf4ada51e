"""Triton fused expert bank over the static-shape alignment of `ops.moe.moe_align_block_size`.

`moe_experts_triton` (float weights, bf16/fp16/fp32) and `moe_experts_w4a16_triton` (INT4
pack-quantized weights, dequantized in the kernel: W4A16) compute, for `x [T, H]` and routing
`idx/w [T, k]`, `out[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))` with
`e = idx[t, j]`, in x's dtype. The torch twins (same rounding points) are
`ops.moe.experts_aligned` and `ops.moe.experts_aligned_w4a16`.

Design (two launches, fixed grid, early exit; graph-safe, no host sync):

- The alignment's blocks are the kernels' row tiles (`BLOCK_M = block`): every block holds
  rows of one expert, its `block_expert` entry.
- `_moe_gate_up_kernel`, grid `(cap // block, cdiv(I, BLOCK_N))`: gate and up tiles of the
  block's expert against the gathered token rows (two fp32 accumulators over H), then
  `silu(g) * u` rounded to x's dtype into the scratch `h [cap, I]` at the block's rows.
- `_moe_down_kernel`, grid `(cap // block, cdiv(H, BLOCK_N))`: `h` rows times the expert's
  down tile (fp32 over I), times the pair's routing weight, stored as the fp32 row of its
  (token, slot) pair in `y [T*k, H]` (each pair appears once in the alignment, so no atomics);
  `y.view(T, k, H).sum(1)` then reduces the k slots in slot order, deterministically.
- Both grids depend on `(T, k, E, block)` only; a program whose block starts at or past
  `num_padded` returns at once, so one CUDA graph serves every routing. Padding rows (pair id
  `T*k`) load zeros and store nothing; dropped pairs (ids outside `[0, E)`) leave zero rows.
- INT4 (`INT4=True`): a `[BLOCK_K, BLOCK_N]` weight tile reads the int32 word of each value
  (`k // 8`, eight values share one word, the repeats hit the cache), shifts by `4 * (k % 8)`,
  masks the nibble, subtracts 8 and multiplies by the group scale `[n, k // GROUP]` in fp32,
  then rounds to x's dtype: bit for bit `ops.quant.dequant_int4(..., dtype=x.dtype)`.
- The model's dimensions (`H`, `I`) are constexpr: one compile per layer shape, known trip
  counts, and Triton 3.6's interpreter with numpy >= 2.4 cannot take a runtime loop bound
  (`int()` of a 1-element array); batch-dependent sizes stay runtime arguments.
- Tiles are powers of two, at least 16 on every `tl.dot` dimension (`block` is 16..128).
  64-bit offsets come from the int64 expert and pair ids, so banks past 2^31 elements work.

The interpreter notes of `ops.quant_triton` apply (CPU tensors run interpreted; fp32 dot
operands and by-hand bf16 rounding there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ops.moe import moe_align_block_size
from ops.quant_triton import ieee_dots, kernel_for, pow2_tile, rne_bf16


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, w_ptr, s_ptr, h_ptr, ids_ptr, bexp_ptr, npad_ptr,
    num_pairs, top_k,
    s_xt, s_xk, s_we, s_wn, s_wk, s_se, s_sn, s_sk, s_hm,
    K: tl.constexpr, INTER: tl.constexpr, GROUP: tl.constexpr, INT4: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr, RNE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(npad_ptr):
        return
    e = tl.load(bexp_ptr + pid_m)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(ids_ptr + rm)
    live = ids < num_pairs
    tok = ids // top_k
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < INTER
    w_base = w_ptr + e * s_we
    s_base = s_ptr + e * s_se
    acc_g = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    acc_u = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        a = tl.load(x_ptr + tok[:, None] * s_xt + rk[None, :] * s_xk,
                    mask=live[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        if INT4:
            wp = w_base + (rk[:, None] // 8) * s_wk + rn[None, :] * s_wn
            sp = s_base + (rk[:, None] // GROUP) * s_sk + rn[None, :] * s_sn
            shift = (rk[:, None] % 8) * 4
            # Up rows start INTER rows after the gate rows, in the words and in the scales.
            qg = ((tl.load(wp, mask=w_mask, other=0) >> shift) & 0xF) - 8
            qu = ((tl.load(wp + INTER * s_wn, mask=w_mask, other=0) >> shift) & 0xF) - 8
            sg = tl.load(sp, mask=w_mask, other=0.0).to(tl.float32)
            su = tl.load(sp + INTER * s_sn, mask=w_mask, other=0.0).to(tl.float32)
            bg = qg.to(tl.float32) * sg
            bu = qu.to(tl.float32) * su
            if RNE:
                ug = bg.to(tl.uint32, bitcast=True)
                bg = ((ug + 0x7FFF + ((ug >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
                uu = bu.to(tl.uint32, bitcast=True)
                bu = ((uu + 0x7FFF + ((uu >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        else:
            wp = w_base + rk[:, None] * s_wk + rn[None, :] * s_wn
            bg = tl.load(wp, mask=w_mask, other=0.0)
            bu = tl.load(wp + INTER * s_wn, mask=w_mask, other=0.0)
        bg = bg.to(a.dtype)
        bu = bu.to(a.dtype)
        if IEEE:
            a32 = a.to(tl.float32)
            acc_g = tl.dot(a32, bg.to(tl.float32), acc_g, input_precision="ieee")
            acc_u = tl.dot(a32, bu.to(tl.float32), acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, bg, acc_g)
            acc_u = tl.dot(a, bu, acc_u)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    if RNE:
        uh = h.to(tl.uint32, bitcast=True)
        h = ((uh + 0x7FFF + ((uh >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    tl.store(h_ptr + rm[:, None] * s_hm + rn[None, :], h.to(h_ptr.dtype.element_ty),
             mask=n_ok[None, :])


@triton.jit
def _moe_down_kernel(
    h_ptr, w_ptr, s_ptr, y_ptr, rw_ptr, ids_ptr, bexp_ptr, npad_ptr,
    num_pairs,
    s_hm, s_we, s_wn, s_wk, s_se, s_sn, s_sk, s_ym,
    K: tl.constexpr, N: tl.constexpr, GROUP: tl.constexpr, INT4: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr, RNE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(npad_ptr):
        return
    e = tl.load(bexp_ptr + pid_m)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(ids_ptr + rm)
    live = ids < num_pairs
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    w_base = w_ptr + e * s_we
    s_base = s_ptr + e * s_se
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        a = tl.load(h_ptr + rm[:, None] * s_hm + rk[None, :], mask=k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        if INT4:
            wp = w_base + (rk[:, None] // 8) * s_wk + rn[None, :] * s_wn
            sp = s_base + (rk[:, None] // GROUP) * s_sk + rn[None, :] * s_sn
            q = ((tl.load(wp, mask=w_mask, other=0) >> ((rk[:, None] % 8) * 4)) & 0xF) - 8
            b = q.to(tl.float32) * tl.load(sp, mask=w_mask, other=0.0).to(tl.float32)
            if RNE:
                ub = b.to(tl.uint32, bitcast=True)
                b = ((ub + 0x7FFF + ((ub >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        else:
            b = tl.load(w_base + rk[:, None] * s_wk + rn[None, :] * s_wn, mask=w_mask, other=0.0)
        b = b.to(a.dtype)
        if IEEE:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    rw = tl.load(rw_ptr + ids, mask=live, other=0.0).to(tl.float32)
    tl.store(y_ptr + ids[:, None] * s_ym + rn[None, :], acc * rw[:, None],
             mask=live[:, None] & n_ok[None, :])


def _fused_experts(
    x: Tensor, idx: Tensor, w: Tensor, w13: Tensor, s13: Tensor | None, w2: Tensor,
    s2: Tensor | None, inter: int, group: int, block: int, block_n: int, block_k: int,
) -> Tensor:
    """Shared launcher: plain weights when `s13 is None`, else packed INT4 with group scales."""
    T, H = x.shape
    k = idx.shape[1]
    E = w13.shape[0]
    if block < 16:
        raise ValueError(f"block must be at least 16 for tl.dot, got {block}")
    sorted_ids, block_expert, num_padded = moe_align_block_size(idx, E, block)
    cap = sorted_ids.shape[0]
    n = T * k
    y = torch.zeros(n, H, dtype=torch.float32, device=x.device)
    if cap > 0:
        int4 = s13 is not None
        # Unused in the float path; any tensor with strides stands in for the scale pointers.
        s13 = s13 if int4 else w13
        s2 = s2 if int4 else w2
        h = torch.empty(cap, inter, dtype=x.dtype, device=x.device)
        rw = w.reshape(-1).contiguous()
        flags = dict(GROUP=group, INT4=int4, BLOCK_M=block, IEEE=ieee_dots(x),
                     RNE=rne_bf16(x.dtype, x.device), num_warps=4)
        bn1, bk1 = pow2_tile(inter, hi=block_n), pow2_tile(H, hi=block_k)
        kernel_for(_moe_gate_up_kernel, x.device)[(cap // block, triton.cdiv(inter, bn1))](
            x, w13, s13, h, sorted_ids, block_expert, num_padded,
            n, k,
            x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2),
            s13.stride(0), s13.stride(1), s13.stride(2), h.stride(0),
            K=H, INTER=inter, BLOCK_N=bn1, BLOCK_K=bk1, **flags,
        )
        bn2, bk2 = pow2_tile(H, hi=block_n), pow2_tile(inter, hi=block_k)
        kernel_for(_moe_down_kernel, x.device)[(cap // block, triton.cdiv(H, bn2))](
            h, w2, s2, y, rw, sorted_ids, block_expert, num_padded,
            n,
            h.stride(0), w2.stride(0), w2.stride(1), w2.stride(2),
            s2.stride(0), s2.stride(1), s2.stride(2), y.stride(0),
            K=inter, N=H, BLOCK_N=bn2, BLOCK_K=bk2, **flags,
        )
    return y.view(T, k, H).sum(1).to(x.dtype)


def moe_experts_triton(
    x: Tensor, idx: Tensor, w: Tensor, w13: Tensor, w2: Tensor, block: int = 16, *,
    block_n: int = 64, block_k: int = 64,
) -> Tensor:
    """Fused expert bank with float weights. `x [T, H]` (bf16/fp16/fp32), `idx/w [T, k]`,
    `w13 [E, 2I, H]` (gate rows then up rows), `w2 [E, H, I]` -> `[T, H]` in x's dtype.

    `block` (16..128, a power of two) is the alignment block and the row tile; `block_n` and
    `block_k` cap the column and reduction tiles.
    """
    return _fused_experts(x, idx, w, w13, None, w2, None, w13.shape[1] // 2, 1, block,
                          block_n, block_k)


def moe_experts_w4a16_triton(
    x: Tensor, idx: Tensor, w: Tensor, w13_packed: Tensor, w13_scale: Tensor,
    w2_packed: Tensor, w2_scale: Tensor, group_size: int = 32, block: int = 16, *,
    block_n: int = 64, block_k: int = 64,
) -> Tensor:
    """Fused expert bank over INT4 pack-quantized weights (W4A16, dequantized in the kernel).

    `x [T, H]`, `idx/w [T, k]`, `w13_packed [E, 2I, ceil(H/8)]` int32, `w13_scale [E, 2I,
    ceil(H/group)]`, `w2_packed [E, H, ceil(I/8)]` int32, `w2_scale [E, H, ceil(I/group)]`
    -> `[T, H]` in x's dtype.
    """
    if w13_packed.dtype != torch.int32 or w2_packed.dtype != torch.int32:
        raise TypeError("packed expert weights must be int32")
    return _fused_experts(x, idx, w, w13_packed, w13_scale, w2_packed, w2_scale,
                          w13_packed.shape[1] // 2, group_size, block, block_n, block_k)
