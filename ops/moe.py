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


def experts_dense(x: Tensor, idx: Tensor, w: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """Every expert on every token, combined with the routing weights (zero for unchosen experts).

    Fixed shapes and no data-dependent control flow, so it runs inside a CUDA graph and under
    fake tensors; it costs `E / k` times the routed FLOPs, which is what small models want on
    a CPU (a handful of large ops instead of per-expert launches).
    `x [T, H]`, `idx/w [T, k]`, `w13 [E, 2I, H]` (gate rows then up rows), `w2 [E, H, I]`.
    """
    E = w13.shape[0]
    comb = torch.zeros(x.shape[0], E, dtype=torch.float32, device=x.device)
    comb.scatter_add_(1, idx, w.float())
    h = torch.einsum("th,eih->eti", x, w13)
    g, u = h.chunk(2, dim=-1)
    y = torch.einsum("eti,ehi->eth", F.silu(g) * u, w2)  # [E, T, H]
    return torch.einsum("eth,te->th", y.float(), comb).to(x.dtype)


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
