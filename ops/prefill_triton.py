"""The Triton kernel of one MHA prefill pass (`ops.prefill.MHAPass`; its torch twin is
`ops.prefill.mha_attention`): flash attention of a chunk's queries over one key set, the
chunk's own causal square or one up-projected prefix chunk, with the query/key head split MLA
has (a per-head nope part `Dn` and a roped part `P` every head shares on the key side) and a
value head `Dv` of its own width.

Design:

- Grid `(cdiv(T, BLOCK_M), B * H)`: a program owns `BLOCK_M` queries of one head and streams
  that head's keys in tiles of `BLOCK_N` with an online softmax (base-2 exponentials, fp32
  statistics and accumulator), so nothing of size `T x N` exists. The query tiles of one head
  are the fast axis, so the programs that read the same keys run together (L2).
- Scores are two dots, `q_nope k_nope^T + q_pe k_pe^T`, reading `k_pe` once for every head;
  values one dot. 16-bit inputs go to the tensor cores as they are (fp32 accumulation,
  probabilities rounded to the value dtype first); fp32 inputs take IEEE dots (no TF32).
- Causal (the own square, `N == T`): the tile's keys before its first query are read without a
  mask, the diagonal tiles with one; tiles run longest first (the grid's first programs own
  the last queries). Non-causal: whole key tiles without a mask, a ragged last tile with one.
- With a previous pass (`HAS_PREV`), the program merges its result into that one's by
  log-sum-exp before it stores: a chunk's prefix passes chain with no extra launch.
- Tiles: `ops.prefill.mha_tiles`, chosen by compiling for sm_90a (16-bit: 128 x 64 on 8 warps
  where the widths allow, which is Hopper's `wgmma`; `tests/test_prefill_attention.py` keeps it
  honest).

Interpreter: on CPU tensors the kernel runs under Triton's interpreter (`ops.triton_util`),
reducing with `tl.reduce` and builtins only, dots widened to fp32, and a bf16 rounding of the
probabilities done by hand (`rne_bf16`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ops.prefill import mha_tiles
from ops.triton_util import ieee_dots, kernel_for, rne_bf16

LOG2E = 1.4426950408889634
_MAX = tl.standard._elementwise_max
_SUM = tl.standard._sum_combine
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _mha_prefill_fwd(
    q_ptr, kn_ptr, kp_ptr, v_ptr, po_ptr, plse_ptr, o_ptr, lse_ptr,
    sq_b, sq_m, sq_h, skn_b, skn_n, skn_h, skp_b, skp_n, sv_b, sv_n, sv_h,
    M, N, H, qk_scale,
    DN: tl.constexpr, DP: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DN: tl.constexpr, BLOCK_DP: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_PREV: tl.constexpr, P_T: tl.constexpr, DOT_T: tl.constexpr,
    DOT_PREC: tl.constexpr, RNE_P: tl.constexpr,
):
    """Queries `tile * BLOCK_M ..` of head `h` of row `b` against keys `0 .. N - 1` (causal:
    `0 .. m` for query `m`). `q` is `[B, M, H, DN + DP]` (unit last stride), `k_nope [B, N,
    H, DN]`, `k_pe [B, N, DP]`, `v [B, N, H, DV]` (strided); outputs `o [B, M, H, DV]` fp32
    and `lse [B, M, H]` (natural log), contiguous; `po`/`plse` a previous pass's, same
    layout."""
    tiles = (M + BLOCK_M - 1) // BLOCK_M
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    # NOTE: causal tiles run longest first, so the short ones fill the tail of the grid
    if CAUSAL:
        tile = tiles - 1 - pid
    else:
        tile = pid
    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    dn = tl.arange(0, BLOCK_DN)
    dp = tl.arange(0, BLOCK_DP)
    dv = tl.arange(0, BLOCK_DV)

    q_base = q_ptr + b * sq_b + h * sq_h + m[:, None] * sq_m
    qn = tl.load(q_base + dn[None, :], mask=m_ok[:, None] & (dn < DN)[None, :], other=0.0)
    qp = tl.load(q_base + DN + dp[None, :], mask=m_ok[:, None] & (dp < DP)[None, :], other=0.0)
    qn = qn.to(DOT_T)
    qp = qp.to(DOT_T)
    kn_base = kn_ptr + b * skn_b + h * skn_h
    kp_base = kp_ptr + b * skp_b
    v_base = v_ptr + b * sv_b + h * sv_h

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_DV], 0.0, dtype=tl.float32)
    if CAUSAL:
        # keys before the tile's first query are seen by all of its queries
        full = tile * BLOCK_M
        hi = tl.minimum(full + BLOCK_M, N)
    else:
        full = N // BLOCK_N * BLOCK_N
        hi = N

    # ---- key tiles every query of the tile sees whole: no mask -------------------------------
    for start in range(0, full, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        kn = tl.load(kn_base + n[None, :] * skn_n + dn[:, None],
                     mask=(dn < DN)[:, None], other=0.0)
        kp = tl.load(kp_base + n[None, :] * skp_n + dp[:, None],
                     mask=(dp < DP)[:, None], other=0.0)
        s = tl.dot(qn, kn.to(DOT_T), input_precision=DOT_PREC)
        s = tl.dot(qp, kp.to(DOT_T), s, input_precision=DOT_PREC)
        s = s * qk_scale
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
        v = tl.load(v_base + n[:, None] * sv_n + dv[None, :], mask=(dv < DV)[None, :], other=0.0)
        if RNE_P:
            u = p.to(tl.uint32, bitcast=True)
            p = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        pv = tl.dot(p.to(P_T).to(DOT_T), v.to(DOT_T), input_precision=DOT_PREC)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    # ---- the diagonal (causal) or the ragged last tile: masked -------------------------------
    for start in range(full, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        kn = tl.load(kn_base + n[None, :] * skn_n + dn[:, None],
                     mask=(dn < DN)[:, None] & n_ok[None, :], other=0.0)
        kp = tl.load(kp_base + n[None, :] * skp_n + dp[:, None],
                     mask=(dp < DP)[:, None] & n_ok[None, :], other=0.0)
        s = tl.dot(qn, kn.to(DOT_T), input_precision=DOT_PREC)
        s = tl.dot(qp, kp.to(DOT_T), s, input_precision=DOT_PREC)
        seen = n_ok[None, :]
        if CAUSAL:
            seen = seen & (n[None, :] <= m[:, None])
        s = tl.where(seen, s * qk_scale, float("-inf"))
        # NOTE: every query sees a key of the first masked tile (causal: itself, or the tile's
        # first key; else key `full`), so `m_new` is finite from then on
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
        v = tl.load(v_base + n[:, None] * sv_n + dv[None, :],
                    mask=n_ok[:, None] & (dv < DV)[None, :], other=0.0)
        if RNE_P:
            u = p.to(tl.uint32, bitcast=True)
            p = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        pv = tl.dot(p.to(P_T).to(DOT_T), v.to(DOT_T), input_precision=DOT_PREC)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    live = l_i > 0.0
    out = acc / tl.where(live, l_i, 1.0)[:, None]
    lse = tl.where(live, (m_i + tl.log2(tl.where(live, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    row = (b * M + m) * H + h
    o_mask = m_ok[:, None] & (dv < DV)[None, :]
    if HAS_PREV:
        lse_p = tl.load(plse_ptr + row, mask=m_ok, other=float("-inf"))
        o_p = tl.load(po_ptr + row[:, None] * DV + dv[None, :], mask=o_mask, other=0.0)
        top = tl.maximum(lse, lse_p)
        top = tl.where(top == float("-inf"), 0.0, top)
        w = tl.exp(lse - top)
        w_p = tl.exp(lse_p - top)
        tot = w + w_p
        some = tot > 0.0
        tot = tl.where(some, tot, 1.0)
        out = (out * w[:, None] + o_p * w_p[:, None]) / tot[:, None]
        lse = tl.where(some, top + tl.log(tot), float("-inf"))
    tl.store(o_ptr + row[:, None] * DV + dv[None, :], out, mask=o_mask)
    tl.store(lse_ptr + row, lse, mask=m_ok)


def mha_meta(dtype: torch.dtype, device_type: str, dn: int, dp: int, dv: int, causal: bool,
             has_prev: bool, block_m: int | None = None, block_n: int | None = None
             ) -> tuple[dict, int]:
    """The constexprs of `_mha_prefill_fwd` for inputs of `dtype` on `device_type` and the
    launch's warps (shared by the launcher and the sm_90a compile test); `block_m`/`block_n`
    override the tiles (tests)."""
    from ops.paged_grid import pow2_tile

    bm, bn, warps = mha_tiles(dtype, dn + dp, dv)
    bm, bn = block_m or bm, block_n or bn
    if ieee_dots(dtype, device_type):
        dot_t, prec = tl.float32, "ieee"
    else:
        dot_t, prec = _TL_DTYPES[dtype], "tf32"
    return dict(
        DN=dn, DP=dp, DV=dv, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_DN=pow2_tile(dn), BLOCK_DP=pow2_tile(dp), BLOCK_DV=pow2_tile(dv),
        CAUSAL=causal, HAS_PREV=has_prev, P_T=_TL_DTYPES[dtype], DOT_T=dot_t, DOT_PREC=prec,
        RNE_P=rne_bf16(dtype, device_type)), warps


def mha_prefill_triton(
    q: Tensor, k_nope: Tensor, k_pe: Tensor, v: Tensor, scale: float, causal: bool,
    prev_o: Tensor | None = None, prev_lse: Tensor | None = None, *,
    block_m: int | None = None, block_n: int | None = None,
) -> tuple[Tensor, Tensor]:
    """`ops.prefill.mha_attention` as one kernel launch: `q [B, T, H, Dn + P]`, `k_nope [B, N,
    H, Dn]`, `k_pe [B, N, P]`, `v [B, N, H, Dv]` (one float dtype; any strides with a unit
    last one) -> output `[B, T, H, Dv]` fp32 and LSE `[B, T, H]` fp32 (natural log), merged
    with `(prev_o, prev_lse)` (the same shapes) when given. Causal needs `N == T`."""
    B, T, H, dqk = q.shape
    N, dn, dv = k_nope.shape[1], k_nope.shape[-1], v.shape[-1]
    dp = dqk - dn
    if k_pe.shape != (B, N, dp) or v.shape[:3] != (B, N, H) or k_nope.shape[:3] != (B, N, H):
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, k_nope "
                         f"{tuple(k_nope.shape)}, k_pe {tuple(k_pe.shape)}, v {tuple(v.shape)}")
    if causal and N != T:
        raise ValueError(f"a causal pass needs as many keys as queries, got {N} and {T}")
    if len({q.dtype, k_nope.dtype, k_pe.dtype, v.dtype}) != 1:
        raise TypeError(f"one dtype for q, k and v, got {q.dtype}, {k_nope.dtype}, "
                        f"{k_pe.dtype}, {v.dtype}")
    q, k_nope, k_pe, v = (t if t.stride(-1) == 1 else t.contiguous()
                          for t in (q, k_nope, k_pe, v))
    dev = q.device
    o = torch.empty(B, T, H, dv, dtype=torch.float32, device=dev)
    lse = torch.empty(B, T, H, dtype=torch.float32, device=dev)
    has_prev = prev_o is not None and prev_lse is not None
    if has_prev:
        prev_o, prev_lse = prev_o.contiguous(), prev_lse.contiguous()
    meta, warps = mha_meta(q.dtype, dev.type, dn, dp, dv, causal, has_prev, block_m, block_n)
    if causal and meta["BLOCK_M"] % meta["BLOCK_N"]:
        raise ValueError(f"BLOCK_M {meta['BLOCK_M']} must be a multiple of BLOCK_N "
                         f"{meta['BLOCK_N']} (the causal diagonal starts on a key tile)")
    grid = (triton.cdiv(T, meta["BLOCK_M"]), B * H)
    kernel_for(_mha_prefill_fwd, dev)[grid](
        q, k_nope, k_pe, v, prev_o if has_prev else o, prev_lse if has_prev else lse, o, lse,
        q.stride(0), q.stride(1), q.stride(2), k_nope.stride(0), k_nope.stride(1),
        k_nope.stride(2), k_pe.stride(0), k_pe.stride(1), v.stride(0), v.stride(1), v.stride(2),
        T, N, H, scale * LOG2E, **meta, num_warps=warps)
    return o, lse
