"""Decide: the greedy tree walk and tree sampling, one walk and one output contract.

Trees arrive in left-child right-sibling form (`next_token`, `next_sibling`, any node order). The
walk first turns the links into a parent and a sibling rank per node (pointer doubling, log2 N
rounds), marks the nodes it would accept if it reached their parent, and then walks from the root
one depth per iteration: every step is a single gather, no loop over requests or nodes. Greedy, a
node's next token is the target's argmax there; sampling, it is the node's draw (the race of
`ops.sampling.sample_from_probs`) with the coin of the position it fills, so a sampled row emits
what plain decoding emits with those coins.
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


def _walk(ok: Tensor, parent: Tensor, rank: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """From the root, repeatedly move to the first child (sibling order) with `ok`.

    ok, parent, rank: `[bs, N]`. Returns the accepted nodes `[bs, width]` (root first, -1 padded)
    and the last accepted node `[bs]`.
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
    return torch.stack(cols, 1), cur


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
    nodes, cur = _walk(ok, parent, rank, _width(candidates.shape[1], max_accept))
    return _decision(candidates, nodes, argmax.gather(1, cur[:, None]).squeeze(1))


def tree_greedy_host(
    candidates: Tensor,
    next_token: Tensor,
    next_sibling: Tensor,
    target_argmax: Tensor,
    max_accept: int | None = None,
) -> Decision:
    """`tree_greedy` on the host, one request and one child at a time, as the walk is stated:
    the eager CPU step's walk (a few dozen Python steps cost less than `tree_greedy`'s fifty-odd
    tiny tensor ops at a step's few requests of few nodes) and the tests' emulation of
    the device one. Host reads: never inside a graph."""
    bs, n = candidates.shape
    width = _width(n, max_accept)
    nodes = [[-1] * width for _ in range(bs)]
    emit = [[-1] * width for _ in range(bs)]
    accept = [0] * bs
    rows = zip(*(x.tolist() for x in (candidates, next_token, next_sibling, target_argmax)))
    for b, (cand, first, sibling, best) in enumerate(rows):
        cur, k = 0, 0
        nodes[b][0] = 0
        while k + 1 < width:
            child = first[cur]
            while child != -1 and cand[child] != best[cur]:
                child = sibling[child]
            if child == -1:
                break
            k += 1
            nodes[b][k], emit[b][k - 1], cur = child, cand[child], child
        emit[b][k], accept[b] = best[cur], k
    dev = candidates.device
    return Decision(accept_nodes=torch.tensor(nodes, device=dev),
                    accept_len=torch.tensor(accept, device=dev),
                    emit=torch.tensor(emit, device=dev))


def tree_sample(
    candidates: Tensor,
    next_token: Tensor,
    next_sibling: Tensor,
    target_probs: Tensor,
    coins: Tensor,
    max_accept: int | None = None,
) -> Decision:
    """Target-only tree sampling that emits what plain decoding emits with the same coins.

    candidates, next_token, next_sibling: `[bs, N]`; target_probs `[bs, N, V]` (row `i` is the
    target distribution after node `i`); coins `[bs, N]`: the uniform of the position each node's
    next token takes (a node at depth `d` gets the coin of the `d`-th token the step may emit).
    Every node draws its next token from its row (`sample_from_probs`) with its coin; the walk
    then moves to the child holding that token, as the greedy walk moves to the argmax, and the
    bonus is the last accepted node's draw.

    Exact, and the same tokens as plain decoding: the token at each position is the draw from the
    target's distribution given the accepted prefix, with that position's coin, which is how
    plain decoding draws it. A child is accepted with its target probability (as with
    sibling-order rejection sampling), and a zero-probability draft never is.
    """
    drawn = sample_from_probs(target_probs, coins)
    return tree_greedy(candidates, next_token, next_sibling, drawn, max_accept)
