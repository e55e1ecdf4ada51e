"""Torch twins of `ops.attention_triton`: the same signatures and results, computed the
reference way: gather the slots of the page table's full width, mask by `ctx_len`.

Their work is proportional to the table width, not to the real lengths (the kernels' point);
they are what CI tests the kernels against, and what a CPU run uses. Pure torch, fixed shapes,
no host sync: they run under `FakeTensorMode()` and inside CUDA graphs.

Cache layouts (one layer; `num_slots = num_pages * page_size`, page `p` holds slots
`p * page_size .. p * page_size + page_size - 1`, page 0 is the dummy page):
- target latent cache `[num_slots, R + P]`: `c_kv` then roped `k_pe`;
- drafter context cache `[num_slots, 2 * kvh * hd]`: K of every KV head (normed, roped), then V
  of every KV head, `hd` contiguous per head.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ops.attention import _masked_softmax_state, gather_slots, merge_states, prefix_attention

# (q, draft_cache, page_table, ctx_len, page_size, scale) -> (output, natural-log LSE)
ContextFn = Callable[[Tensor, Tensor, Tensor, Tensor, int, float], tuple[Tensor, Tensor]]


def table_slots(page_table: Tensor, page_size: int) -> Tensor:
    """Flat cache slot of every position the table covers: `page_table [bs, W]` ->
    `[bs, W * page_size]` int64 (position `c` lives in page `page_table[:, c // page_size]`)."""
    bs, W = page_table.shape
    off = torch.arange(page_size, device=page_table.device)
    return (page_table.long()[:, :, None] * page_size + off).reshape(bs, W * page_size)


def mla_prefix_attention(
    q_lat: Tensor, q_pe: Tensor, kv_cache: Tensor, page_table: Tensor, ctx_len: Tensor,
    page_size: int, scale: float,
) -> tuple[Tensor, Tensor]:
    """`ops.attention.prefix_attention` through the page table.

    `q_lat [bs, Q, H, R]`, `q_pe [bs, Q, H, P]`, `kv_cache [num_slots, R + P]`, `page_table
    [bs, W]` int32/int64, `ctx_len [bs]` int32/int64 (keys: positions `< ctx_len`, at most
    `W * page_size`). Returns the latent output `[bs, Q, H, R]` fp32 and LSE `[bs, Q, H]`
    (natural log; output 0 and LSE -inf for a zero-length row).
    """
    slots = table_slots(page_table, page_size)
    return prefix_attention(q_lat, q_pe, kv_cache, slots, ctx_len, q_lat.shape[-1], scale)


def _split_kv(kv: Tensor, hd: int) -> tuple[Tensor, Tensor]:
    """`kv [..., T, 2 * kvh * hd]` -> K and V `[..., T, kvh, hd]` (fp32)."""
    kvh = kv.shape[-1] // (2 * hd)
    kv = kv.float().view(*kv.shape[:-1], 2, kvh, hd)
    return kv[..., 0, :, :], kv[..., 1, :, :]


def gqa_state(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float
              ) -> tuple[Tensor, Tensor]:
    """Grouped-query attention with its LSE: `q [bs, M, nh, hd]`, `k, v [bs, T, kvh, hd]`,
    `mask [bs, T]` (key visible) or None -> output `[bs, M, nh, hd]` fp32 and LSE
    `[bs, M, nh]` (natural log). Query head `h` reads KV head `h // (nh // kvh)`."""
    bs, M, nh, hd = q.shape
    kvh = k.shape[2]
    qg = q.float().view(bs, M, kvh, nh // kvh, hd)
    s = torch.einsum("bmjgd,btjd->bmjgt", qg, k.float()) * scale
    if mask is None:
        mask = torch.ones(bs, k.shape[1], dtype=torch.bool, device=q.device)
    p, lse = _masked_softmax_state(s, mask[:, None, None, None, :])
    o = torch.einsum("bmjgt,btjd->bmjgd", p, v.float())
    return o.reshape(bs, M, nh, hd), lse.reshape(bs, M, nh)


def draft_context_attention(
    q: Tensor, draft_cache: Tensor, page_table: Tensor, ctx_len: Tensor, page_size: int,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """The drafter's block queries against its paged context cache (grouped-query).

    `q [bs, M, nh, hd]`, `draft_cache [num_slots, 2 * kvh * hd]`, `page_table [bs, W]`,
    `ctx_len [bs]`. Returns output `[bs, M, nh, hd]` fp32 and LSE `[bs, M, nh]` (natural log;
    output 0 and LSE -inf for a zero-length context).
    """
    slots = table_slots(page_table, page_size)
    k, v = _split_kv(gather_slots(draft_cache, slots), q.shape[-1])  # [bs, C, kvh, hd]
    valid = torch.arange(slots.shape[1], device=q.device)[None, :] < ctx_len[:, None]
    return gqa_state(q, k, v, valid, scale)


def block_attention(q: Tensor, block_kv: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """The drafter's in-block pass: `q [bs, M, nh, hd]` against the block's own rows
    `block_kv [bs, B, 2 * kvh * hd]` (cache-row layout), no mask. Output `[bs, M, nh, hd]`
    fp32, LSE `[bs, M, nh]` (always finite)."""
    k, v = _split_kv(block_kv, q.shape[-1])
    return gqa_state(q, k, v, None, scale)


def draft_attention(
    q: Tensor, block_kv: Tensor, draft_cache: Tensor, page_table: Tensor, ctx_len: Tensor,
    page_size: int, scale: float, context: ContextFn = draft_context_attention,
) -> Tensor:
    """What `DraftAttention` computes before `o_proj`, split in two passes: the paged context
    pass (`context`: this module's twin or `ops.attention_triton.draft_context_attention`)
    merged by LSE with the in-block pass. `[bs, M, nh, hd]` fp32."""
    o1, l1 = context(q, draft_cache, page_table, ctx_len, page_size, scale)
    o2, l2 = block_attention(q, block_kv, scale)
    return merge_states(o1, l1, o2, l2)
