"""Prefill attention in the MHA form: a chunk's queries against its own causal square and its
cached prefix, the prefix's latent rows up-projected through `kv_b_proj` a bounded chunk at a
time, partial results merged by log-sum-exp (as SGLang's `MHA_CHUNKED_KV` and vLLM's MLA
prefill do). Steps (decode, tree verify) keep the absorbed form (`ops.attention`).

Per (query, key) pair per head the MHA form costs `2 (Dn + P) + 2 Dv` FLOPs (640 at Kimi's 128 +
64 and 128) against the absorbed form's `2 (R + P) + 2 R` (2,176 at R = 512); it pays
`2 R H (Dn + Dv)` per prefix key per chunk to up-project the prefix again, which a chunk of
thousands of queries amortizes.

The pieces:

- `MHAPass`: one flash pass of queries `q [B, T, H, Dn + P]` (the nope part, then the roped
  part) over one key set: per-head `k_nope [B, N, H, Dn]`, the roped `k_pe [B, N, P]` every
  head shares, per-head `v [B, N, H, Dv]`; causal (the chunk's own square, `N == T`, query `i`
  sees keys `j <= i`) or not (a prefix chunk, every key seen). It returns the output `[B, T, H,
  Dv]` fp32 and its natural-log LSE `[B, T, H]`, merged with a previous pass's when given.
  `TorchMHA` (below) is the twin: fp32 math, scores materialized; the CUDA passes are the
  Triton kernel (`ops.prefill_triton`, behind `torch.ops.kimi.mha_prefill`) and flashinfer's
  ragged prefill (`ops.attention_gpu.FlashInferRaggedMHA`); the attention backend picks one
  (`engine.attention`).
- `mla_prefill`: the whole attention of a chunk: the causal pass over its own keys, then one
  non-causal pass per prefix chunk (`Prefix`, `prefix_chunk`), each merged into the last.

Inputs may be strided views (the keys and values are slices of `kv_b_proj`'s output and of the
latent rows); nothing here syncs with the host (the prefix's length is a shape).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ops.attention import gather_slots

# Bytes one prefix chunk may take beside the chunk's own activations: its gathered latent rows,
# their up-projected keys and values, and whatever the pass materializes per (query, key, head)
# (`MHAPass.score_bytes`: the twin's fp32 scores; nothing for the flash kernels).
PREFIX_CHUNK_BYTES = 64 << 20
# Prefix chunks are whole multiples of this many keys (a flash kernel's key tile).
PREFIX_ALIGN = 64


class MHAPass:
    """One flash pass over one key set (shapes in the module docstring)."""

    def score_bytes(self, device: torch.device) -> int:
        """Bytes the pass materializes per (query, key, head) on `device` (0 for a flash
        kernel), which bounds the prefix chunks (`prefix_chunk`)."""
        return 0

    def __call__(self, q: Tensor, k_nope: Tensor, k_pe: Tensor, v: Tensor, scale: float,
                 causal: bool, prev_o: Tensor | None = None, prev_lse: Tensor | None = None
                 ) -> tuple[Tensor, Tensor]:
        raise NotImplementedError


def merge_with_lse(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor) -> tuple[Tensor, Tensor]:
    """Two partial attentions over disjoint key sets (`[..., D]` and natural-log `[...]`) ->
    their merge and its LSE. A side with LSE -inf (no key) weighs nothing."""
    lse = torch.logaddexp(lse1, lse2)
    # NOTE: both -inf (no key anywhere) would give NaN weights; such rows keep LSE -inf, output 0
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    w1 = torch.exp(lse1 - safe).unsqueeze(-1)
    w2 = torch.exp(lse2 - safe).unsqueeze(-1)
    return o1 * w1 + o2 * w2, lse


def mha_attention(q: Tensor, k_nope: Tensor, k_pe: Tensor, v: Tensor, scale: float,
                  causal: bool, prev_o: Tensor | None = None, prev_lse: Tensor | None = None
                  ) -> tuple[Tensor, Tensor]:
    """The torch twin of one `MHAPass` (fp32 math, the `[B, H, T, N]` scores materialized):
    output `[B, T, H, Dv]` fp32 and LSE `[B, T, H]`, merged with `(prev_o, prev_lse)` when
    given."""
    dn = k_nope.shape[-1]
    # NOTE: in place where nothing (autograd included: the drafter's and the mini model's
    # training run this) needs the old values, so at most two `[B, H, T, N]` fp32 tensors live
    # at once (`TorchMHA.score_bytes`); the same values, op for op, as out of place
    s = torch.einsum("bqhd,bkhd->bhqk", q[..., :dn].float(), k_nope.float())
    s += torch.einsum("bqhd,bkd->bhqk", q[..., dn:].float(), k_pe.float())
    s *= scale
    if causal:
        T = s.shape[-1]
        pos = torch.arange(T, device=s.device)
        s.masked_fill_(pos[None, :] > pos[:, None], float("-inf"))
    # NOTE: every row sees at least one key (causal: itself; a prefix chunk: all of it), so the
    # row maximum is finite
    m = s.amax(dim=-1, keepdim=True)
    p = (s - m).exp_()
    denom = p.sum(dim=-1, keepdim=True)  # [B, H, T, 1]
    o = torch.einsum("bhqk,bkhd->bqhd", p, v.float()) / denom.transpose(1, 2)
    lse = (m + torch.log(denom))[..., 0].transpose(1, 2)  # [B, T, H]
    if prev_o is not None and prev_lse is not None:
        return merge_with_lse(prev_o, prev_lse, o, lse)
    return o, lse


class TorchMHA(MHAPass):
    """The twin as a pass (the CPU's, and the reference)."""

    def score_bytes(self, device: torch.device) -> int:
        return 8  # the fp32 scores and their exponentials (`mha_attention`)

    def __call__(self, q: Tensor, k_nope: Tensor, k_pe: Tensor, v: Tensor, scale: float,
                 causal: bool, prev_o: Tensor | None = None, prev_lse: Tensor | None = None
                 ) -> tuple[Tensor, Tensor]:
        return mha_attention(q, k_nope, k_pe, v, scale, causal, prev_o, prev_lse)


TORCH_MHA = TorchMHA()


@dataclass(frozen=True)
class Prefix:
    """A chunk's cached prefix in one layer's paged latent cache: `cache [num_slots, R + P]`
    (normalized `c_kv`, then roped `k_pe`) and the flat slots of positions `0 .. L - 1`,
    `slots [B, L]` (every row of the chunk has the same `L`)."""

    cache: Tensor
    slots: Tensor

    @property
    def length(self) -> int:
        return self.slots.shape[1]


def prefix_chunk(bs: int, queries: int, heads: int, kv_width: int, latent_width: int,
                 itemsize: int, score_bytes: int, budget: int = PREFIX_CHUNK_BYTES) -> int:
    """Prefix keys up-projected at a time: as many as keep one chunk within `budget` bytes (its
    latent rows `[bs, n, latent_width]`, keys and values `[bs, n, heads, kv_width]` at
    `itemsize`, and `score_bytes` per (query, key, head) of `queries` queries), a multiple of
    `PREFIX_ALIGN`, at least one `PREFIX_ALIGN`."""
    per_key = bs * ((heads * kv_width + latent_width) * itemsize
                    + queries * heads * score_bytes)
    return max(PREFIX_ALIGN, budget // max(per_key, 1) // PREFIX_ALIGN * PREFIX_ALIGN)


def mla_prefill(q: Tensor, k_nope: Tensor, k_pe: Tensor, v: Tensor, scale: float,
                attend: MHAPass, prefix: Prefix | None = None,
                up: Callable[[Tensor], Tensor] | None = None, chunk: int | None = None
                ) -> Tensor:
    """A prefill chunk's attention in the MHA form -> `[B, T, H, Dv]` fp32.

    `q [B, T, H, Dn + P]`, the chunk's own `k_nope [B, T, H, Dn]`, `k_pe [B, T, P]`, `v [B, T,
    H, Dv]` (query `i` sees its own keys `0 .. i`) and, with `prefix`, every key of the cached
    prefix: its latent rows gathered `chunk` keys at a time (default `prefix_chunk`'s), each
    chunk's `c_kv` up-projected by `up` (`kv_b_proj`: `[..., R]` -> `[..., H * (Dn + Dv)]`, in
    the queries' dtype) and attended by `attend` without a mask, merged by LSE."""
    o, lse = attend(q, k_nope, k_pe, v, scale, True)
    if prefix is None or prefix.length == 0:
        return o
    if up is None:
        raise ValueError("a cached prefix needs `up` (kv_b_proj) to up-project its rows")
    B, T, H, _ = q.shape
    dn, dv, P = k_nope.shape[-1], v.shape[-1], k_pe.shape[-1]
    R = prefix.cache.shape[-1] - P
    if chunk is None:
        chunk = prefix_chunk(B, T, H, dn + dv, R + P, q.element_size(),
                             attend.score_bytes(q.device))
    for a in range(0, prefix.length, chunk):
        lat = gather_slots(prefix.cache, prefix.slots[:, a:a + chunk])  # [B, n, R + P]
        kv = up(lat[..., :R].to(q.dtype)).view(B, lat.shape[1], H, dn + dv)
        # NOTE: k_pe in the queries' dtype too, so every pass sees one dtype
        o, lse = attend(q, kv[..., :dn], lat[..., R:].to(q.dtype), kv[..., dn:], scale, False,
                        o, lse)
    return o


def mha_flops(bs: int, queries: int, keys: int, heads: int, qk_dim: int, v_dim: int,
              causal: bool) -> int:
    """Useful FLOPs of one pass: `2 (qk + v)` per (query, key) pair a query sees, per head (a
    causal pass sees `T (T + 1) / 2` pairs)."""
    pairs = queries * (queries + 1) // 2 if causal else queries * keys
    return 2 * bs * heads * pairs * (qk_dim + v_dim)



def mha_tiles(dtype: torch.dtype, qk_dim: int, v_dim: int) -> tuple[int, int, int]:
    """`(BLOCK_M, BLOCK_N, num_warps)` of the Triton pass (`ops.prefill_triton`) for inputs of
    `dtype` with query/key heads `qk_dim` wide (nope + rope) and value heads `v_dim` wide.

    Chosen by compiling for sm_90a with Triton's compiler and ptxas, with the alignment hints
    the JIT gives 16-divisible strides and aligned pointers (no GPU needed; the test
    `test_mha_kernel_compiles_to_wgmma_without_spills` keeps them honest): 16-bit inputs take
    128 queries x 64 keys on 8 warps (two warpgroups of `wgmma`, no spills at Kimi's 192 / 128),
    64 x 64 on 4 warps past those widths; fp32 inputs take IEEE FMA dots, 32 x 32 on 4 warps up
    to 64-wide heads, 16 x 16 wider."""
    if dtype == torch.float32:
        return (32, 32, 4) if qk_dim <= 64 and v_dim <= 64 else (16, 16, 4)
    if qk_dim <= 256 and v_dim <= 128:
        return 128, 64, 8
    return 64, 64, 4
