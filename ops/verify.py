"""Decide: greedy tree walk and target-only tree rejection sampling, one output contract.

Trees arrive in left-child right-sibling form (`next_token`, `next_sibling`, any node order). Both
decisions first turn the links into a parent and a sibling rank per node (pointer doubling, log2 N
rounds), mark the nodes the walk would accept if it reached their parent, and then walk from the
root one depth per iteration: every step is a single gather, no loop over requests or nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ops.sampling import sample_from_probs


@dataclass
class Decision:
    """Per request: `S` = most nodes a step can accept, root included."""

    accept_nodes: Tensor  # int64 [bs, S] local node ids, root first, -1 padded
    accept_len: Tensor  # int64 [bs] accepted draft nodes (root and bonus excluded)
    emit: Tensor  # int64 [bs, S] accepted drafts' tokens then the bonus; accept_len + 1 valid


def _width(n: int, max_accept: int | None) -> int:
    return n if max_accept is None else max(1, min(n, max_accept + 1))


def tree_links(next_token: Tensor, next_sibling: Tensor) -> tuple[Tensor, Tensor]:
    """Parent `[bs, N]` (-1 for the root and for unlinked nodes) and rank among siblings `[bs, N]`.

    The rank is the distance from the first child along the sibling chain, found by pointer
    doubling over the reversed chain; the parent is the one whose `next_token` is that first child.
    """
    bs, n = next_token.shape
    dev = next_token.device
    ids = torch.arange(n, device=dev, dtype=torch.int64).expand(bs, n)
    nt, ns = next_token.long(), next_sibling.long()
    empty = torch.full((bs, n + 1), -1, device=dev, dtype=torch.int64)
    prev = empty.scatter(1, torch.where(ns >= 0, ns, n), ids)[:, :n]
    first_of = empty.scatter(1, torch.where(nt >= 0, nt, n), ids)[:, :n]
    ptr = torch.where(prev >= 0, prev, ids)  # a first child points at itself and has distance 0
    dist = (prev >= 0).long()
    for _ in range(max(1, math.ceil(math.log2(max(n - 1, 1))))):
        dist = dist + dist.gather(1, ptr)
        ptr = ptr.gather(1, ptr)
    return first_of.gather(1, ptr), dist


def _walk(ok: Tensor, parent: Tensor, rank: Tensor, width: int) -> tuple[Tensor, Tensor, Tensor]:
    """From the root, repeatedly move to the first child (sibling order) with `ok`.

    ok, parent, rank: `[bs, N]`. Returns the accepted nodes `[bs, width]` (root first, -1 padded),
    the last accepted node `[bs]`, and whether the walk was still moving when `width - 1` drafts
    were accepted `[bs]` (then the last node's children were never tried).
    """
    bs, n = ok.shape
    dev = ok.device
    ids = torch.arange(n, device=dev, dtype=torch.int64).expand(bs, n)
    none = n * n
    key = torch.where(ok & (parent >= 0), rank * n + ids, none)
    best = torch.full((bs, n + 1), none, device=dev, dtype=torch.int64)
    best = best.scatter_reduce(1, torch.where(parent >= 0, parent, n), key, reduce="amin")[:, :n]
    choice = torch.where(best < none, best % n, -1)  # the child each node would accept

    cur = torch.zeros(bs, device=dev, dtype=torch.int64)
    moving = torch.ones(bs, device=dev, dtype=torch.bool)
    cols = [cur]
    for _ in range(width - 1):
        nxt = choice.gather(1, cur[:, None]).squeeze(1)
        moving = moving & (nxt >= 0)
        cur = torch.where(moving, nxt, cur)
        cols.append(torch.where(moving, nxt, -1))
    return torch.stack(cols, 1), cur, moving


def _decision(candidates: Tensor, nodes: Tensor, bonus: Tensor) -> Decision:
    taken = nodes[:, 1:] >= 0
    accept_len = taken.long().sum(1)
    toks = torch.where(taken, candidates.long().gather(1, nodes[:, 1:].clamp(min=0)), -1)
    pad = torch.full_like(accept_len[:, None], -1)
    emit = torch.cat([toks, pad], 1).scatter(1, accept_len[:, None], bonus.long()[:, None])
    return Decision(accept_nodes=nodes, accept_len=accept_len, emit=emit)


def tree_greedy(
    candidates: Tensor,
    next_token: Tensor,
    next_sibling: Tensor,
    target_argmax: Tensor,
    max_accept: int | None = None,
) -> Decision:
    """Greedy walk: accept the child whose token is the target's argmax at its parent.

    candidates, next_token, next_sibling, target_argmax: `[bs, N]`. The bonus is the argmax at
    the last accepted node. Outputs are `[bs, S]` with `S = N` or `min(N, max_accept + 1)`.
    """
    parent, rank = tree_links(next_token, next_sibling)
    argmax = target_argmax.long()
    ok = candidates.long() == argmax.gather(1, parent.clamp(min=0))
    nodes, cur, _ = _walk(ok, parent, rank, _width(candidates.shape[1], max_accept))
    return _decision(candidates, nodes, argmax.gather(1, cur[:, None]).squeeze(1))


def tree_sample(
    candidates: Tensor,
    next_token: Tensor,
    next_sibling: Tensor,
    target_probs: Tensor,
    coins: Tensor,
    final_coins: Tensor,
    max_accept: int | None = None,
) -> Decision:
    """Target-only tree rejection sampling (draft probabilities 0, thresholds 1).

    candidates, next_token, next_sibling: `[bs, N]`; target_probs `[bs, N, V]` (row `i` is the
    target distribution after node `i`); coins `[bs, N]` (the coin of parent `i` is `coins[:, i]`);
    final_coins `[bs]` for the bonus. At a node with coin `u`, its children are tried in sibling
    order with a running sum `acc` of their target probabilities; the first with `q > 0` and
    `u < acc` is accepted. When all are rejected (or at a leaf, or after `S - 1` drafts) the bonus
    is drawn from the target row of the last node with the tried children's tokens removed.
    """
    bs, n = candidates.shape
    vocab = target_probs.shape[-1]
    dev = candidates.device
    cand = candidates.long()
    parent, rank = tree_links(next_token, next_sibling)
    has_parent = parent >= 0
    par = parent.clamp(min=0)
    # Gather first, convert after: a low-precision [bs, N, V] input is never copied whole.
    probs = target_probs.reshape(bs, n * vocab)
    q_node = torch.where(has_parent, probs.gather(1, par * vocab + cand).float(), 0.0)

    # Running sum over the siblings in order: scatter into a [parent, rank] table, cumsum along
    # rank, read back. Unlinked nodes (root, padding) go to a dump row.
    slot = torch.where(has_parent, parent, n) * n + rank
    table = torch.zeros(bs, (n + 1) * n, device=dev, dtype=torch.float32)
    table = table.scatter(1, slot, q_node).view(bs, n + 1, n).cumsum(-1).view(bs, (n + 1) * n)
    acc = table.gather(1, slot)
    u = coins.to(acc.dtype).gather(1, par)
    # NOTE: strict rule: a zero-probability draft is never accepted, not even with u == 0.
    ok = has_parent & (q_node > 0) & (u < acc)

    nodes, cur, moving = _walk(ok, parent, rank, _width(n, max_accept))

    # Children of the last node were all tried and rejected unless the walk hit the depth limit.
    tried = (parent == cur[:, None]) & ~moving[:, None]
    rows = probs.view(bs, n, vocab).gather(1, cur[:, None, None].expand(bs, 1, vocab))
    q_cur = rows.squeeze(1).float()  # target distribution after the last accepted node
    drop = torch.zeros(bs, vocab + 1, device=dev, dtype=torch.bool)
    drop = drop.scatter(1, torch.where(tried, cand, vocab), True)[:, :vocab]
    resid = torch.where(drop, 0.0, q_cur)
    drawn = sample_from_probs(resid, final_coins)
    # Degenerate residual (children hold all the mass and u landed past the fp32 total): emit the
    # last rejected child with mass, else the target's argmax.
    last = torch.where(tried & (q_node > 0), rank, -1)
    last_rank, last_id = last.max(1)
    fallback = torch.where(
        last_rank >= 0, cand.gather(1, last_id[:, None]).squeeze(1), q_cur.argmax(-1)
    )
    bonus = torch.where(resid.sum(-1) > 0, drawn, fallback)
    return _decision(cand, nodes, bonus)
