"""MLA attention in the absorbed (latent, MQA-like) form, for decode and tree verification over
the paged cache's prefix and the tree's own latents: one softmax over both key sets on the torch
path, or a planned prefix kernel's pass plus a tree pass merged by log-sum-exp. (Prefill runs the
MHA form: `ops.prefill`.)

The absorbed form sees one key head of width `R + P` (`c_kv` and the shared roped `k_pe`) and one
value head of width `R` (`c_kv`); queries arrive already absorbed (`q_lat = W_UK^T q_nope`).
All functions are fixed-shape and graph-safe.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

NEG_INF = float("-inf")
# (q_lat, q_pe, kv_cache, ctx_len) -> (latent output, natural-log LSE), like `prefix_attention`
PrefixKernel = Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


def _masked_softmax_state(s: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Probabilities and LSE of scores `s [..., K]` where `mask` is True; rows with no visible key
    get zero probabilities and LSE -inf (so a merge ignores them)."""
    s = s.masked_fill(~mask, NEG_INF)
    lse = torch.logsumexp(s, dim=-1)
    # NOTE: an empty row (zero-length context) has lse = -inf; subtracting it would give NaN.
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(s - safe.unsqueeze(-1))
    return p, lse


def gather_slots(cache: Tensor, slots: Tensor) -> Tensor:
    """Rows of `cache [..., num_slots, D]` at `slots [bs, C]` -> `[..., bs, C, D]` (one
    `index_select` over the leading dimensions flattened: on a CPU several times cheaper than
    advanced indexing, and than an `index_select` along an inner dimension)."""
    *lead, n, d = cache.shape
    idx = slots.reshape(-1)
    if lead and cache.is_contiguous():
        layers = torch.arange(math.prod(lead), device=idx.device, dtype=idx.dtype)
        idx = (layers[:, None] * n + idx).reshape(-1)
        cache = cache.view(-1, d)
    rows = cache.index_select(cache.dim() - 2, idx)
    return rows.view(*lead, *slots.shape, d)


def prefix_attention(
    q_lat: Tensor, q_pe: Tensor, kv_cache: Tensor, slots: Tensor, ctx_len: Tensor,
    kv_lora_rank: int, scale: float,
) -> tuple[Tensor, Tensor]:
    """Every query against the committed prefix of its request, non-causal.

    `q_lat [bs, Q, H, R]`, `q_pe [bs, Q, H, P]`, `kv_cache [num_slots, R + P]` (one layer),
    `slots [bs, C]` (cache slot of context position c, any value past `ctx_len`), `ctx_len [bs]`.
    Returns the latent output `[bs, Q, H, R]` (fp32) and LSE `[bs, Q, H]` (natural log).
    """
    kv = gather_slots(kv_cache, slots).float()  # [bs, C, R + P]
    ckv, kpe = kv[..., :kv_lora_rank], kv[..., kv_lora_rank:]
    s = torch.einsum("bqhr,bcr->bqhc", q_lat.float(), ckv)
    s = (s + torch.einsum("bqhp,bcp->bqhc", q_pe.float(), kpe)) * scale
    pos = torch.arange(slots.shape[1], device=slots.device)
    mask = (pos[None, :] < ctx_len[:, None])[:, None, None, :]
    p, lse = _masked_softmax_state(s, mask)
    return torch.einsum("bqhc,bcr->bqhr", p, ckv), lse


def tree_attention(
    q_lat: Tensor, q_pe: Tensor, tree_kv: Tensor, visible: Tensor, kv_lora_rank: int, scale: float,
) -> tuple[Tensor, Tensor]:
    """Every tree query against the tree's own latents under the ancestor mask.

    `tree_kv [bs, Q, R + P]`, `visible [bs, Q, Q]` (query i sees key j). Returns `[bs, Q, H, R]`
    and LSE `[bs, Q, H]`. Every row sees at least itself, so its LSE is finite.
    """
    kv = tree_kv.float()
    ckv, kpe = kv[..., :kv_lora_rank], kv[..., kv_lora_rank:]
    s = torch.einsum("bqhr,bkr->bqhk", q_lat.float(), ckv)
    s = (s + torch.einsum("bqhp,bkp->bqhk", q_pe.float(), kpe)) * scale
    p, lse = _masked_softmax_state(s, visible[:, :, None, :])
    return torch.einsum("bqhk,bkr->bqhr", p, ckv), lse


def merge_states(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor) -> Tensor:
    """Combine two partial softmax attentions over disjoint key sets (natural-log LSE)."""
    lse = torch.logaddexp(lse1, lse2)
    w1 = torch.exp(lse1 - lse).unsqueeze(-1)
    w2 = torch.exp(lse2 - lse).unsqueeze(-1)
    return o1 * w1 + o2 * w2


def joint_bias(slots: Tensor, ctx_len: Tensor, visible: Tensor, heads: int) -> Tensor:
    """Which keys each query sees in `joint_attention`, as an additive score bias `[bs, Q * heads,
    C + Q]` (fp32: 0 where the query sees the key, -inf elsewhere): its request's committed prefix
    (context positions `< ctx_len`), then the tree nodes `visible` marks. Every layer shares it (it
    is as large as one layer's scores). A bias rather than a boolean mask: the score product adds
    it in the same call (on a CPU a boolean mask broadcast over heads costs a separate pass over
    every layer's scores)."""
    bs, nq, _ = visible.shape
    pos = torch.arange(slots.shape[1], device=slots.device)
    prefix_ok = (pos[None, :] < ctx_len[:, None])[:, None, :].expand(bs, nq, -1)
    ok = torch.cat([prefix_ok, visible], dim=2)[:, :, None, :].expand(-1, -1, heads, -1)
    bias = torch.full(ok.shape, NEG_INF, dtype=torch.float32, device=ok.device)
    return bias.masked_fill_(ok, 0.0).view(bs, nq * heads, -1)


def joint_attention(
    q_lat: Tensor, q_pe: Tensor, kv_cache: Tensor, slots: Tensor, tree_kv: Tensor, bias: Tensor,
    kv_lora_rank: int, scale: float,
) -> Tensor:
    """Prefix and tree keys in one softmax: what `prefix_attention` + `tree_attention` +
    `merge_states` compute, in a handful of ops (the torch path; a planned prefix kernel needs
    the split form). `bias` is `joint_bias(...)`; other shapes as in
    `absorbed_attention`; returns `[bs, Q, H, R]` (fp32)."""
    bs, nq, nh, _ = q_lat.shape
    kv = torch.cat([gather_slots(kv_cache, slots), tree_kv], dim=1).float()  # [bs, C + Q, R + P]
    q = torch.cat([q_lat, q_pe], dim=-1).float().reshape(bs, nq * nh, -1) * scale
    # NOTE: every query sees itself, so no row is all -inf. A seen key's score is the product
    # plus exactly 0, bit for bit the product alone.
    p = torch.softmax(torch.baddbmm(bias, q, kv.transpose(1, 2)), dim=-1)
    return torch.bmm(p, kv[..., :kv_lora_rank]).view(bs, nq, nh, kv_lora_rank)


def absorbed_attention(
    q_lat: Tensor, q_pe: Tensor, kv_cache: Tensor, slots: Tensor, ctx_len: Tensor,
    tree_kv: Tensor, visible: Tensor, kv_lora_rank: int, scale: float,
    prefix: PrefixKernel | None = None, bias: Tensor | None = None,
) -> Tensor:
    """Verify/decode attention in latent space `[bs, Q, H, R]`: the queries against their
    request's committed prefix (`slots`, `ctx_len`) and the tree's own latents (`visible`).

    Without `prefix`, one softmax over both key sets (`joint_attention`; pass `bias` =
    `joint_bias(slots, ctx_len, visible, H)` to share it across layers). A planned prefix kernel
    (`ops.attention_gpu`, reading the pages it was planned with instead of `slots`) gives the
    prefix pass; the tree pass and a log-sum-exp merge complete it."""
    if prefix is None:
        if bias is None:
            bias = joint_bias(slots, ctx_len, visible, q_lat.shape[2])
        return joint_attention(q_lat, q_pe, kv_cache, slots, tree_kv, bias, kv_lora_rank, scale)
    o1, l1 = prefix(q_lat, q_pe, kv_cache, ctx_len)
    o2, l2 = tree_attention(q_lat, q_pe, tree_kv, visible, kv_lora_rank, scale)
    return merge_states(o1, l1, o2, l2)
