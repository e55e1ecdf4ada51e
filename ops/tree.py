"""DDTree construction on the device and on the host, retrieval arrays and tree attention mask.

Shapes: `bs` requests, `L` drafted depths, `V` vocabulary, `K` budget (non-root nodes),
`N = K + 1`. Every function except `build_ddtree_host` is a fixed-shape tensor program: no host
sync, no data-dependent shapes, loops only over depth, so it runs unchanged on the CPU and inside a
CUDA graph.

Canonical layout (shared by both builders and `chain_tree`): column 0 is the
root; valid nodes follow in depth-major order, children of one parent contiguous and ordered by
descending `logw` (equivalently by ascending draft rank), so `parent < child`; padding nodes fill
the tail. Padding nodes hold token 0, parent 0 (the root, so their attention row is never empty),
depth 0, `logw = -inf`, `valid = False`, and -1 in both retrieval arrays.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass
class DDTree:
    """A batch of draft trees in the canonical layout; all `[bs, N]` unless noted."""

    tokens: Tensor  # int64, root = anchor token, padding 0
    parent: Tensor  # int64 local id, -1 for the root, 0 for padding
    depth: Tensor  # int64, 0 for the root and padding
    logw: Tensor  # float32 cumulative draft log-prob, 0 at the root, -inf for padding
    valid: Tensor  # bool, False for padding
    next_token: Tensor  # int64 first child, -1 if none
    next_sibling: Tensor  # int64 next sibling (descending logw), -1 if none
    visible: Tensor  # bool [bs, N, N]: j is i or an ancestor of i (padding: itself and the root)

    def positions(self, cache_len: Tensor) -> Tensor:
        """RoPE positions `[bs, N]` of the nodes for committed lengths `cache_len` `[bs]`."""
        return cache_len.to(self.depth.dtype)[:, None] + self.depth


def draft_topk(draft_logits: Tensor, r: int) -> tuple[Tensor, Tensor]:
    """The `r` best draft log-probs per depth and their tokens, both `[bs, L, r]`, descending.

    Shared by both builders so they see the same ranks, ties included.
    """
    lp = torch.log_softmax(draft_logits.float(), dim=-1)
    vals, toks = torch.topk(lp, r, dim=-1)
    # NOTE: a row of all -inf logits gives all-NaN log-probs; it must read as "no candidate at this
    # depth". Fixed after the top-k, on the small tensor.
    return torch.where(torch.isnan(vals), float("-inf"), vals), toks


def _top_by_weight(w: Tensor, k: int) -> Tensor:
    """Indices `[bs, k]` of the `k` largest `w` `[bs, M]`, ties to the smaller index, ascending.

    A stable descending sort keeps equal weights (-0.0 and +0.0 included) in index order. The
    candidates of each caller are laid out so that a smaller index is the lexicographically
    smaller rank tuple (shallower first), which keeps the kept set closed under ancestors and
    previous siblings even with exactly tied weights.
    """
    top = torch.sort(w, dim=-1, descending=True, stable=True).indices[:, :k]
    return torch.sort(top, dim=-1).values


def _retrieval(parent: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """First-child and next-sibling arrays `[bs, N]` of a canonical-layout tree."""
    bs, n = parent.shape
    dev = parent.device
    ids = torch.arange(n, device=dev, dtype=torch.int64).expand(bs, n)
    # Children of one parent are contiguous, so the next sibling is simply the next column.
    # Valid nodes are a prefix, and the root's parent (-1) never pairs with node 1.
    same = valid[:, 1:] & (parent[:, 1:] == parent[:, :-1])
    minus = torch.full((bs, 1), -1, device=dev, dtype=torch.int64)
    next_sibling = torch.cat([torch.where(same, ids[:, 1:], -1), minus], dim=1)
    # First child = smallest id among the children; padding and the root scatter to a dump column.
    tgt = torch.where(valid & (ids > 0), parent, n)
    first = torch.full((bs, n + 1), n, device=dev, dtype=torch.int64)
    first = first.scatter_reduce(1, tgt, ids, reduce="amin", include_self=True)[:, :n]
    next_token = torch.where(first < n, first, -1)
    return next_token, next_sibling


def _visible(parent: Tensor, max_depth: int) -> Tensor:
    """Ancestor-or-self relation `[bs, N, N]` of a forest of depth `max_depth`: "self or
    parent" squared until it spans `max_depth` steps (counts stay exact in fp32)."""
    bs, n = parent.shape
    reach = torch.eye(n, device=parent.device).expand(bs, n, n).clone()
    reach.scatter_(2, parent.clamp(min=0).unsqueeze(-1), 1.0)  # the root is its own parent
    for _ in range(math.ceil(math.log2(max(max_depth, 1)))):
        reach = torch.bmm(reach, reach).clamp_(max=1.0)
    return reach > 0


def _finish(
    tokens: Tensor, parent: Tensor, depth: Tensor, logw: Tensor, valid: Tensor, max_depth: int
) -> DDTree:
    next_token, next_sibling = _retrieval(parent, valid)
    visible = _visible(parent, max_depth)
    return DDTree(tokens, parent, depth, logw, valid, next_token, next_sibling, visible)


def build_ddtree(draft_logits: Tensor, budget: int, anchor_tokens: Tensor) -> DDTree:
    """The `budget` heaviest draft rank tuples as a canonical tree, with retrieval arrays and mask.

    draft_logits `[bs, L, V]` (row `d` is the drafter's distribution at depth `d + 1`),
    anchor_tokens `[bs]`. Returns a `DDTree` with `N = budget + 1`.

    Per depth, the `K` heaviest tuples are found among the `K x R` extensions of the previous
    depth's `K` heaviest; the global `K` heaviest are then taken among the `D x K` survivors. Ties
    prefer the shallower tuple, then the lexicographically smaller one. Only the first
    `D = min(L, K)` depths can hold a node (each node needs all its ancestors), so deeper rows
    are never read; a caller may pass just those.
    """
    k = budget
    draft_logits = draft_logits[:, :k]
    bs, n_depth, vocab = draft_logits.shape
    r = min(k, vocab)
    n = k + 1
    dev = draft_logits.device
    lp, tok = draft_topk(draft_logits, r)  # [bs, L, R]

    # Survivors of each depth, in lexicographic order of their rank tuples: weight, the slot of the
    # parent among the previous depth's survivors, and the last rank.
    pad = torch.full((bs, k - r), float("-inf"), device=dev, dtype=torch.float32)
    w = torch.cat([lp[:, 0], pad], dim=1)  # [bs, K]
    slots = torch.arange(k, device=dev, dtype=torch.int64).expand(bs, k)
    # NOTE: the loop is the builder's hot path (L iterations of a few tiny ops): keep it short.
    ws, keeps = [w], [slots]
    for d in range(1, n_depth):
        ext = (w[:, :, None] + lp[:, d, None, :]).reshape(bs, k * r)  # flat = slot * R + rank
        keep = _top_by_weight(ext, k)
        w = ext.gather(1, keep)
        ws.append(w)
        keeps.append(keep)
    cand_w = torch.stack(ws, 1).reshape(bs, n_depth * k)  # flat = depth * K + slot
    kept = torch.stack(keeps, 1)  # [bs, L, K]; depth 0 holds the ranks themselves
    cand_par = torch.where(torch.arange(n_depth, device=dev)[None, :, None] == 0, 0, kept // r)
    cand_rank = torch.cat([slots.clamp(max=r - 1)[:, None], kept[:, 1:] % r], 1).reshape(
        bs, n_depth * k)

    # NOTE: closure needs no repair pass: in fp32 a child's weight never exceeds its parent's or
    # its previous sibling's, and on a tie the shallower / lexicographically smaller one wins, so
    # both precede it in every selection above. -inf tuples are dropped here and become padding.
    chosen = _top_by_weight(cand_w, k)
    sel = torch.zeros(bs, n_depth * k, device=dev, dtype=torch.bool)
    sel = sel.scatter(1, chosen, torch.isfinite(cand_w.gather(1, chosen)))

    # Flat survivor order is already (depth, lexicographic), i.e. the canonical order: a running
    # count of the kept ones is each node's local id.
    local = torch.where(sel, sel.long().cumsum(1), -1)  # [bs, L*K]
    flat = torch.arange(n_depth * k, device=dev, dtype=torch.int64).expand(bs, -1)
    src = torch.full((bs, n + 1), -1, device=dev, dtype=torch.int64)
    src = src.scatter(1, torch.where(sel, local, n), flat)[:, 1:n]  # [bs, K] survivor per node
    ok = src >= 0
    s = src.clamp(min=0)
    d0 = s // k  # zero-based depth row
    node_rank = cand_rank.gather(1, s)
    node_tok = tok.reshape(bs, n_depth * r).gather(1, d0 * r + node_rank)
    par_slot = cand_par.reshape(bs, n_depth * k).gather(1, s)
    par_local = local.gather(1, ((d0 - 1).clamp(min=0) * k + par_slot))
    par_local = torch.where(d0 == 0, 0, par_local)

    root_i = torch.zeros(bs, 1, device=dev, dtype=torch.int64)
    tokens = torch.cat([anchor_tokens.to(torch.int64).view(bs, 1), torch.where(ok, node_tok, 0)], 1)
    parent = torch.cat([root_i - 1, torch.where(ok, par_local, 0)], 1)
    depth = torch.cat([root_i, torch.where(ok, d0 + 1, 0)], 1)
    node_w = torch.where(ok, cand_w.gather(1, s), float("-inf"))
    logw = torch.cat([torch.zeros(bs, 1, device=dev, dtype=torch.float32), node_w], 1)
    valid = torch.cat([torch.ones(bs, 1, device=dev, dtype=torch.bool), ok], 1)
    return _finish(tokens, parent, depth, logw, valid, n_depth)


def chain_tree(draft_logits: Tensor, anchor_tokens: Tensor) -> DDTree:
    """The drafter's argmax path as a tree, `N = L + 1`; draft_logits `[bs, L, V]`.

    Depths whose best log-prob is -inf (an all -inf row) and everything below become padding.
    """
    bs, n_depth, _ = draft_logits.shape
    dev = draft_logits.device
    lp, tok = draft_topk(draft_logits, 1)
    lp, tok = lp[..., 0], tok[..., 0]  # [bs, L]
    w = lp.cumsum(1)
    ok = torch.isfinite(w)  # a prefix of each row: -inf never recovers
    ids = torch.arange(1, n_depth + 1, device=dev, dtype=torch.int64).expand(bs, -1)
    root_i = torch.zeros(bs, 1, device=dev, dtype=torch.int64)
    tokens = torch.cat([anchor_tokens.to(torch.int64).view(bs, 1), torch.where(ok, tok, 0)], 1)
    parent = torch.cat([root_i - 1, torch.where(ok, ids - 1, 0)], 1)
    depth = torch.cat([root_i, torch.where(ok, ids, 0)], 1)
    zero = torch.zeros(bs, 1, device=dev, dtype=torch.float32)
    logw = torch.cat([zero, torch.where(ok, w, float("-inf"))], 1)
    valid = torch.cat([torch.ones(bs, 1, device=dev, dtype=torch.bool), ok], 1)
    return _finish(tokens, parent, depth, logw, valid, n_depth)


def build_ddtree_host(draft_logits: Tensor, budget: int, anchor_tokens: Tensor) -> DDTree:
    """`build_ddtree`'s tree by a best-first heap over rank tuples on the host: the eager CPU
    step's builder (a few hundred Python operations on `bs x D x R` numbers cost less than the
    device builder's hundred-odd tiny tensor ops there, `bench.tree`) and the tests' reference for
    the device one. Host reads: never inside a graph.

    Pops by (weight, depth, rank tuple), so exact ties prefer the shallower, then the
    lexicographically smaller tuple, as the device builder's stable selections do; weights
    accumulate in fp32 in the same order, so the two agree bit for bit, layout included.
    """
    k = budget
    draft_logits = draft_logits[:, :k]
    bs, n_depth, vocab = draft_logits.shape
    r, n = min(k, vocab), k + 1
    lp_t, tok_t = draft_topk(draft_logits, r)
    lp = lp_t.cpu().tolist()  # fp32 values, exact as Python floats
    tok = tok_t.cpu().numpy()
    f32 = np.float32
    tokens = np.zeros((bs, n), np.int64)
    parent = np.zeros((bs, n), np.int64)
    depth = np.zeros((bs, n), np.int64)
    logw = np.full((bs, n), -np.inf, np.float32)
    valid = np.zeros((bs, n), bool)
    tokens[:, 0] = anchor_tokens.cpu().numpy()
    parent[:, 0], logw[:, 0], valid[:, 0] = -1, 0.0, True
    inf = float("inf")
    for b in range(bs):
        w = lp[b]
        weight = {(): 0.0}
        heap = [(-w[0][0], 1, (0,))]
        kept: list[tuple[int, ...]] = []
        while heap and len(kept) < k:
            neg, d, tup = heapq.heappop(heap)
            if neg == inf:
                break  # everything left is -inf: those slots are padding
            kept.append(tup)
            weight[tup] = -neg
            last, base = tup[-1], weight[tup[:-1]]
            if last + 1 < r:
                sib = w[0][last + 1] if d == 1 else float(f32(base + w[d - 1][last + 1]))
                heapq.heappush(heap, (-sib, d, tup[:-1] + (last + 1,)))
            if d < n_depth:
                heapq.heappush(heap, (-float(f32(-neg + w[d][0])), d + 1, tup + (0,)))
        kept.sort(key=lambda t: (len(t), t))  # canonical: depth-major, lexicographic
        ids = {(): 0}
        for i, tup in enumerate(kept, start=1):
            ids[tup] = i
            d = len(tup)
            tokens[b, i] = tok[b, d - 1, tup[-1]]
            parent[b, i], depth[b, i] = ids[tup[:-1]], d
            logw[b, i], valid[b, i] = weight[tup], True
    # Retrieval arrays: siblings are contiguous, so the next sibling is the next column and a
    # first child is where a run of equal parents starts.
    cols = np.arange(n)
    same = valid[:, 1:] & (parent[:, 1:] == parent[:, :-1])
    next_sibling = np.full((bs, n), -1, np.int64)
    next_sibling[:, :-1] = np.where(same, cols[1:], -1)
    next_token = np.full((bs, n), -1, np.int64)
    rb, ri = np.nonzero(valid[:, 1:] & ~same)
    next_token[rb, parent[rb, ri + 1]] = ri + 1
    # Ancestors precede their descendants: each row is its parent's plus itself (padding: the
    # root's, which is the root alone).
    visible = np.zeros((bs, n, n), bool)
    visible[:, cols, cols] = True
    rows = np.arange(bs)
    for i in range(1, n):
        visible[:, i] |= visible[rows, parent[:, i]]

    def t(x: np.ndarray) -> Tensor:
        return torch.from_numpy(x).to(draft_logits.device)

    return DDTree(t(tokens), t(parent), t(depth), t(logw), t(valid), t(next_token),
                  t(next_sibling), t(visible))
