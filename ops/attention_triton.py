"""Triton kernels for attention over a paged cache whose work follows each row's real length.

Two passes share one kernel (`_paged_attn_fwd`): both are "a group of query rows that share
one key/value head, against the committed context of their request, read through the page
table":

- `mla_prefix_attention`: the absorbed MLA prefix pass (`ops.attention.prefix_attention`): one
  key head of width `R + P` (`c_kv` then roped `k_pe`), the value is `c_kv` itself (the key
  tile already loaded is reused), and every (tree query, head) pair of a request is one row.
- `draft_context_attention`: the drafter's grouped-query attention over its paged context:
  key/value head `j` serves query heads `j * G .. j * G + G - 1` (`G = nh // kvh`), so the
  rows of one program are (block row, head in group) pairs of one KV head.

Both return the output in fp32 and the natural-log LSE, so the caller merges them with the
tree pass or the drafter's in-block pass (`ops.attention.merge_states`). The torch twins with
the same signatures are in `ops.paged`.

Design (split-KV by each row's live length, fixed grid, early exit):

- Grid `(kv_heads * row_tiles, bs, num_splits)`, fixed by shapes only: `row_tiles =
  cdiv(rows, BLOCK_M)`, and `num_splits` chosen on the host from shapes alone (`kv_splits`:
  enough programs to fill a GPU when `bs * row_tiles` is small, one when the rows fill it), so
  one CUDA graph serves every mix of lengths.
- Each row cuts its OWN live length `L = min(ctx_len[b], W * page_size)`, read on the device,
  into the splits: `chunk = max(1, cdiv(cdiv(L, num_splits), BLOCK_N)) * BLOCK_N` tokens, so
  the `cdiv(L, chunk)` live splits (at most `num_splits`) grow with the context whatever the
  table's capacity (`split_chunk` is the host's mirror; `programs_with_work` counts them).
- Program `(tile, b, s)` runs an online-softmax loop (base-2 exponentials, fp32 accumulators)
  over key tiles of `BLOCK_N` tokens from `s * chunk` to `min((s + 1) * chunk, L)`: each
  token's page comes from the page table and its slot is `page * page_size + pos %
  page_size`, so pages need not be contiguous, partial pages and contexts ending anywhere are
  masked loads, and no key past `ctx_len` is read. A split whose chunk starts at or past `L`
  returns at once without touching memory; split 0 always writes (a zero-length row writes
  output 0 and LSE -inf).
- With one split the kernel writes the final output. Otherwise it writes per-split partials
  `[S, bs, M, heads, DV]` (normalized) and LSEs, and `_merge_splits` (grid `(row_tiles, bs)`)
  combines only the live splits `cdiv(L, chunk)` of each row by log-sum-exp. The partials are
  at most `MAX_PARTIAL_BYTES` (`num_splits` shrinks to fit; a prefill chunk of thousands of
  query rows fills the GPU with one split and allocates no partials beyond its output).
- Dots take the cache's dtype on a GPU (bf16/fp16 tiles, probabilities rounded to it, fp32
  accumulation); fp32 caches use IEEE fp32 dots, so fp32 runs match the torch twin tightly.
  Tiles are powers of two, `>= 16` on every `tl.dot` dimension, sized by `tile_config`
  (largest without register spills on sm_90a); widths that are not powers of two (or below
  16) are padded and masked.

Interpreter: on CPU tensors the kernels run under Triton's interpreter whatever
`TRITON_INTERPRET` said at import (`ops.triton_util.kernel_for`; the limits are listed there):
the kernels call no `@jit` function of `triton.language.standard` (`tl.max`, `tl.sum`, ...;
they reduce with `tl.reduce` and its combine functions), and on the CPU the (already rounded)
16-bit tiles are widened to fp32 before each dot (`ops.triton_util.ieee_dots`).

Accepted index dtypes: `page_table` int32 or int64 (any strides), `ctx_len` int32 or int64.
Graph-safe: no host sync, outputs and partials have shape-only sizes.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from ops.paged_grid import (  # noqa: F401 - the launch geometry, re-exported
    MAX_PARTIAL_BYTES,
    MAX_SPLITS,
    TARGET_PROGRAMS,
    LaunchShape,
    kv_splits,
    launch_shape,
    pow2_tile,
    programs_with_work,
    split_chunk,
    tile_config,
)
from ops.triton_util import ieee_dots
from ops.triton_util import kernel_for as _kernel_for

LOG2E = 1.4426950408889634
# NOTE: the kernels reduce with `tl.reduce` and these combine functions (what `tl.max` /
# `tl.sum` reduce with) instead of calling those `@jit` functions, which the interpreter cannot
# call unless triton was imported under `TRITON_INTERPRET=1` (`ops.triton_util`); it
# recognizes these two combine functions and reduces with numpy.
_MAX = tl.standard._elementwise_max
_SUM = tl.standard._sum_combine
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _paged_attn_fwd(
    qa_ptr, qb_ptr, kv_ptr, pt_ptr, len_ptr, o_ptr, lse_ptr,
    sqa_b, sqa_m, sqa_h, sqb_b, sqb_m, sqb_h,
    s_slot, s_pt_b, s_pt_w,
    M, NH, W, BS, num_splits, qk_scale,
    a_off, b_off, v_off, head_stride,
    G: tl.constexpr, PAGE_SIZE: tl.constexpr,
    DA: tl.constexpr, DB: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_B: tl.constexpr, V_IS_A: tl.constexpr, DOT_T: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """One (KV head, row tile) of request `b` against context chunk `s`.

    Rows `r = m * G + g` (block row / tree query `m`, head `g` of the group) use query head
    `h = j * G + g`. Key columns of KV head `j` start at `a_off + j * head_stride` (`DA` wide)
    and, when `HAS_B`, `b_off` (`DB` wide, shared by all heads: MLA's `k_pe`); values at
    `v_off + j * head_stride` (`DV` wide), or the part-A tile itself when `V_IS_A`.
    Output `o_ptr` is `[S, BS, M, NH, DV]` contiguous, `lse_ptr` `[S, BS, M, NH]`; the
    row's length `L` is cut into `num_splits` chunks of `chunk` tokens (`split_chunk`).
    """
    pid = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    rows = M * G
    row_tiles = (rows + BLOCK_M - 1) // BLOCK_M
    j = pid // row_tiles
    tile = pid % row_tiles

    length = tl.minimum(tl.load(len_ptr + b).to(tl.int32), W * PAGE_SIZE)
    # NOTE: the chunk follows this row's live length, not the table's capacity, so the live
    # splits grow with the context while the grid stays fixed (`split_chunk` mirrors it).
    chunk = tl.maximum((length + num_splits - 1) // num_splits + BLOCK_N - 1, BLOCK_N)
    chunk = chunk // BLOCK_N * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, length)
    # NOTE: the early exit: a chunk past the row's length does nothing; split 0 always writes.
    if (split > 0) & (lo >= hi):
        return

    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < rows
    m = r // G
    h = j * G + r % G
    da = tl.arange(0, BLOCK_DA)
    dv = tl.arange(0, BLOCK_DV)
    b64 = b.to(tl.int64)

    qa = tl.load(qa_ptr + b64 * sqa_b + m[:, None] * sqa_m + h[:, None] * sqa_h + da[None, :],
                 mask=row_ok[:, None] & (da < DA)[None, :], other=0.0)
    qa = qa.to(kv_ptr.dtype.element_ty).to(DOT_T)
    if HAS_B:
        db = tl.arange(0, BLOCK_DB)
        qb = tl.load(qb_ptr + b64 * sqb_b + m[:, None] * sqb_m + h[:, None] * sqb_h + db[None, :],
                     mask=row_ok[:, None] & (db < DB)[None, :], other=0.0)
        qb = qb.to(kv_ptr.dtype.element_ty).to(DOT_T)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_DV], 0.0, dtype=tl.float32)
    col_a = a_off + j * head_stride
    col_v = v_off + j * head_stride
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        page = tl.load(pt_ptr + b64 * s_pt_b + (n // PAGE_SIZE) * s_pt_w, mask=n_ok, other=0)
        row = (page.to(tl.int64) * PAGE_SIZE + n % PAGE_SIZE) * s_slot
        ka = tl.load(kv_ptr + row[:, None] + col_a + da[None, :],
                     mask=n_ok[:, None] & (da < DA)[None, :], other=0.0)
        s = tl.dot(qa, tl.trans(ka.to(DOT_T)), input_precision=DOT_PREC)
        if HAS_B:
            kb = tl.load(kv_ptr + row[:, None] + b_off + db[None, :],
                         mask=n_ok[:, None] & (db < DB)[None, :], other=0.0)
            s += tl.dot(qb, tl.trans(kb.to(DOT_T)), input_precision=DOT_PREC)
        s = tl.where(n_ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
        if V_IS_A:
            v = ka
        else:
            v = tl.load(kv_ptr + row[:, None] + col_v + dv[None, :],
                        mask=n_ok[:, None] & (dv < DV)[None, :], other=0.0)
        # NOTE: probabilities are rounded to the cache dtype (the GPU's 16-bit dot) on every path.
        pv = tl.dot(p.to(v.dtype).to(DOT_T), v.to(DOT_T), input_precision=DOT_PREC)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    live = l_i > 0.0
    out = acc / tl.where(live, l_i, 1.0)[:, None]
    lse = tl.where(live, (m_i + tl.log2(tl.where(live, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    orow = ((split * BS + b).to(tl.int64) * M + m) * NH + h
    tl.store(o_ptr + orow[:, None] * DV + dv[None, :], out,
             mask=row_ok[:, None] & (dv < DV)[None, :])
    tl.store(lse_ptr + orow, lse, mask=row_ok)


@triton.jit
def _merge_splits(
    part_ptr, plse_ptr, len_ptr, o_ptr, lse_ptr,
    ROWS, BS, cap, num_splits, block_n,
    DV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Log-sum-exp merge of the live splits of request `b`: partials `[S, BS, ROWS, DV]`,
    `[S, BS, ROWS]` -> `o_ptr [BS, ROWS, DV]`, `lse_ptr [BS, ROWS]` (natural log). The live
    splits are those `_paged_attn_fwd` gave work for the row's length (`split_chunk`)."""
    tile = tl.program_id(0)
    b = tl.program_id(1)
    r = tile * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < ROWS
    dv = tl.arange(0, BLOCK_DV)
    mask = r_ok[:, None] & (dv < DV)[None, :]
    length = tl.minimum(tl.load(len_ptr + b).to(tl.int32), cap)
    chunk = tl.maximum((length + num_splits - 1) // num_splits + block_n - 1, block_n)
    chunk = chunk // block_n * block_n
    n_live = tl.maximum((length + chunk - 1) // chunk, 1)
    b64 = b.to(tl.int64)

    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    for s in range(0, n_live):
        ls = tl.load(plse_ptr + (s * BS + b64) * ROWS + r, mask=r_ok, other=float("-inf"))
        m = tl.maximum(m, ls)
    # NOTE: a zero-length row has one live split with LSE -inf: weights 0, output 0, LSE -inf.
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    l_sum = tl.full([BLOCK_R], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_R, BLOCK_DV], 0.0, dtype=tl.float32)
    for s in range(0, n_live):
        row = (s * BS + b64) * ROWS + r
        ls = tl.load(plse_ptr + row, mask=r_ok, other=float("-inf"))
        w = tl.exp(ls - m_safe)
        o = tl.load(part_ptr + row[:, None] * DV + dv[None, :], mask=mask, other=0.0)
        acc += w[:, None] * o
        l_sum += w
    live = l_sum > 0.0
    out = acc / tl.where(live, l_sum, 1.0)[:, None]
    lse = tl.where(live, m_safe + tl.log(tl.where(live, l_sum, 1.0)), float("-inf"))
    orow = b64 * ROWS + r
    tl.store(o_ptr + orow[:, None] * DV + dv[None, :], out, mask=mask)
    tl.store(lse_ptr + orow, lse, mask=r_ok)


def fwd_meta(
    dtype: torch.dtype, device_type: str, launch: LaunchShape, *, group: int, page_size: int,
    da: int, db: int, dv: int, v_is_a: bool,
) -> dict[str, Any]:
    """The constexprs of `_paged_attn_fwd` for a cache of `dtype` on `device_type`, tiled as
    `launch` (`launch_shape`'s), `group` query heads per KV head, part widths `da`, `db` (0:
    none), value width `dv` (shared by the launchers and the sm_90 compile test)."""
    # NOTE: triton 3.9.0's interpreter multiplies bf16 dot operands as their raw uint16 bits;
    # on the CPU the (already rounded) 16-bit tiles are widened to fp32 for the dot, which is
    # exact: the interpreter reproduces the GPU's 16-bit dot up to summation order.
    if ieee_dots(dtype, device_type):
        dot_t, prec = tl.float32, "ieee"
    else:
        dot_t, prec = _TL_DTYPES[dtype], "tf32"
    return dict(
        G=group, PAGE_SIZE=page_size, DA=da, DB=db, DV=dv,
        BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
        BLOCK_DA=pow2_tile(da), BLOCK_DB=pow2_tile(max(db, 1)), BLOCK_DV=pow2_tile(dv),
        HAS_B=db > 0, V_IS_A=v_is_a, DOT_T=dot_t, DOT_PREC=prec)


def _paged_attention(
    qa: Tensor, qb: Tensor | None, cache: Tensor, page_table: Tensor, ctx_len: Tensor,
    page_size: int, scale: float, *, kv_heads: int, a_off: int, b_off: int, v_off: int,
    head_stride: int, dv: int, v_is_a: bool, num_splits: int | None, block_n: int | None,
) -> tuple[Tensor, Tensor]:
    """Shared launcher: `qa [bs, M, NH, DA]`, optional `qb [bs, M, NH, DB]` -> output
    `[bs, M, NH, dv]` fp32 and LSE `[bs, M, NH]` fp32 (natural log). Beyond those it
    allocates only the split partials, `S * bs * M * NH * (dv + 1)` fp32 when `S > 1`."""
    bs, M, NH, DA = qa.shape
    if qa.stride(-1) != 1:
        qa = qa.contiguous()
    if qb is not None and qb.stride(-1) != 1:
        qb = qb.contiguous()
    if cache.dim() != 2 or cache.stride(-1) != 1:
        raise ValueError(f"cache must be [num_slots, D] with unit last stride, got "
                         f"{tuple(cache.shape)} strides {cache.stride()}")
    if page_table.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"page_table must be int32 or int64, got {page_table.dtype}")
    if ctx_len.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"ctx_len must be int32 or int64, got {ctx_len.dtype}")
    W = page_table.shape[1]
    launch = launch_shape(bs, M, NH, W * page_size, cache.dtype, kv_heads=kv_heads, dv=dv,
                          num_splits=num_splits, block_n=block_n)
    S = launch.num_splits
    dev = qa.device
    meta = fwd_meta(cache.dtype, dev.type, launch, group=NH // kv_heads, page_size=page_size,
                    da=DA, db=qb.shape[-1] if qb is not None else 0, dv=dv, v_is_a=v_is_a)
    part = torch.empty(S, bs, M, NH, dv, dtype=torch.float32, device=dev)
    plse = torch.empty(S, bs, M, NH, dtype=torch.float32, device=dev)
    qb_ = qb if qb is not None else qa
    _kernel_for(_paged_attn_fwd, dev)[(kv_heads * launch.row_tiles, bs, S)](
        qa, qb_, cache, page_table, ctx_len, part, plse,
        qa.stride(0), qa.stride(1), qa.stride(2), qb_.stride(0), qb_.stride(1), qb_.stride(2),
        cache.stride(0), page_table.stride(0), page_table.stride(1),
        M, NH, W, bs, S, scale * LOG2E,
        a_off, b_off, v_off, head_stride, **meta, num_warps=launch.num_warps)
    if S == 1:
        return part[0], plse[0]
    out = torch.empty(bs, M, NH, dv, dtype=torch.float32, device=dev)
    lse = torch.empty(bs, M, NH, dtype=torch.float32, device=dev)
    rows = M * NH
    block_dv = meta["BLOCK_DV"]
    block_r = pow2_tile(rows, 1, min(4096 // block_dv, 64))
    _kernel_for(_merge_splits, dev)[(triton.cdiv(rows, block_r), bs)](
        part, plse, ctx_len, out, lse, rows, bs, W * page_size, S, launch.block_n,
        DV=dv, BLOCK_R=block_r, BLOCK_DV=block_dv, num_warps=4)
    return out, lse


def mla_prefix_attention(
    q_lat: Tensor, q_pe: Tensor, kv_cache: Tensor, page_table: Tensor, ctx_len: Tensor,
    page_size: int, scale: float, *, num_splits: int | None = None, block_n: int | None = None,
) -> tuple[Tensor, Tensor]:
    """`ops.attention.prefix_attention` read through the page table, work bounded by `ctx_len`.

    `q_lat [bs, Q, H, R]`, `q_pe [bs, Q, H, P]` (any float dtype; cast to the cache's for the
    dots), `kv_cache [num_slots, R + P]` (one layer, unit last stride), `page_table [bs, W]`
    int32/int64, `ctx_len [bs]` int32/int64 (keys are positions `< min(ctx_len, W *
    page_size)`). Returns the latent output `[bs, Q, H, R]` fp32 and LSE `[bs, Q, H]` fp32
    (natural log); rows with no key give output 0 and LSE -inf. The keyword-only knobs
    override the shape-derived split count and key tile `BLOCK_N` (tests).
    """
    R, P = q_lat.shape[-1], q_pe.shape[-1]
    if kv_cache.shape[-1] != R + P:
        raise ValueError(f"kv_cache width {kv_cache.shape[-1]} != R + P = {R} + {P}")
    return _paged_attention(
        q_lat, q_pe, kv_cache, page_table, ctx_len, page_size, scale, kv_heads=1, a_off=0,
        b_off=R, v_off=0, head_stride=0, dv=R, v_is_a=True, num_splits=num_splits,
        block_n=block_n)


def draft_context_attention(
    q: Tensor, draft_cache: Tensor, page_table: Tensor, ctx_len: Tensor, page_size: int,
    scale: float, *, num_splits: int | None = None, block_n: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Grouped-query attention of the drafter's block queries over its paged context cache.

    `q [bs, M, nh, hd]` (normed, roped), `draft_cache [num_slots, 2 * kvh * hd]` (per slot K of
    every KV head, then V of every KV head, `hd` contiguous each; unit last stride),
    `page_table [bs, W]` int32/int64, `ctx_len [bs]` int32/int64. Query head `h` reads KV head
    `h // (nh // kvh)`. Returns output `[bs, M, nh, hd]` fp32 and LSE `[bs, M, nh]` fp32
    (natural log; -inf and output 0 for a zero-length context).
    """
    hd = q.shape[-1]
    width = draft_cache.shape[-1]
    if width % (2 * hd):
        raise ValueError(f"draft_cache width {width} is not 2 * kvh * {hd}")
    kvh = width // (2 * hd)
    return _paged_attention(
        q, None, draft_cache, page_table, ctx_len, page_size, scale, kv_heads=kvh, a_off=0,
        b_off=0, v_off=kvh * hd, head_stride=hd, dv=hd, v_is_a=False, num_splits=num_splits,
        block_n=block_n)
