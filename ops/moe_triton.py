"""Triton fused expert bank over the static-shape alignment of `ops.moe.moe_align_block_size`.

`moe_experts_triton` (float weights, bf16/fp16/fp32), `moe_experts_w4a16_triton` (INT4
pack-quantized weights, dequantized in the kernel: W4A16) and `moe_experts_fp8_triton` (FP8
block weights, likewise) compute, for `x [T, H]` and routing `idx/w [T, k]`, `out[t] = sum_j
w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))` with `e = idx[t, j]`, in x's dtype. The
torch twins (same rounding points) are `ops.moe.experts_aligned`, `experts_aligned_w4a16` and
`experts_aligned_fp8`.

Design, as vLLM's fused MoE: one grouped GEMM kernel, `ops.quant_triton.dequant_gemm` in its
aligned mode, launched twice over the alignment's blocks (each block holds `BLOCK_M = block`
rows of one expert, its `block_expert` entry; the kernel reads that expert's weight tiles, plain,
INT4-unpacked or FP8-scaled, decodes each tile once for all the block's rows, and writes each
pair's row):

1. `x` rows gathered by token (`pair // k`) times `w13 [E, 2I, H]`, gated: a program computes
   a tile of gate columns and the matching up columns, and its epilogue applies `silu(gate) *
   up` in fp32, rounded once to x's dtype as the twin rounds -> `[T*k, I]` at the pair's row
   (no fp32 gate/up rows in memory).
2. Those rows (the pair's own, `top_k = 1`) times `w2 [E, H, I]` -> the pair's expert output
   rounded to x's dtype, `y [T*k, H]` at the pair's row (each pair appears once in the
   alignment, so no atomics): transformers' `expert(x)`, rounded where it rounds.
3. `_slot_sum_kernel`: each token's `sum_j w[t, j] * y[t, j]` in fp32, the k slots in slot
   order, rounded once to x's dtype: transformers' weighted sum of its experts' outputs; with
   `add` (the shared experts' output, which transformers adds to that sum), plus `add`,
   rounded again, in the same pass (two fewer passes over `[T, H]` than a separate add). NOTE:
   a token's k pairs sit in k different experts' blocks, so reducing them inside the GEMM
   needs float atomics, whose order (and so the output's bits) would change from run to run;
   the per-pair rows (in x's dtype: half the traffic of fp32 ones) keep the result
   reproducible and equal to the twin's.

The launch configuration follows the tokens (`ops.moe.expert_tiles`, unless `block` or `tiles`
pins it): 16-row blocks on the 2-D grid `(cap // block, cdiv(N, BLOCK_N))` for passes of up to
512 tokens (steps), 64- or 128-row blocks on a GROUP_M-swizzled flat grid with 8 warps and 3
pipeline stages above (prefill chunks; `wgmma` on sm_90a). Either grid depends on `(T, k, E)` and
the weight shapes only; a program whose block starts at or past `num_padded` returns at once,
so one CUDA graph serves every routing (graph-safe, no host sync). Padding rows (pair id `T*k`)
load zeros and store nothing; dropped pairs (ids outside `[0, E)`) get no row: no kernel writes
or reads their rows (left as allocated: `y` is never cleared, a write of `[T*k, H]` a layer
saved), and the slot sum counts them zero. INT4 and
FP8 tiles are rounded to x's dtype bit for bit as `ops.quant.dequant_int4` /
`dequant_fp8_block` with `dtype=x.dtype`, so a quantized bank gives the float kernel's bits on
the dequantized bank.
Kernel details (tiles, constexpr shapes) are in `ops.quant_triton`, the interpreter notes in
`ops.triton_util`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ops.moe import ExpertTiles, expert_tiles, moe_align_block_size
from ops.paged_grid import pow2_tile
from ops.quant_triton import dequant_gemm
from ops.triton_util import kernel_for, rne_bf16

SLOT_BLOCK = 1024  # hidden columns a program of `_slot_sum_kernel` sums


@triton.jit
def _slot_sum_kernel(y_ptr, w_ptr, idx_ptr, add_ptr, out_ptr, H, E, K: tl.constexpr,
                     BLOCK: tl.constexpr, ADD: tl.constexpr, RNE: tl.constexpr):
    """`out[t, cols] = sum_j w[t, j] * y[t * K + j, cols]` in fp32, j in order, over the slots
    whose expert `idx[t, j]` is in `[0, E)` (a dropped pair's row is never read), rounded once;
    with `ADD`, then `+ add[t, cols]` in fp32, rounded again."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    acc = tl.full([BLOCK], 0.0, tl.float32)
    for j in range(K):
        e = tl.load(idx_ptr + t * K + j)
        wj = tl.load(w_ptr + t * K + j).to(tl.float32)
        # a dropped pair reads no column (a scalar mask the interpreter cannot broadcast)
        width = tl.where((e >= 0) & (e < E), H, 0)
        yj = tl.load(y_ptr + (t * K + j) * H + cols, mask=cols < width, other=0.0)
        acc += wj * yj.to(tl.float32)
    if RNE:
        u = acc.to(tl.uint32, bitcast=True)
        acc = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    if ADD:
        acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        acc += tl.load(add_ptr + t * H + cols, mask=ok, other=0.0).to(tl.float32)
        if RNE:
            u = acc.to(tl.uint32, bitcast=True)
            acc = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def slot_sum(y: Tensor, w: Tensor, idx: Tensor, num_experts: int, dtype: torch.dtype,
             add: Tensor | None = None) -> Tensor:
    """`y [T, k, H]` (contiguous) weighted by `w [T, k]` and summed over the k slots in fp32 ->
    `[T, H]` in `dtype`: `ops.moe.weighted_slot_sum` in one launch. Slots whose expert `idx [T,
    k]` is outside `[0, num_experts)` count zero (their rows of `y` are never read: `y` need
    not be cleared). `add [T, H]` (the shared experts' output) is added to the rounded sum, as
    `weighted_slot_sum(...) + add` adds it, in the same launch."""
    T, k, H = y.shape
    out = torch.empty(T, H, dtype=dtype, device=y.device)
    if add is not None and (add.shape != (T, H) or add.dtype != dtype):
        raise ValueError(f"add {tuple(add.shape)} {add.dtype} must be [{T}, {H}] {dtype}")
    if T and H:
        block = min(SLOT_BLOCK, triton.next_power_of_2(H))
        kernel_for(_slot_sum_kernel, y.device)[(T, triton.cdiv(H, block))](
            y, w.float().contiguous(), idx.contiguous(),
            out if add is None else add.contiguous(), out, H, num_experts, K=k, BLOCK=block,
            ADD=add is not None, RNE=rne_bf16(dtype, y.device))
    return out


def _fused_experts(
    x: Tensor, idx: Tensor, w: Tensor, w13: Tensor, s13: Tensor | None, w2: Tensor,
    s2: Tensor | None, inter: int, fmt: str, scale_block: tuple[int, int], block: int,
    block_n: int, block_k: int, tiles: ExpertTiles | None, add: Tensor | None = None,
) -> Tensor:
    """Shared launcher for every weight format `fmt` of `dequant_gemm` ("plain", "int4", "fp8"
    as uint8 bytes), with scales `s13` / `s2` (None for plain) per `scale_block`. The launch
    configuration: `tiles` when given; else `block` with `block_n` / `block_k` on the plain
    grid (4 warps, 3 stages) when `block` is non-zero; else `ops.moe.expert_tiles(T)`. `add
    [T, H]`: added to the routed sum in its kernel (`slot_sum`). What it allocates beside its
    output: `ops.moe.fused_workspace_bytes`."""
    T, H = x.shape
    k = idx.shape[1]
    if tiles is None:
        tiles = ExpertTiles(block, block_n, block_k, 1, 4, 3) if block else expert_tiles(T)
    block = tiles.block_m
    if block < 16:
        raise ValueError(f"block must be at least 16 for tl.dot, got {block}")
    E = w13.shape[0]
    align = moe_align_block_size(idx, E, block)
    n = T * k
    # NOTE: not cleared: the down GEMM writes every routed pair's row, the sum skips the rest
    y = torch.empty(n, H, dtype=x.dtype, device=x.device)
    if align[0].shape[0] == 0:
        return slot_sum(y.view(T, k, H), w, idx, E, x.dtype, add)

    def gemm(a: Tensor, wt: Tensor, scale: Tensor | None, out: Tensor, gated: bool = False,
             **rows) -> None:
        # NOTE: a gated program decodes gate and up rows: half the columns keep its weight
        # tile at BLOCK_N rows.
        bn = pow2_tile(out.shape[1], hi=max(16, tiles.block_n // 2) if gated else tiles.block_n)
        dequant_gemm(a, wt, out, weight=fmt, scale=scale, scale_block=scale_block, align=align,
                     gated=gated, tiles=(block, bn, pow2_tile(a.shape[1], hi=tiles.block_k)),
                     group_m=tiles.group_m, num_warps=tiles.num_warps,
                     num_stages=tiles.num_stages, **rows)

    h = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    gemm(x, w13, s13, h, top_k=k, gated=True)
    gemm(h, w2, s2, y)
    return slot_sum(y.view(T, k, H), w, idx, E, x.dtype, add)


def moe_experts_triton(
    x: Tensor, idx: Tensor, w: Tensor, w13: Tensor, w2: Tensor, block: int = 0, *,
    block_n: int = 64, block_k: int = 64, tiles: ExpertTiles | None = None,
    add: Tensor | None = None,
) -> Tensor:
    """Fused expert bank with float weights. `x [T, H]` (bf16/fp16/fp32), `idx/w [T, k]`,
    `w13 [E, 2I, H]` (gate rows then up rows), `w2 [E, H, I]` -> `[T, H]` in x's dtype.

    `block` (16..128, a power of two) is the alignment block and the row tile; `block_n` and
    `block_k` cap the column and reduction tiles. `block = 0` (the default) takes the whole
    configuration from `ops.moe.expert_tiles` by the token count; `tiles` sets it outright.
    `add [T, H]` (x's dtype) is added to the result in the reduction's kernel (rounded as
    `result + add` rounds).
    """
    return _fused_experts(x, idx, w, w13, None, w2, None, w13.shape[1] // 2, "plain", (1, 1),
                          block, block_n, block_k, tiles, add)


def moe_experts_w4a16_triton(
    x: Tensor, idx: Tensor, w: Tensor, w13_packed: Tensor, w13_scale: Tensor,
    w2_packed: Tensor, w2_scale: Tensor, group_size: int = 32, block: int = 0, *,
    block_n: int = 64, block_k: int = 64, tiles: ExpertTiles | None = None,
    add: Tensor | None = None,
) -> Tensor:
    """Fused expert bank over INT4 pack-quantized weights (W4A16, dequantized in the kernel).

    `x [T, H]`, `idx/w [T, k]`, `w13_packed [E, 2I, ceil(H/8)]` int32, `w13_scale [E, 2I,
    ceil(H/group)]`, `w2_packed [E, H, ceil(I/8)]` int32, `w2_scale [E, H, ceil(I/group)]`
    -> `[T, H]` in x's dtype (plus `add`, as in `moe_experts_triton`).
    """
    if w13_packed.dtype != torch.int32 or w2_packed.dtype != torch.int32:
        raise TypeError("packed expert weights must be int32")
    return _fused_experts(x, idx, w, w13_packed, w13_scale, w2_packed, w2_scale,
                          w13_packed.shape[1] // 2, "int4", (1, group_size), block, block_n,
                          block_k, tiles, add)


def moe_experts_fp8_triton(
    x: Tensor, idx: Tensor, w: Tensor, w13: Tensor, w13_scale_inv: Tensor, w2: Tensor,
    w2_scale_inv: Tensor, scale_block: tuple[int, int] = (128, 128), block: int = 0, *,
    block_n: int = 64, block_k: int = 64, tiles: ExpertTiles | None = None,
    add: Tensor | None = None,
) -> Tensor:
    """Fused expert bank over FP8 block weights (dequantized in the kernel).

    `x [T, H]`, `idx/w [T, k]`, `w13 [E, 2I, H]` float8_e4m3fn (or its bytes as uint8),
    `w13_scale_inv [E, ceil(2I/b0), ceil(H/b1)]` fp32, `w2 [E, H, I]`, `w2_scale_inv [E,
    ceil(H/b0), ceil(I/b1)]` with `scale_block = (b0, b1)` -> `[T, H]` in x's dtype (plus
    `add`, as in `moe_experts_triton`).
    """
    w13b, w2b = (t if t.dtype == torch.uint8 else t.view(torch.uint8) for t in (w13, w2))
    return _fused_experts(x, idx, w, w13b, w13_scale_inv, w2b, w2_scale_inv, w13.shape[1] // 2,
                          "fp8", scale_block, block, block_n, block_k, tiles, add)
