"""Triton fused expert bank over the static-shape alignment of `ops.moe.moe_align_block_size`.

`moe_experts_triton` (float weights, bf16/fp16/fp32), `moe_experts_w4a16_triton` (INT4
pack-quantized weights, dequantized in the kernel: W4A16) and `moe_experts_fp8_triton` (FP8
block weights, likewise) compute, for `x [T, H]` and routing `idx/w [T, k]`, `out[t] = sum_j
w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))` with `e = idx[t, j]`, in x's dtype. The
torch twins (same rounding points) are `ops.moe.experts_aligned`, `experts_aligned_w4a16` and
`experts_aligned_fp8`.

Design, as vLLM's fused MoE: one grouped GEMM kernel, `ops.quant_triton.dequant_gemm` in its
aligned mode, launched twice over the alignment's blocks (`BLOCK_M = block`; each block holds
rows of one expert, its `block_expert` entry; the kernel reads that expert's weight tiles, plain,
INT4-unpacked or FP8-scaled, and writes each pair's row):

1. `x` rows gathered by token (`pair // k`) times `w13 [E, 2I, H]` -> the fp32 intermediate
   `[T*k, 2I]` (gate columns then up columns) at the pair's row.
2. In torch, `silu(gate) * up` from those fp32 values, rounded once to x's dtype -> `[T*k, I]`,
   exactly as the twin rounds.
3. Those rows (the pair's own, `top_k = 1`) times `w2 [E, H, I]`, times the pair's routing
   weight -> the fp32 `y [T*k, H]` at the pair's row (each pair appears once in the alignment,
   so no atomics); `y.view(T, k, H).sum(1)` then reduces the k slots in slot order,
   deterministically.

Both grids, `(cap // block, cdiv(N, BLOCK_N))`, depend on `(T, k, E, block)` and the weight
shapes only; a program whose block starts at or past `num_padded` returns at once, so one CUDA
graph serves every routing (graph-safe, no host sync). Padding rows (pair id `T*k`) load zeros
and store nothing; dropped pairs (ids outside `[0, E)`) get no row: no kernel writes or reads
their intermediate rows (left as allocated), and their rows of `y` stay zero. INT4 and FP8
tiles are rounded to x's dtype bit for bit as `ops.quant.dequant_int4` / `dequant_fp8_block`
with `dtype=x.dtype`, so a quantized bank gives the float kernel's bits on the dequantized bank.
Kernel details (tiles, constexpr shapes) are in `ops.quant_triton`, the interpreter notes in
`ops.triton_util`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ops.moe import moe_align_block_size
from ops.paged_grid import pow2_tile
from ops.quant_triton import dequant_gemm


def _fused_experts(
    x: Tensor, idx: Tensor, w: Tensor, w13: Tensor, s13: Tensor | None, w2: Tensor,
    s2: Tensor | None, inter: int, fmt: str, scale_block: tuple[int, int], block: int,
    block_n: int, block_k: int,
) -> Tensor:
    """Shared launcher for every weight format `fmt` of `dequant_gemm` ("plain", "int4", "fp8"
    as uint8 bytes), with scales `s13` / `s2` (None for plain) per `scale_block`. What it
    allocates beside its output: `ops.moe.fused_workspace_bytes`."""
    T, H = x.shape
    k = idx.shape[1]
    if block < 16:
        raise ValueError(f"block must be at least 16 for tl.dot, got {block}")
    align = moe_align_block_size(idx, w13.shape[0], block)
    n = T * k
    y = torch.zeros(n, H, dtype=torch.float32, device=x.device)
    if align[0].shape[0] == 0:
        return y.view(T, k, H).sum(1).to(x.dtype)

    def gemm(a: Tensor, wt: Tensor, scale: Tensor | None, out: Tensor, **rows) -> None:
        tiles = (block, pow2_tile(out.shape[1], hi=block_n), pow2_tile(a.shape[1], hi=block_k))
        dequant_gemm(a, wt, out, weight=fmt, scale=scale, scale_block=scale_block, align=align,
                     tiles=tiles, **rows)

    gate_up = torch.empty(n, 2 * inter, dtype=torch.float32, device=x.device)
    gemm(x, w13, s13, gate_up, top_k=k)
    h = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype)
    gemm(h, w2, s2, y, routed=w.reshape(-1).contiguous())
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
    return _fused_experts(x, idx, w, w13, None, w2, None, w13.shape[1] // 2, "plain", (1, 1),
                          block, block_n, block_k)


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
                          w13_packed.shape[1] // 2, "int4", (1, group_size), block, block_n,
                          block_k)


def moe_experts_fp8_triton(
    x: Tensor, idx: Tensor, w: Tensor, w13: Tensor, w13_scale_inv: Tensor, w2: Tensor,
    w2_scale_inv: Tensor, scale_block: tuple[int, int] = (128, 128), block: int = 16, *,
    block_n: int = 64, block_k: int = 64,
) -> Tensor:
    """Fused expert bank over FP8 block weights (dequantized in the kernel).

    `x [T, H]`, `idx/w [T, k]`, `w13 [E, 2I, H]` float8_e4m3fn (or its bytes as uint8),
    `w13_scale_inv [E, ceil(2I/b0), ceil(H/b1)]` fp32, `w2 [E, H, I]`, `w2_scale_inv [E,
    ceil(H/b0), ceil(I/b1)]` with `scale_block = (b0, b1)` -> `[T, H]` in x's dtype.
    """
    w13b, w2b = (t if t.dtype == torch.uint8 else t.view(torch.uint8) for t in (w13, w2))
    return _fused_experts(x, idx, w, w13b, w13_scale_inv, w2b, w2_scale_inv, w13.shape[1] // 2,
                          "fp8", scale_block, block, block_n, block_k)
