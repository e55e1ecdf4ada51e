"""DDTree builder: device algorithm against the heap reference, layout and retrieval invariants."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from ops.tree import DDTree, build_ddtree, build_ddtree_host, chain_tree, draft_topk
from tests.fakeguard import run_on_fake

FIELDS = ("tokens", "parent", "depth", "logw", "valid", "next_token", "next_sibling", "visible")


def random_logits(g: torch.Generator, bs: int, depth: int, vocab: int, neg_inf: bool) -> Tensor:
    """`[bs, L, V]` logits of random sharpness; optionally some -inf tokens and whole -inf rows."""
    scale = torch.rand(bs, depth, 1, generator=g) * 4 + 0.3
    x = torch.randn(bs, depth, vocab, generator=g) * scale
    if neg_inf:
        x = x.masked_fill(torch.rand(bs, depth, vocab, generator=g) < 0.4, float("-inf"))
        x = x.masked_fill(torch.rand(bs, depth, 1, generator=g) < 0.05, float("-inf"))
    return x


def node_map(tree: DDTree, b: int) -> dict[tuple[int, ...], tuple[float, int]]:
    """Valid nodes of request `b` keyed by token path (found through `parent`): (logw, depth)."""
    tokens, parent = tree.tokens[b].tolist(), tree.parent[b].tolist()
    logw, depth, valid = tree.logw[b].tolist(), tree.depth[b].tolist(), tree.valid[b].tolist()
    out = {}
    for i in range(1, len(tokens)):
        if valid[i]:
            toks, j = [], i
            while j > 0:
                toks.append(tokens[j])
                j = parent[j]
            out[tuple(reversed(toks))] = (logw[i], depth[i])
    return out


def check_structure(tree: DDTree) -> None:
    """Layout, retrieval arrays and mask, checked node by node against their definitions."""
    bs, n = tree.tokens.shape
    assert tree.visible.shape == (bs, n, n)
    for b in range(bs):
        valid = tree.valid[b].tolist()
        parent, depth = tree.parent[b].tolist(), tree.depth[b].tolist()
        nt, ns = tree.next_token[b].tolist(), tree.next_sibling[b].tolist()
        logw = tree.logw[b].tolist()
        assert valid[0] and parent[0] == -1 and depth[0] == 0 and logw[0] == 0.0
        count = sum(valid)
        assert valid == [True] * count + [False] * (n - count), "padding must fill the tail"
        for i in range(1, n):
            if valid[i]:
                assert 0 <= parent[i] < i and valid[parent[i]]
                assert depth[i] == depth[parent[i]] + 1
                assert depth[i] >= depth[i - 1], "depth-major order"
                assert math.isfinite(logw[i]) and logw[i] <= logw[parent[i]]
            else:
                assert (parent[i], depth[i], int(tree.tokens[b, i])) == (0, 0, 0)
                assert logw[i] == float("-inf") and nt[i] == -1 and ns[i] == -1
        # Walk the first-child/next-sibling links from the root: each valid non-root node exactly
        # once, reached from its own parent, siblings in descending logw.
        seen = [0] * n
        stack = [0]
        while stack:
            p = stack.pop()
            c, prev = nt[p], None
            while c != -1:
                assert valid[c] and parent[c] == p
                if prev is not None:
                    assert logw[c] <= logw[prev]
                    assert c == prev + 1, "siblings contiguous"
                seen[c] += 1
                stack.append(c)
                prev, c = c, ns[c]
        assert seen[1:] == [1 if v else 0 for v in valid[1:]]
        assert ns[0] == -1
        expect = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            expect[i, i] = expect[i, 0] = True
            j = parent[i] if valid[i] else -1
            while j >= 0:
                expect[i, j] = True
                j = parent[j]
        assert torch.equal(tree.visible[b], expect)


def assert_same_tree(got: DDTree, ref: DDTree) -> None:
    for name in FIELDS:
        a, b = getattr(got, name), getattr(ref, name)
        if name == "logw":
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(a, b), name
    for b in range(got.tokens.shape[0]):
        mg, mr = node_map(got, b), node_map(ref, b)
        assert mg.keys() == mr.keys()
        for key, (w, d) in mr.items():
            assert mg[key][1] == d and math.isclose(mg[key][0], w, rel_tol=1e-6, abs_tol=1e-6)


def test_device_matches_heap_reference_on_random_inputs() -> None:
    g = torch.Generator().manual_seed(1234)
    trees = 0
    for call in range(360):
        bs = int(torch.randint(1, 9, (1,), generator=g))
        depth = int(torch.randint(1, 7, (1,), generator=g))
        vocab = int(torch.randint(2, 51, (1,), generator=g))
        budget = int(torch.randint(1, 65, (1,), generator=g))
        logits = random_logits(g, bs, depth, vocab, neg_inf=call % 3 == 0)
        anchor = torch.randint(0, vocab, (bs,), generator=g)
        got = build_ddtree(logits, budget, anchor)
        assert_same_tree(got, build_ddtree_host(logits, budget, anchor))
        assert bool((~got.valid | torch.isfinite(got.logw)).all())
        if call % 8 == 0:
            check_structure(got)
        trees += bs
    assert trees > 1500


def test_exact_ties_keep_weights_and_closure() -> None:
    g = torch.Generator().manual_seed(99)
    for _ in range(150):
        bs = int(torch.randint(1, 5, (1,), generator=g))
        depth = int(torch.randint(1, 6, (1,), generator=g))
        vocab = int(torch.randint(2, 9, (1,), generator=g))
        budget = int(torch.randint(1, 41, (1,), generator=g))
        logits = torch.round(torch.randn(bs, depth, vocab, generator=g) * 2) / 2
        anchor = torch.zeros(bs, dtype=torch.int64)
        got = build_ddtree(logits, budget, anchor)
        ref = build_ddtree_host(logits, budget, anchor)
        check_structure(got)
        assert_same_tree(got, ref)  # the host heap breaks exact ties as the device selections do
        _, toks = draft_topk(logits, min(budget, vocab))
        for b in range(bs):
            wg = sorted(got.logw[b, got.valid[b]].tolist())
            wr = sorted(ref.logw[b, ref.valid[b]].tolist())
            assert wg == wr
            # Closed under previous siblings: the children of every node are the first ranks of
            # their depth, in rank order.
            valid, parent = got.valid[b].tolist(), got.parent[b].tolist()
            tokens, depth = got.tokens[b].tolist(), got.depth[b].tolist()
            ranked = toks[b].tolist()
            kids: dict[int, list[int]] = {}
            for i in range(1, budget + 1):
                if valid[i]:
                    kids.setdefault(parent[i], []).append(i)
            for ids in kids.values():
                row = ranked[depth[ids[0]] - 1]
                assert [tokens[i] for i in ids] == row[: len(ids)]


@pytest.mark.parametrize(
    ("bs", "depth", "vocab", "budget"),
    [(3, 2, 3, 20), (2, 1, 10, 5), (2, 4, 10, 1), (1, 1, 2, 1), (4, 5, 2, 64)],
)
def test_edge_shapes(bs: int, depth: int, vocab: int, budget: int) -> None:
    g = torch.Generator().manual_seed(bs * 100 + budget)
    logits = torch.randn(bs, depth, vocab, generator=g)
    anchor = torch.arange(bs)
    got = build_ddtree(logits, budget, anchor)
    assert got.tokens.shape == (bs, budget + 1)
    check_structure(got)
    assert_same_tree(got, build_ddtree_host(logits, budget, anchor))
    assert torch.equal(got.tokens[:, 0], anchor)
    n_possible = sum(vocab**d for d in range(1, depth + 1))
    assert torch.equal(got.valid.sum(1), torch.full((bs,), 1 + min(budget, n_possible)))


def test_all_neg_inf_rows_become_padding() -> None:
    logits = torch.randn(2, 3, 6, generator=torch.Generator().manual_seed(0))
    logits[0, 1] = float("-inf")  # nothing past depth 1 for request 0
    logits[1, 0, 2:] = float("-inf")  # two candidates at depth 1 for request 1
    got = build_ddtree(logits, 12, torch.tensor([1, 2]))
    check_structure(got)
    assert int(got.depth[0].max()) == 1 and int(got.valid[0].sum()) == 7
    # only the two candidates can sit at depth 1 (the second one only if it is among the best)
    assert set(got.tokens[1, got.depth[1] == 1].tolist()) <= {0, 1}
    assert_same_tree(got, build_ddtree_host(logits, 12, torch.tensor([1, 2])))


def test_chain_tree_is_the_argmax_path() -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 4, 9, generator=g)
    logits[2, 2] = float("-inf")
    chain = chain_tree(logits, torch.tensor([7, 8, 9]))
    check_structure(chain)
    assert torch.equal(chain.tokens[:2, 1:], logits[:2].argmax(-1))
    assert torch.equal(chain.valid[2], torch.tensor([True, True, True, False, False]))
    assert torch.equal(chain.next_token[0], torch.tensor([1, 2, 3, 4, -1]))
    assert bool((chain.next_sibling == -1).all())
    lw = torch.log_softmax(logits[0], -1).max(-1).values.cumsum(0)
    torch.testing.assert_close(chain.logw[0, 1:], lw)


def test_positions_are_cache_len_plus_depth() -> None:
    tree = build_ddtree(torch.randn(2, 3, 5), 6, torch.tensor([0, 1]))
    pos = tree.positions(torch.tensor([10, 20]))
    assert torch.equal(pos, torch.tensor([[10], [20]]) + tree.depth)


def test_builders_run_on_fake_tensors() -> None:
    logits, anchor = torch.randn(3, 15, 40), torch.zeros(3, dtype=torch.int64)
    tree = run_on_fake(build_ddtree, logits, 16, anchor)
    for name in FIELDS:
        shape = (3, 17, 17) if name == "visible" else (3, 17)
        assert tuple(getattr(tree, name).shape) == shape, name
    chain = run_on_fake(chain_tree, logits, anchor)
    assert tuple(chain.visible.shape) == (3, 16, 16) and tuple(chain.tokens.shape) == (3, 16)
