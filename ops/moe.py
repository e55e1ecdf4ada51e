"""Mixture of experts: noaux_tc routing and expert dispatch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


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


# Every expert on every token beats per-expert dispatch on a CPU while that whole pass stays
# under this many multiply-adds (bundled model, 8 experts of 128 x 64: up to about 40 tokens;
# a real Kimi expert bank: never).
DENSE_MAX_MACS = 1 << 23


def dense_is_cheaper(tokens: int, experts: int, hidden: int, inter: int) -> bool:
    """Whether `experts_dense` over `tokens` tokens costs less than `experts_sparse` on a CPU:
    few tokens and a small expert bank, where launches, not FLOPs, set the price."""
    return tokens * experts * 3 * hidden * inter <= DENSE_MAX_MACS


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


def experts_sparse(x: Tensor, idx: Tensor, w: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """Each token only through its chosen experts (eager only: data-dependent shapes).

    The (token, expert) pairs are sorted by expert once, so each expert runs on one contiguous
    slice; the weighted outputs go back to their tokens with one `index_add_`.
    """
    T, k = idx.shape
    flat = idx.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    tok = order // k
    xs = x[tok]  # [T * k, H], grouped by expert
    parts, start = [], 0
    for e, n in enumerate(counts):
        if n:
            g, u = F.linear(xs[start:start + n], w13[e]).chunk(2, dim=-1)
            parts.append(F.linear(F.silu(g) * u, w2[e]))
            start += n
    ys = torch.cat(parts).float() * w.reshape(-1)[order, None].float()
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, tok, ys).to(x.dtype)
