"""Mixture of experts: noaux_tc routing and expert dispatch."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ops.quant import dequant_fp8_block, dequant_int4


def route_noaux_tc(
    router_logits: Tensor, bias: Tensor, top_k: int, n_group: int, topk_group: int,
    norm_topk_prob: bool, scaling: float,
) -> tuple[Tensor, Tensor]:
    """DeepSeek-V3 routing. `router_logits [T, E]` (fp32), `bias [E]` -> `(idx [T, k], w [T, k])`.

    Selection uses the biased sigmoid scores (group score = sum of a group's top-2); the weights
    are the unbiased scores at the chosen experts, normalized, times the scaling factor.
    """
    T, E = router_logits.shape
    s = router_logits.float().sigmoid()
    choice = s + bias.float()
    if n_group > 1:
        g = choice.view(T, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)  # [T, G]
        keep = torch.zeros_like(g).scatter_(1, g.topk(topk_group, dim=-1).indices, 1.0)
        keep = keep.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
        choice = choice.masked_fill(keep == 0, float("-inf"))
    idx = choice.topk(top_k, dim=-1).indices
    w = s.gather(1, idx)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return idx, w * scaling


def experts_dense(x: Tensor, idx: Tensor, w: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """Every expert on every token, combined with the routing weights (zero for unchosen experts).

    Fixed shapes and no data-dependent control flow, so it runs inside a CUDA graph and under
    fake tensors; it costs `E / k` times the routed FLOPs, in three large ops (one matmul for
    every expert's gate and up rows, one batched matmul down, one weighted sum).
    `x [T, H]`, `idx/w [T, k]`, `w13 [E, 2I, H]` (gate rows then up rows), `w2 [E, H, I]`.
    """
    E, I2, H = w13.shape
    T = x.shape[0]
    comb = torch.zeros(T, E, dtype=torch.float32, device=x.device)
    comb.scatter_add_(1, idx, w.float())
    h = F.linear(x, w13.reshape(E * I2, H)).view(T, E, I2).transpose(0, 1)  # [E, T, 2I]
    g, u = h.chunk(2, dim=-1)
    y = torch.bmm(F.silu(g) * u, w2.transpose(1, 2))  # [E, T, H]
    return (y.float() * comb.t()[..., None]).sum(0).to(x.dtype)


def experts_indexed(x: Tensor, idx: Tensor, w: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """Each token through its chosen experts only, at fixed shapes: matrix-vector products that
    index the expert weights (`w13[idx]`, `w2[idx]`) inside their reductions. Compiled by
    inductor, the index is a load inside the reduction's loop, so no gathered copy of the
    weights is ever made and a step reads only the chosen experts' rows; run eagerly it would
    copy `T * k` experts' weights (`engine.cpu.INDEXED_MAX_PAIRS` bounds where it runs).
    `x [T, H]`, `idx/w [T, k]`, `w13 [E, 2I, H]` (gate rows then up rows), `w2 [E, H, I]`.
    """
    h = (w13[idx] * x[:, None, None, :]).sum(-1)  # [T, k, 2I]
    g, u = h.chunk(2, dim=-1)
    y = (w2[idx] * (F.silu(g) * u)[..., None, :]).sum(-1)  # [T, k, H]
    return (y.float() * w[..., None].float()).sum(1).to(x.dtype)


def experts_sparse(x: Tensor, idx: Tensor, w: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """Each token only through its chosen experts (eager only: data-dependent shapes).

    Up to `GROUPED_MAX_PAIRS` (token, expert) pairs run as `experts_grouped` (two batched
    matmuls) unless routing is so skewed that its padding would pass `GROUPED_MAX_WASTE`;
    otherwise the pairs are sorted by expert once, so each expert runs on one contiguous slice,
    and the weighted outputs go back to their tokens with one `index_add_`.
    """
    if idx.numel() <= GROUPED_MAX_PAIRS:
        rank, cap = expert_ranks(idx, w13.shape[0])
        if w13.shape[0] * cap <= GROUPED_MAX_WASTE * idx.numel():
            return experts_grouped(x, idx, w, w13, w2, rank, cap)
    return experts_sparse_by(x, idx, w, w13.shape[0], lambda e: (w13[e], w2[e]))


# The grouped pass runs for at most this many (token, expert) pairs, padded to at most this many
# rows per pair. On a CPU its two batched matmuls beat per-expert dispatch (a handful of ops per
# expert) and, from a few tokens on, every expert on every token; past these bounds the sorted
# pass costs less. The padding bound only binds where experts are many (Kimi: 384, 8 a token).
GROUPED_MAX_PAIRS = 1024
GROUPED_MAX_WASTE = 4


def expert_ranks(idx: Tensor, num_experts: int) -> tuple[Tensor, int]:
    """Each pair's rank among its expert's pairs, in flat order (a running count per expert, no
    sort), and the most pairs one expert got (one host sync)."""
    hot = F.one_hot(idx.reshape(-1), num_experts)  # [T * k, E]
    rank = (hot.cumsum(0) * hot).sum(1) - 1
    return rank, int(rank.max()) + 1


def experts_grouped(x: Tensor, idx: Tensor, w: Tensor, w13: Tensor, w2: Tensor, rank: Tensor,
                    cap: int) -> Tensor:
    """Each token through its chosen experts in two batched matmuls over `[E, cap, H]`: pair
    `(t, j)` is row `rank` of expert `idx[t, j]` (`expert_ranks`), unused rows zero; the
    weighted outputs are summed per token in slot order."""
    T, k = idx.shape
    E, H = w13.shape[0], x.shape[1]
    dest = idx.reshape(-1) * cap + rank
    rows = x.new_zeros(E * cap, H).index_copy_(0, dest, x.repeat_interleave(k, 0))
    g, u = torch.bmm(rows.view(E, cap, H), w13.transpose(1, 2)).chunk(2, dim=-1)
    y = torch.bmm(F.silu(g) * u, w2.transpose(1, 2)).view(E * cap, H)
    ys = y.index_select(0, dest).float() * w.reshape(-1, 1).float()
    return ys.view(T, k, H).sum(1).to(x.dtype)


def experts_sparse_by(x: Tensor, idx: Tensor, w: Tensor, num_experts: int,
                      load: Callable[[int], tuple[Tensor, Tensor]]) -> Tensor:
    """The sorted pass of `experts_sparse`, each expert's `(w13 [2I, H], w2 [H, I])` from
    `load(e)`, called only for experts that have tokens (a packed bank dequantizes just those)."""
    T, k = idx.shape
    flat = idx.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    tok = order // k
    xs = x[tok]  # [T * k, H], grouped by expert
    parts, start = [], 0
    for e, n in enumerate(counts):
        if n:
            w13, w2 = load(e)
            g, u = F.linear(xs[start:start + n], w13).chunk(2, dim=-1)
            parts.append(F.linear(F.silu(g) * u, w2))
            start += n
    ys = torch.cat(parts).float() * w.reshape(-1)[order, None].float()
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, tok, ys).to(x.dtype)


# --- Static-shape expert alignment and the expert bank over it (the layout the Triton kernels
# in `ops.moe_triton` read; `ops.custom_ops` wraps both as torch custom ops). ---

# Expert weights one chunk of blocks may hold at once in `experts_aligned*` (the gathered copy
# plus its fp32 twin); chunks only bound memory, every chunk size gives the same result.
ALIGNED_CHUNK_BYTES = 1 << 28


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class ExpertTiles(NamedTuple):
    """One launch configuration of the grouped expert GEMMs (`ops.moe_triton`): the alignment
    block, which is also the row tile (`block_m`); caps on the column and reduction tiles
    (`block_n`, `block_k`); the row tiles a group of programs walks together (`group_m`; 1
    keeps the plain 2-D grid), and the launch's warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


# The expert GEMMs' configurations, keyed by the tokens one expert pass carries: `(most tokens,
# tiles)`, first match wins. Small passes (at most 512 tokens: the steps of small batches) keep
# 16-row blocks, as vLLM's tuned fused-MoE tables do up to 512 tokens. Larger passes (prefill
# chunks, steps of large batches) take 64-row blocks, as vLLM's H200 tables for E=384 and E=256
# do from about 1,536 tokens (BLOCK_N 128, BLOCK_K 128-256, GROUP_M 16, 3 stages): at sm_90a a
# 64-row `tl.dot` compiles to Hopper's `wgmma` where 16 rows give `mma.sync`, and each decoded
# weight tile serves four times the rows. Decoding INT4 in registers needs 8 warps at 128-wide
# tiles (4 spill), and BLOCK_K 64 keeps the pipelined INT4 words at 104 KB of shared memory
# (128: 208 KB, one program per SM). Chunks of 8k tokens and more take 128-row blocks, which
# read each expert's weights about once. `python -m graphs.kernels --arch sm_90a` compiles every
# entry the engine launches and reports its MMA, registers, spills and shared memory.
EXPERT_TILES: tuple[tuple[int | None, ExpertTiles], ...] = (
    (512, ExpertTiles(16, 64, 64, 1, 4, 3)),
    (8191, ExpertTiles(64, 128, 64, 16, 8, 3)),
    (None, ExpertTiles(128, 128, 64, 16, 8, 3)),
)


def expert_tiles(tokens: int) -> ExpertTiles:
    """The `EXPERT_TILES` entry for an expert pass over `tokens` tokens: fixed by the shape, so
    a captured step keeps one configuration on every replay."""
    for most, tiles in EXPERT_TILES:
        if most is None or tokens <= most:
            return tiles
    raise AssertionError("EXPERT_TILES ends with a catch-all entry")


def expert_block(tokens: int, block: int = 0) -> int:
    """The alignment block of an expert pass over `tokens` tokens: `block` when given (non-zero),
    else `expert_tiles(tokens).block_m`."""
    return block or expert_tiles(tokens).block_m


def moe_align_capacity(num_pairs: int, num_experts: int, block: int) -> int:
    """Rows of the aligned layout for `num_pairs = T * k` routed pairs: every pair plus at most
    `block - 1` padding rows for each non-empty expert, rounded up to a whole block.

    At most `min(E, num_pairs)` experts are non-empty, so this is the bound
    `round_up(T*k + E*(block-1), block)` of vLLM / SGLang tightened for few tokens (decode with
    `T = 1, k = 8, E = 384, block = 16`: 128 rows instead of 5776); it depends on shapes only.
    """
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    return _round_up(num_pairs + min(num_experts, num_pairs) * (block - 1), block)


def moe_align_block_size(topk_ids: Tensor, num_experts: int,
                         block: int) -> tuple[Tensor, Tensor, Tensor]:
    """Group the `T * k` (token, slot) pairs of `topk_ids [T, k]` by expert, each expert's run
    padded to a multiple of `block`, with output shapes fixed by `(T, k, E, block)` alone.

    Returns, with `N = T * k` and `cap = moe_align_capacity(N, E, block)`:

    - `sorted_ids [cap]` int64: flat pair indices `t * k + j`, expert 0's run first; within an
      expert, pairs keep increasing flat order (stable). Padding entries hold `N`.
    - `block_expert [cap // block]` int64: the expert of each block; `-1` for the unused
      trailing blocks (those at or past `num_padded`).
    - `num_padded [1]` int64: rows in use, `sum_e round_up(count_e, block)`.

    Ids outside `[0, E)` (for example `-1` for an expert held by another rank) get no row: the
    pair is dropped. No host syncs and no data-dependent shapes (runs under `FakeTensorMode`
    and inside CUDA graphs), so no `bincount` / `nonzero` / `repeat_interleave` on tensors.
    """
    E = num_experts
    n = topk_ids.numel()
    cap = moe_align_capacity(n, E, block)
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    # Bucket E collects the dropped ids; a stable sort keeps flat order within each bucket.
    key = torch.where((flat >= 0) & (flat < E), flat, torch.full_like(flat, E))
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:E] + (block - 1)) // block * block
    ends = padded.cumsum(0)  # [E]: end row of each expert's padded run
    order = torch.argsort(key, stable=True)
    skey = key[order]
    # Rank of each pair within its expert: its position in sorted order minus its bucket start.
    bucket_start = counts.cumsum(0) - counts
    rank = torch.arange(n, dtype=torch.int64, device=dev) - bucket_start[skey]
    run_start = torch.cat([ends - padded, torch.full((1,), cap, dtype=torch.int64, device=dev)])
    # Dropped pairs all land in the extra slot `cap`, cut off below.
    dest = torch.where(skey < E, run_start[skey] + rank, torch.full_like(rank, cap))
    sorted_ids = torch.full((cap + 1,), n, dtype=torch.int64, device=dev)
    sorted_ids.scatter_(0, dest, order)
    starts = torch.arange(0, cap, block, dtype=torch.int64, device=dev)
    owner = torch.searchsorted(ends, starts, right=True)  # E for blocks past the last run
    block_expert = torch.where(owner < E, owner, torch.full_like(owner, -1))
    num_padded = ends[-1:] if E > 0 else torch.zeros(1, dtype=torch.int64, device=dev)
    return sorted_ids[:cap], block_expert, num_padded


def _chunk_blocks(num_blocks: int, expert_values: int, itemsize: int,
                  chunk_blocks: int | None) -> int:
    if chunk_blocks is not None:
        return max(1, chunk_blocks)
    per_block = expert_values * (itemsize + 4)  # the gathered weights and their fp32 copy
    return max(1, min(num_blocks, ALIGNED_CHUNK_BYTES // max(per_block, 1)))


def _experts_over_blocks(
    x: Tensor, w: Tensor, sorted_ids: Tensor, block_expert: Tensor, top_k: int, block: int,
    load: Callable[[Tensor], tuple[Tensor, Tensor]], chunk: int,
) -> Tensor:
    """The expert bank over an alignment, one chunk of blocks at a time; `load(experts [C])`
    gives that chunk's `(w13 [C, 2I, H], w2 [C, H, I])`. Mirrors the Triton kernels' rounding
    (transformers' too): fp32 matmuls, `silu(g) * u` rounded to x's dtype once, each pair's
    expert output rounded to x's dtype, weighted by its routing weight in fp32 and summed over
    the k slots in slot order (`weighted_slot_sum`)."""
    T, H = x.shape
    n = T * top_k
    nb = block_expert.shape[0]
    # Padding entries hold n: they read the zero row T of x and land in the spare row n of y.
    xp = torch.cat([x, x.new_zeros(1, H)])
    y = torch.zeros(n + 1, H, dtype=x.dtype, device=x.device)
    ids = sorted_ids.view(nb, block)
    for c0 in range(0, nb, chunk):
        ids_c = ids[c0:c0 + chunk]
        # Unused trailing blocks (-1) hold only padding rows: any expert gives them zeros.
        w13c, w2c = load(block_expert[c0:c0 + chunk].clamp(min=0))
        xs = xp[ids_c // top_k].float()  # [C, block, H]
        g, u = torch.bmm(xs, w13c.float().transpose(1, 2)).chunk(2, dim=-1)
        a = (F.silu(g) * u).to(x.dtype).float()  # [C, block, I]
        o = torch.bmm(a, w2c.float().transpose(1, 2)).to(x.dtype)
        y.index_add_(0, ids_c.reshape(-1), o.reshape(-1, H))
    return weighted_slot_sum(y[:n].view(T, top_k, H), w)


def weighted_slot_sum(y: Tensor, w: Tensor) -> Tensor:
    """Each token's pair outputs `y [T, k, H]` weighted by `w [T, k]` and summed over the k
    slots in fp32 -> `[T, H]` in y's dtype (the torch twin of `ops.moe_triton.slot_sum`)."""
    return (y.float() * w.float().unsqueeze(-1)).sum(1).to(y.dtype)


def experts_aligned(
    x: Tensor, idx: Tensor, w: Tensor, w13: Tensor, w2: Tensor, block: int = 16,
    chunk_blocks: int | None = None,
) -> Tensor:
    """The routed expert bank over `moe_align_block_size`, with static shapes (no host syncs;
    runs under `FakeTensorMode` and in CUDA graphs): the torch twin of the Triton kernel.

    `x [T, H]`, `idx/w [T, k]` (ids outside `[0, E)` are dropped), `w13 [E, 2I, H]` (gate rows
    then up rows), `w2 [E, H, I]` -> `[T, H]` in x's dtype, `sum_k w * down(silu(gate(x)) *
    up(x))` with fp32 matmuls. Each block gathers only its own expert's weights, `chunk_blocks`
    blocks at a time (default: as many as fit `ALIGNED_CHUNK_BYTES`). It computes all
    `moe_align_capacity` rows, padding included.
    """
    T, k = idx.shape
    E, I2, H = w13.shape
    sorted_ids, block_expert, _ = moe_align_block_size(idx, E, block)
    chunk = _chunk_blocks(block_expert.shape[0], I2 * H + H * (I2 // 2), w13.element_size(),
                          chunk_blocks)
    return _experts_over_blocks(x, w, sorted_ids, block_expert, k, block,
                                lambda e: (w13[e], w2[e]), chunk)


def pick_experts(bank: Tensor, experts: Tensor | int | None) -> Tensor:
    """`experts` of a stacked `bank [E, ...]` -> `[C, ...]`: an index tensor `[C]` gathers, an
    int `e` slices (`C = 1`, no index tensor to build or copy to the device), None keeps all."""
    if experts is None:
        return bank
    if isinstance(experts, int):
        return bank[experts:experts + 1]
    return bank[experts]


def dequant_experts_int4(packed: Tensor, scale: Tensor, experts: Tensor | int | None, cols: int,
                         group: int, dtype: torch.dtype) -> Tensor:
    """Dequantize only `experts` (see `pick_experts`) of an INT4 bank `packed [E, rows,
    ceil(cols/8)]`, `scale [E, rows, ceil(cols/group)]` -> `[C, rows, cols]`, through
    `dequant_int4` (so bit for bit what dequantizing the whole bank gives)."""
    p, s = pick_experts(packed, experts), pick_experts(scale, experts)
    c, rows = p.shape[:2]
    q = dequant_int4(p.reshape(c * rows, -1), s.reshape(c * rows, -1), (c * rows, cols), group,
                     dtype)
    return q.view(c, rows, cols)


def dequant_experts_fp8(w: Tensor, scale_inv: Tensor, experts: Tensor | int | None,
                        scale_block: tuple[int, int], dtype: torch.dtype) -> Tensor:
    """Dequantize only `experts` (see `pick_experts`) of an FP8 block bank `w [E, rows, cols]`
    float8_e4m3fn, `scale_inv [E, ceil(rows/b0), ceil(cols/b1)]` -> `[C, rows, cols]`, through
    `dequant_fp8_block` (bit for bit what it gives on each expert): the row blocks are expanded
    per expert here, so the experts stack into one `[C * rows, cols]` matrix of `(1, b1)`
    blocks, whatever `rows % b0`."""
    q, s = pick_experts(w, experts), pick_experts(scale_inv, experts)
    c, rows, cols = q.shape
    s = s.repeat_interleave(scale_block[0], dim=1)[:, :rows]  # [C, rows, ceil(cols/b1)]
    return dequant_fp8_block(q.reshape(c * rows, cols), s.reshape(c * rows, -1),
                             (1, scale_block[1]), dtype).view(c, rows, cols)


def experts_aligned_w4a16(
    x: Tensor, idx: Tensor, w: Tensor, w13_packed: Tensor, w13_scale: Tensor,
    w2_packed: Tensor, w2_scale: Tensor, group_size: int = 32, block: int = 16,
    chunk_blocks: int | None = None,
) -> Tensor:
    """`experts_aligned` over an INT4 pack-quantized bank (`ops.quant.dequant_int4` format:
    lowest nibble first, code `q + 8`, symmetric, one scale per `group_size` input columns).

    `x [T, H]`, `idx/w [T, k]`, `w13_packed [E, 2I, ceil(H/8)]` int32, `w13_scale [E, 2I,
    ceil(H/group)]`, `w2_packed [E, H, ceil(I/8)]` int32, `w2_scale [E, H, ceil(I/group)]` ->
    `[T, H]` in x's dtype. Weights stay packed: each chunk dequantizes (to x's dtype, as W4A16
    does) only the experts of its blocks. Bit for bit `experts_aligned` on the dequantized bank
    (elementwise dequantization, then the same ops on the same shapes).
    """
    T, k = idx.shape
    H = x.shape[1]
    E, I2 = w13_packed.shape[:2]
    inter = I2 // 2
    sorted_ids, block_expert, _ = moe_align_block_size(idx, E, block)
    chunk = _chunk_blocks(block_expert.shape[0], I2 * H + H * inter, x.element_size(),
                          chunk_blocks)

    def load(e: Tensor) -> tuple[Tensor, Tensor]:
        return (dequant_experts_int4(w13_packed, w13_scale, e, H, group_size, x.dtype),
                dequant_experts_int4(w2_packed, w2_scale, e, inter, group_size, x.dtype))

    return _experts_over_blocks(x, w, sorted_ids, block_expert, k, block, load, chunk)


def experts_aligned_fp8(
    x: Tensor, idx: Tensor, w: Tensor, w13: Tensor, w13_scale_inv: Tensor, w2: Tensor,
    w2_scale_inv: Tensor, scale_block: tuple[int, int] = (128, 128), block: int = 16,
    chunk_blocks: int | None = None,
) -> Tensor:
    """`experts_aligned` over an FP8 block bank (`ops.quant.dequant_fp8_block` format: `W = w *
    scale_inv` per `scale_block = (b0, b1)` block of each expert's matrix).

    `x [T, H]`, `idx/w [T, k]`, `w13 [E, 2I, H]` float8_e4m3fn, `w13_scale_inv [E,
    ceil(2I/b0), ceil(H/b1)]` fp32, `w2 [E, H, I]` float8_e4m3fn, `w2_scale_inv [E,
    ceil(H/b0), ceil(I/b1)]` -> `[T, H]` in x's dtype. As `experts_aligned_w4a16`: each chunk
    dequantizes (to x's dtype) only the experts of its blocks, and the result is bit for bit
    `experts_aligned` on the dequantized bank.
    """
    T, k = idx.shape
    H = x.shape[1]
    E, I2 = w13.shape[:2]
    sorted_ids, block_expert, _ = moe_align_block_size(idx, E, block)
    chunk = _chunk_blocks(block_expert.shape[0], I2 * H + H * (I2 // 2), x.element_size(),
                          chunk_blocks)

    def load(e: Tensor) -> tuple[Tensor, Tensor]:
        return (dequant_experts_fp8(w13, w13_scale_inv, e, scale_block, x.dtype),
                dequant_experts_fp8(w2, w2_scale_inv, e, scale_block, x.dtype))

    return _experts_over_blocks(x, w, sorted_ids, block_expert, k, block, load, chunk)


def moe_flops(T: int, k: int, E: int, H: int, I: int, block: int) -> tuple[int, int]:  # noqa: E741
    """`(useful, executed)` matmul FLOPs of the routed expert bank (SiLU and weighting left out).

    `useful = 2 * T*k * (2I*H + H*I)`: what `FlopCounterMode` counts for the `kimi::moe_experts*`
    ops (padding excluded). `executed` adds the block padding at its worst case,
    `moe_align_capacity(T*k, E, block)` rows: what the torch twin computes every call and the
    most the fixed Triton grid runs (it skips blocks past `num_padded` at run time).
    """
    per_row = 2 * (2 * I * H + H * I)
    return T * k * per_row, moe_align_capacity(T * k, E, block) * per_row


def expected_aligned_rows(T: int, k: int, E: int, block: int) -> int:
    """Rows of the alignment in use (`num_padded`) on average when each of `T` tokens picks `k`
    distinct experts of `E` uniformly: each expert receives `c ~ Binomial(T, k / E)` pairs,
    padded up to a whole block, `E * E[ceil(c / block) * block]`. What the Triton grid computes
    (it skips the blocks past `num_padded`), for a cost model: Kimi's router balances its
    experts' loads (its correction bias); an uneven batch moves this little, each expert's
    padding being under one block either way. At most `moe_align_capacity`, the worst case."""
    if T <= 0 or k <= 0:
        return 0
    p = min(1.0, k / E)
    if p == 1.0:
        return E * _round_up(T, block)
    c = torch.arange(T + 1, dtype=torch.float64)
    log_pmf = (math.lgamma(T + 1) - torch.lgamma(c + 1) - torch.lgamma(T - c + 1)
               + c * math.log(p) + (T - c) * math.log1p(-p))
    padded = torch.div(c + block - 1, block, rounding_mode="floor") * block
    rows = round(E * float((log_pmf.exp() * padded).sum()))
    return min(rows, moe_align_capacity(T * k, E, block))


def fused_workspace_bytes(T: int, k: int, H: int, inter: int, act_bytes: int) -> int:
    """Bytes the grouped Triton expert kernels (`ops.moe_triton._fused_experts`) allocate
    beside their output for `T` tokens of `k` experts each, hidden `H`, expert width `inter`:
    every (token, expert) pair's output row and its activation row, both in the input's dtype
    (`act_bytes`; the gate and up GEMM applies SiLU in its epilogue, so no gate/up rows)."""
    return T * k * (H + inter) * act_bytes


def moe_bytes(T: int, k: int, E: int, H: int, I: int, *, weights: str = "bf16",  # noqa: E741
              act_bytes: int = 2, group_size: int = 32, scale_bytes: int = 2,
              scale_block: tuple[int, int] = (128, 128), block: int = 16,
              rows: int | None = None) -> dict[str, int]:
    """Bytes the expert op moves, as stored, for a cost model.

    `weights`: "int4" (packed int32 words, 0.5 B a value, plus `scale_bytes` per group scale),
    "fp8" (1 B a value, plus an fp32 scale per `scale_block` block of each matrix), or "bf16" /
    "fp16" / "fp32". Weights are read for at most `min(E, T*k)` distinct experts, each once.
    `activations`: x read, output written, `idx` (int64) and `w` (fp32) read. `scratch`: the
    Triton path's intermediate `[rows, I]` (x's dtype; `rows` the alignment's rows in use,
    default its capacity) and the per-pair output rows `[T*k, H]` (x's dtype), each written
    once and read once.
    `total` is the sum of the three.
    """
    experts = min(E, T * k)
    if weights == "int4":
        per = 4 * (2 * I * -(-H // 8) + H * -(-I // 8))
        per += scale_bytes * (2 * I * -(-H // group_size) + H * -(-I // group_size))
    elif weights == "fp8":
        b0, b1 = scale_block
        per = 3 * I * H + 4 * (-(-2 * I // b0) * -(-H // b1) + -(-H // b0) * -(-I // b1))
    else:
        per = 3 * I * H * {"bf16": 2, "fp16": 2, "fp32": 4}[weights]
    w_bytes = experts * per
    act = 2 * T * H * act_bytes + T * k * (8 + 4)
    if rows is None:
        rows = moe_align_capacity(T * k, E, block)
    scratch = 2 * rows * I * act_bytes + 2 * T * k * H * act_bytes
    return {"experts": experts, "weights": w_bytes, "activations": act, "scratch": scratch,
            "total": w_bytes + act + scratch}
