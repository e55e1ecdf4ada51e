"""How the paged Triton attention kernels (`ops.attention_triton`) cut their work: tiles,
key splits and the programs that have work, from shapes and lengths only. Pure Python (no
Triton): the launchers, the planner (`graphs.plan`'s attention programs) and the rehearsal
(the kernels' workspace) share it.

A launch's grid is `(kv_heads * row_tiles, bs, num_splits)`, fixed by shapes (so a CUDA graph
can capture it); each row cuts its own live length into the splits on the device
(`split_chunk`), so the programs with work grow with the context, not the page table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

# NOTE: about two waves of programs on a 132-SM H200; splits only add parallelism for small
# batches and never exceed the number of key tiles in the table. 64 splits give one query row
# of one request (plain decoding at batch 1) 64 programs once its context is 64 key tiles long.
TARGET_PROGRAMS = 264
MAX_SPLITS = 64
# NOTE: the per-split partials (fp32 outputs and LSEs) of one launch stay under this; a launch
# with many query rows needs no splits to fill the GPU anyway.
MAX_PARTIAL_BYTES = 16 << 20


def pow2_tile(n: int, lo: int = 16, hi: int | None = None) -> int:
    """The power of two covering `n`, at least `lo` (`tl.dot` needs 16) and at most `hi`."""
    p = 1 << (max(n, 1) - 1).bit_length()
    return max(lo, p if hi is None else min(p, hi))


def tile_config(dtype: torch.dtype, dv: int) -> tuple[int, int, int]:
    """`(max BLOCK_M, BLOCK_N, num_warps)` for a cache of `dtype` and value width `dv`.

    Chosen by compiling for sm_90a with Triton's bundled ptxas (no GPU needed; the test
    `test_kernels_compile_for_sm90_without_spills` keeps them honest): the largest tiles
    without register spills at the default 3 pipeline stages. 16-bit caches: MLA's 512-wide
    values 32 x 32 on 8 warps (185 registers, 84 KB shared), 128-wide heads 64 x 32 on 8
    warps, narrower 64 x 64 on 4. fp32 caches take IEEE FMA dots, which need more registers
    per element: 16 x 16 on 4 warps for 512, 32 x 32 on 8 for 128, 32 x 32 on 4 below."""
    block_dv = pow2_tile(dv)
    if dtype == torch.float32:
        if block_dv >= 256:
            return 16, 16, 4
        return (32, 32, 8) if block_dv >= 128 else (32, 32, 4)
    if block_dv >= 256:
        return 32, 32, 8
    return (64, 32, 8) if block_dv >= 128 else (64, 64, 4)


def kv_splits(bs: int, programs_per_split: int, capacity: int, block_n: int,
              num_splits: int | None = None, split_bytes: int = 0) -> int:
    """The grid's split count, from shapes only: enough splits that `bs * programs_per_split`
    programs per split reach `TARGET_PROGRAMS` (at most `MAX_SPLITS`), or `num_splits` when
    given; never more than the key tiles of the table's `capacity = W * page_size` tokens, nor
    (unless given) more than fit `MAX_PARTIAL_BYTES` at `split_bytes` of partials per split."""
    tiles = max(1, -(-capacity // block_n))
    if num_splits is None:
        num_splits = -(-TARGET_PROGRAMS // max(1, bs * programs_per_split))
        num_splits = min(num_splits, MAX_SPLITS, MAX_PARTIAL_BYTES // max(1, split_bytes))
    return max(1, min(num_splits, tiles))


def split_chunk(length: int, num_splits: int, block_n: int) -> int:
    """Tokens per split of a row whose live length is `length` (what the kernels compute on the
    device): `cdiv(length, num_splits)` rounded up to a whole `block_n`, at least one; the row's
    live splits are `cdiv(length, chunk) <= num_splits`."""
    per = -(-max(length, 0) // num_splits)
    return max(1, -(-per // block_n)) * block_n


def split_bytes(bs: int, rows: int, heads: int, dv: int) -> int:
    """Bytes of one split's partials (fp32 outputs and LSEs) in a launch over `bs` requests of
    `rows` query rows and `heads` query heads, values `dv` wide."""
    return bs * rows * heads * (dv + 1) * 4


class LaunchShape(NamedTuple):
    """A launch's grid `(kv_heads * row_tiles, bs, num_splits)` and the tiles its programs
    take: `block_m` query rows (the kernel's `BLOCK_M`) by `block_n` keys, on `num_warps`
    warps."""

    row_tiles: int
    num_splits: int
    block_n: int
    block_m: int
    num_warps: int


def launch_shape(bs: int, rows: int, heads: int, capacity: int, dtype: torch.dtype, *,
                 kv_heads: int, dv: int, num_splits: int | None, block_n: int | None
                 ) -> LaunchShape:
    """The `LaunchShape` of a launch over `bs` requests of `rows` query rows and `heads` query
    heads (`kv_heads` KV heads), values `dv` wide, in a cache of `dtype` whose page table
    covers `capacity` tokens (shared by the launcher and `programs_with_work`)."""
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not split into {kv_heads} KV heads")
    bm_max, bn, warps = tile_config(dtype, dv)
    block_n = block_n or bn
    per_kv_head = rows * (heads // kv_heads)  # the kernel's `M * G`
    block_m = pow2_tile(per_kv_head, hi=bm_max)
    row_tiles = -(-per_kv_head // block_m)
    S = kv_splits(bs, kv_heads * row_tiles, capacity, block_n, num_splits,
                  split_bytes(bs, rows, heads, dv))
    return LaunchShape(row_tiles, S, block_n, block_m, warps)


def programs_with_work(
    bs: int, rows: int, heads: int, ctx_len: Sequence[int], width: int, page_size: int,
    dtype: torch.dtype, *, kv_heads: int, dv: int, num_splits: int | None = None,
    block_n: int | None = None,
) -> int:
    """How many programs of one forward launch read keys (pure Python, no GPU needed).

    The launch covers `bs` requests of `rows` query rows each (MLA: tree queries `Q`; the
    drafter: block rows `M`) and `heads` query heads per rank, `kv_heads` KV heads (MLA: 1;
    the drafter: its KV heads per rank), values `dv` wide (MLA: `kv_lora_rank`; the drafter:
    `head_dim`), a cache of `dtype`, a page table `width` pages of `page_size` tokens wide.
    `ctx_len` lists the rows' live lengths (rows past its end are padding, length 0). Each
    request has `kv_heads * row_tiles` programs per live split, `cdiv(L, chunk)` live splits
    (`split_chunk`); a zero-length row's one program writes an empty result and reads nothing.
    `num_splits` / `block_n` as the launchers' test knobs. The grid itself is
    `kv_heads * row_tiles * bs * num_splits` programs whatever the lengths."""
    if len(ctx_len) > bs:
        raise ValueError(f"{len(ctx_len)} lengths for a batch of {bs}")
    capacity = width * page_size
    shape = launch_shape(bs, rows, heads, capacity, dtype, kv_heads=kv_heads, dv=dv,
                         num_splits=num_splits, block_n=block_n)
    live = 0
    for n in ctx_len:
        n = min(max(n, 0), capacity)
        live += -(-n // split_chunk(n, shape.num_splits, shape.block_n))
    return kv_heads * shape.row_tiles * live


def partial_bytes(bs: int, rows: int, heads: int, capacity: int, dtype: torch.dtype, *,
                  kv_heads: int, dv: int) -> int:
    """Bytes of the per-split partials (fp32 outputs and LSEs) a launch allocates beside its
    output: none with one split."""
    S = launch_shape(bs, rows, heads, capacity, dtype, kv_heads=kv_heads, dv=dv,
                     num_splits=None, block_n=None).num_splits
    return S * split_bytes(bs, rows, heads, dv) if S > 1 else 0
