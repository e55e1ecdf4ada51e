"""Decide ops: known answers, a host emulation, exactness in distribution, graph safety."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from scipy import stats
from torch import Tensor
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

from ops.sampling import row_promises, sample_from_probs, target_probs
from ops.tree import DDTree, build_ddtree
from ops.verify import Decision, tree_greedy, tree_greedy_host, tree_sample
from tests.fakeguard import run_on_fake
from tests.test_sampling import race_reference

# Per-check false-alarm rate; with at most 100 seeded checks the family rate stays under 1e-4.
ALPHA = 1e-6


# --- the known-answer vector of the spec ------------------------------------------------------

KA_CAND = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]])
KA_NEXT = torch.tensor([[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]])
KA_SIB = torch.tensor([[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]])


def known_answer_logits() -> Tensor:
    logits = torch.ones(2, 6, 20)
    logits[:, :, 18] = 10.0
    for b, i, t in [(0, 0, 3), (0, 3, 4), (0, 4, 5), (1, 0, 11), (1, 4, 12)]:
        logits[b, i, 18] = 1.0
        logits[b, i, t] = 10.0
    return logits


def flat_to_local(flat: list[list[int]], n: int, width: int) -> Tensor:
    rows = [[f - b * n if f >= 0 else -1 for f in row] for b, row in enumerate(flat)]
    return torch.tensor([row + [-1] * (width - len(row)) for row in rows])


def padded(rows: list[list[int]], width: int) -> Tensor:
    return torch.tensor([row + [-1] * (width - len(row)) for row in rows])


@pytest.mark.parametrize("max_accept", [None, 3, 5])
def test_known_answer_sampling(max_accept: int | None) -> None:
    logits = known_answer_logits()
    ones = torch.ones(2)
    q = target_probs(logits, ones * 0.01, torch.zeros(2, dtype=torch.int64), ones)
    width = 6 if max_accept is None else min(6, max_accept + 1)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        out = tree_sample(
            KA_CAND,
            KA_NEXT,
            KA_SIB,
            q,
            torch.rand(2, 6, generator=g),
            max_accept=max_accept,
        )
        assert torch.equal(
            out.accept_nodes, flat_to_local([[0, 3, 4, 5], [6, 10, 11, -1]], 6, width)
        )
        assert torch.equal(out.accept_len, torch.tensor([3, 2]))
        assert torch.equal(out.emit, padded([[3, 4, 5, 18], [11, 12, 18]], width))


@pytest.mark.parametrize("walk", [tree_greedy, tree_greedy_host])
def test_known_answer_greedy_and_depth_limit(walk) -> None:
    argmax = known_answer_logits().argmax(-1)
    out = walk(KA_CAND, KA_NEXT, KA_SIB, argmax)
    assert torch.equal(out.accept_nodes, padded([[0, 3, 4, 5], [0, 4, 5]], 6))
    assert torch.equal(out.accept_len, torch.tensor([3, 2]))
    assert torch.equal(out.emit, padded([[3, 4, 5, 18], [11, 12, 18]], 6))
    # Two drafts at most: the bonus comes from the second accepted node's own row.
    out = walk(KA_CAND, KA_NEXT, KA_SIB, argmax, max_accept=2)
    assert torch.equal(out.accept_nodes, torch.tensor([[0, 3, 4], [0, 4, 5]]))
    assert torch.equal(out.emit, torch.tensor([[3, 4, 5], [11, 12, 18]]))
    q = torch.softmax(known_answer_logits() / 0.01, -1)
    out = tree_sample(KA_CAND, KA_NEXT, KA_SIB, q, torch.rand(2, 6), max_accept=2)
    assert torch.equal(out.emit, torch.tensor([[3, 4, 5], [11, 12, 18]]))
    out = tree_sample(KA_CAND, KA_NEXT, KA_SIB, q, torch.rand(2, 6), max_accept=0)
    assert torch.equal(out.emit, torch.tensor([[3], [11]]))
    assert torch.equal(out.accept_nodes, torch.tensor([[0], [0]]))


# --- the host walk (`tree_greedy_host`, the walk as stated) against the device one ----------


def naive_draws(probs, coins) -> Tensor:
    """Every node's draw with its coin, by the race's statement (`race_reference`)."""
    return torch.tensor([[race_reference(list(p), float(c)) for p, c in zip(pr, cr)]
                         for pr, cr in zip(probs.numpy(), coins.numpy())])


def shuffle_layout(tree: DDTree, g: torch.Generator) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Renumber the non-root nodes at random: the decide ops must not rely on the canonical order.

    Returns candidates, next_token, next_sibling and `old_of_new` `[bs, N]`.
    """
    bs, n = tree.tokens.shape
    old_of_new = torch.stack(
        [
            torch.cat([torch.zeros(1, dtype=torch.int64), torch.randperm(n - 1, generator=g) + 1])
            for _ in range(bs)
        ]
    )
    new_of_old = torch.argsort(old_of_new, dim=1)

    def relink(links: Tensor) -> Tensor:
        moved = links.gather(1, old_of_new)
        return torch.where(moved >= 0, new_of_old.gather(1, moved.clamp(min=0)), -1)

    cand = tree.tokens.gather(1, old_of_new)
    return cand, relink(tree.next_token), relink(tree.next_sibling), old_of_new


def assert_same_decision(out: Decision, expect: Decision) -> None:
    for name in ("accept_nodes", "accept_len", "emit"):
        assert torch.equal(getattr(out, name), getattr(expect, name)), name


def test_sample_and_greedy_match_host_emulation() -> None:
    g = torch.Generator().manual_seed(21)
    for trial in range(40):
        bs = 12
        depth = int(torch.randint(1, 6, (1,), generator=g))
        vocab = int(torch.randint(4, 16, (1,), generator=g))
        budget = int(torch.randint(1, 20, (1,), generator=g))
        tree = build_ddtree(torch.randn(bs, depth, vocab, generator=g) * 2, budget, torch.zeros(bs))
        n = budget + 1
        # Target logits nudged toward each node's children so that walks go deep.
        boost = torch.zeros(bs, n, vocab)
        src = tree.valid & (tree.parent >= 0)
        flat = torch.where(src, tree.parent.clamp(min=0) * vocab + tree.tokens, 0)
        boost.view(bs, -1).scatter_add_(1, flat, src.float() * 2.5)
        logits = torch.randn(bs, n, vocab, generator=g) + boost
        temp = torch.rand(bs, generator=g) + 0.3
        top_k = torch.randint(0, vocab, (bs,), generator=g)
        top_p = torch.where(torch.rand(bs, generator=g) < 0.5, 1.0, torch.rand(bs, generator=g))
        probs = target_probs(logits, temp, top_k, top_p)
        if trial % 2:
            cand, nt, ns, old_of_new = shuffle_layout(tree, g)
            probs = probs.gather(1, old_of_new[:, :, None].expand(bs, n, vocab))
        else:
            cand, nt, ns = tree.tokens, tree.next_token, tree.next_sibling
        coins = torch.rand(bs, n, generator=g)
        coins[:, 0] = torch.where(torch.rand(bs, generator=g) < 0.2, 0.0, coins[:, 0])
        argmax = probs.argmax(-1)
        max_accept = None if trial % 3 == 0 else int(torch.randint(0, depth + 1, (1,), generator=g))
        width = n if max_accept is None else min(n, max_accept + 1)

        expect = tree_greedy_host(cand, nt, ns, naive_draws(probs, coins), max_accept)
        assert expect.emit.shape == (bs, width)
        assert_same_decision(tree_sample(cand, nt, ns, probs, coins, max_accept=max_accept),
                             expect)
        expect = tree_greedy_host(cand, nt, ns, argmax, max_accept)
        assert_same_decision(tree_greedy(cand, nt, ns, argmax, max_accept=max_accept), expect)


def test_strict_rule_and_empty_rows() -> None:
    # Root with children node 1 (token 2) and node 2 (token 5), V = 8; below them token 6.
    cand = torch.tensor([[0, 2, 5]] * 4)
    nt = torch.tensor([[1, -1, -1]] * 4)
    ns = torch.tensor([[-1, 2, -1]] * 4)
    probs = torch.zeros(4, 3, 8)
    probs[:, 1:, 6] = 1.0
    # Row 0: the first child (token 2) has no mass and is never accepted, whatever the coin;
    # its sibling (token 5) is light and nearly never is (token 7 takes the draw).
    probs[0, 0, 5], probs[0, 0, 7] = 1e-6, 1.0
    probs[1, 0, 2], probs[1, 0, 5] = 0.4, 0.6  # both children have mass: the race picks one
    # Row 2: an all-zero row draws token 0, which no child holds.
    probs[3, 0, 7] = 1.0  # every child has zero mass: none is accepted, whatever the coin
    coins = torch.tensor([[0.0, 0.5, 0.5], [1 - 2**-24, 0.5, 0.5], [0.5] * 3, [0.0, 0.5, 0.5]])
    out = tree_sample(cand, nt, ns, probs, coins)
    first = [race_reference(probs[b, 0].tolist(), float(coins[b, 0])) for b in range(4)]
    assert first[0] in (5, 7) and first[1] in (2, 5) and first[2:] == [0, 7]
    node = {2: 1, 5: 2}
    assert out.accept_len.tolist() == [int(first[0] == 5), 1, 0, 0]
    assert out.emit[:, :2].tolist() == [[5, 6] if first[0] == 5 else [7, -1], [first[1], 6],
                                        [0, -1], [7, -1]]
    assert out.accept_nodes[:, :2].tolist() == [[0, 2] if first[0] == 5 else [0, -1],
                                                [0, node[first[1]]], [0, -1], [0, -1]]
    # Over many coins the light child is accepted about as often as its mass says.
    many = torch.rand(20_000, 3, generator=torch.Generator().manual_seed(2))
    out = tree_sample(cand[:1].expand(20_000, 3), nt[:1].expand(20_000, 3),
                      ns[:1].expand(20_000, 3), probs[:1].expand(20_000, 3, 8), many)
    assert int(out.accept_len.sum()) <= 5


def test_long_sibling_chains() -> None:
    # A star: 40 children of the root; the target wants the last one (rank 39).
    tree = build_ddtree(-torch.arange(40.0).expand(2, 1, 40), 40, torch.zeros(2))
    assert int(tree.next_token[0, 0]) == 1 and int(tree.tokens[0, 40]) == 39
    argmax = torch.zeros(2, 41, dtype=torch.int64)
    argmax[:, 0] = torch.tensor([39, 7])
    out = tree_greedy(tree.tokens, tree.next_token, tree.next_sibling, argmax)
    assert out.accept_nodes[:, :2].tolist() == [[0, 40], [0, 8]]
    assert_same_decision(out, tree_greedy_host(tree.tokens, tree.next_token, tree.next_sibling,
                                               argmax))
    probs = torch.zeros(2, 41, 40)
    probs[:, 0, 39] = 1.0
    probs[:, 1:, 0] = 1.0
    out = tree_sample(tree.tokens, tree.next_token, tree.next_sibling, probs, torch.rand(2, 41))
    assert out.emit[:, :2].tolist() == [[39, 0], [39, 0]]


def test_padding_rows_do_not_change_real_rows() -> None:
    g = torch.Generator().manual_seed(8)
    tree = build_ddtree(torch.randn(4, 3, 9, generator=g), 10, torch.zeros(4))
    probs = torch.softmax(torch.randn(4, 11, 9, generator=g), -1)
    coins = torch.rand(4, 11, generator=g)
    full = tree_sample(tree.tokens, tree.next_token, tree.next_sibling, probs, coins)
    for b in range(4):
        one = tree_sample(
            tree.tokens[b : b + 1],
            tree.next_token[b : b + 1],
            tree.next_sibling[b : b + 1],
            probs[b : b + 1],
            coins[b : b + 1],
        )
        for name in ("accept_nodes", "accept_len", "emit"):
            assert torch.equal(getattr(one, name)[0], getattr(full, name)[b])


# --- exactness in distribution ----------------------------------------------------------------


def chi2_ok(observed: Tensor, probs: Tensor) -> bool:
    """Chi-square goodness of fit with cells of expected count < 5 pooled; impossible cells must
    stay empty."""
    obs = observed.double().numpy()
    exp = probs.double().clamp(min=0).numpy()
    exp = exp / exp.sum() * obs.sum()
    if obs[exp == 0].sum() > 0:
        return False
    small = exp < 5
    cells_o = list(obs[~small]) + ([obs[small].sum()] if small.any() else [])
    cells_e = list(exp[~small]) + ([exp[small].sum()] if small.any() else [])
    if len(cells_o) < 2:
        return True
    if cells_e[-1] < 5 and small.any():  # a pooled bin that is still tiny joins the smallest cell
        j = int(np.argmin(cells_e[:-1]))
        cells_o[j] += cells_o.pop()
        cells_e[j] += cells_e.pop()
    if len(cells_o) < 2:
        return True
    return bool(stats.chisquare(cells_o, cells_e).pvalue > ALPHA)


class PathTarget:
    """q(. | prefix) as a fixed function of the drafted token prefix (anchor excluded)."""

    def __init__(self, vocab: int, temp: float, top_k: int, top_p: float, seed: int) -> None:
        self.vocab, self.seed = vocab, seed
        self.params = (torch.tensor([temp]), torch.tensor([top_k]), torch.tensor([top_p]))
        self.cache: dict[tuple[int, ...], Tensor] = {}

    def __call__(self, prefix: tuple[int, ...]) -> Tensor:
        if prefix not in self.cache:
            g = torch.Generator().manual_seed(zlib.crc32(repr((self.seed, prefix)).encode()))
            logits = torch.randn(1, self.vocab, generator=g)
            self.cache[prefix] = target_probs(logits, *self.params)[0]
        return self.cache[prefix]

    def rows(self, tree: DDTree) -> Tensor:
        """`[1, N, V]`: each node's row from its own token path."""
        tokens, parent = tree.tokens[0].tolist(), tree.parent[0].tolist()
        out = []
        for i in range(len(tokens)):
            toks, j = [], i
            while j > 0:
                toks.append(tokens[j])
                j = parent[j]
            out.append(self(tuple(reversed(toks))))
        return torch.stack(out)[None]


CONFIGS = [  # temperature, top_k, top_p
    (1.0, 0, 1.0),
    (0.7, 4, 1.0),
    (1.3, 0, 0.8),
    (0.8, 6, 0.95),
    (2.0, 5, 0.9),
    (1.0, 1, 1.0),  # greedy row inside a sampling batch
]
DRAWS = 20_000


def sampled_batch(config_id: int, seed: int = 1000, target: PathTarget | None = None
                  ) -> tuple[DDTree, PathTarget, Decision, Tensor]:
    """One random tree, `DRAWS` copies, decided by `tree_sample` (against `target`, by default a
    `PathTarget` of the config) with independent coins per position, a node taking its depth's,
    as the engine gives them. Returns the tree, the target, the decisions and the coins
    `[DRAWS, depth + 1]`."""
    g = torch.Generator().manual_seed(seed + config_id)
    vocab = 8 + config_id % 5
    depth = 2 + config_id % 3
    budget = 4 + 3 * config_id
    target = target or PathTarget(vocab, *CONFIGS[config_id], seed=config_id)
    # A drafter that roughly knows the target along its greedy path, so that the walk goes deep.
    rows, prefix = [], ()
    for _ in range(depth):
        q = target(prefix)
        rows.append(torch.log(q + 1e-2) + torch.randn(vocab, generator=g))
        prefix = prefix + (int(q.argmax()),)
    tree = build_ddtree(torch.stack(rows)[None], budget, torch.zeros(1))
    probs = target.rows(tree)
    n = budget + 1
    coins = torch.rand(DRAWS, depth + 1, generator=g)
    out = tree_sample(
        tree.tokens.expand(DRAWS, n),
        tree.next_token.expand(DRAWS, n),
        tree.next_sibling.expand(DRAWS, n),
        probs.expand(DRAWS, n, vocab),
        coins.gather(1, tree.depth.expand(DRAWS, n)),
    )
    return tree, target, out, coins


@pytest.mark.parametrize("config_id", range(len(CONFIGS)))
def test_each_child_accepted_with_its_target_probability(config_id: int) -> None:
    tree, target, out, _ = sampled_batch(config_id)
    tokens, parent = tree.tokens[0].tolist(), tree.parent[0].tolist()
    valid = tree.valid[0].tolist()
    checked = 0
    # At the root, and at every depth-1 node conditioned on the walk having reached it.
    for node, col in [(0, 1)] + [(i, 2) for i in range(1, len(tokens)) if tree.depth[0, i] == 1]:
        kids = [i for i in range(1, len(tokens)) if valid[i] and parent[i] == node]
        reached = out.accept_nodes[:, col - 1] == node
        if not kids or int(reached.sum()) < 200:
            continue
        q = target(() if node == 0 else (tokens[node],))
        q_kids = torch.stack([q[tokens[c]] for c in kids])
        expected = torch.cat([q_kids, (1 - q_kids.sum()).clamp(min=0)[None]])
        nxt = out.accept_nodes[reached, col]
        observed = torch.stack([(nxt == c).sum() for c in kids] + [(nxt == -1).sum()])
        assert chi2_ok(observed, expected), (node, observed.tolist(), expected.tolist())
        checked += 1
    assert checked >= 1


@pytest.mark.parametrize("config_id", range(len(CONFIGS)))
def test_first_two_emitted_tokens_follow_the_target(config_id: int) -> None:
    tree, target, out, coins = sampled_batch(config_id)
    vocab = target.vocab
    q_root = target(())
    first = out.emit[:, 0]
    assert chi2_ok(torch.bincount(first, minlength=vocab), q_root)
    # The second token: the tree's, or (when the step ended on its bonus) the next step's draw
    # after that bonus, from the same prefix function, with the second position's coin: the one
    # the tree's depth-1 nodes drew with (the engine's next step reads it again).
    after_first = torch.stack([target((t,)) for t in range(vocab)])  # [V, V]
    fresh = sample_from_probs(after_first[first], coins[:, 1])
    second = torch.where(out.accept_len >= 1, out.emit[:, 1], fresh)
    joint = q_root[:, None] * after_first
    assert chi2_ok(torch.bincount(first * vocab + second, minlength=vocab * vocab), joint.flatten())
    assert int((out.accept_len >= 1).sum()) > DRAWS // 4, "the tree path must be exercised"
    root_kids = tree.tokens[0, (tree.parent[0] == 0) & tree.valid[0]]
    if 1 - float(q_root[root_kids].sum()) > 0.05:
        assert int((out.accept_len == 0).sum()) > DRAWS // 100, "and so must the root's bonus"


@pytest.mark.parametrize("config_id", range(len(CONFIGS)))
def test_sampled_walk_emits_what_plain_decoding_emits(config_id: int) -> None:
    # Plain decoding draws the token of position j from the target given the tokens before it,
    # with position j's coin; every decision's emitted tokens must be exactly those.
    tree, target, out, coins = sampled_batch(config_id)
    deep = 0
    for d in range(0, DRAWS, 10):
        emitted = out.emit[d, : int(out.accept_len[d]) + 1].tolist()
        plain: list[int] = []
        for j in range(len(emitted)):
            q = target(tuple(plain))
            plain.append(int(sample_from_probs(q[None], coins[d, j : j + 1])[0]))
        assert emitted == plain, (d, emitted, plain)
        deep += len(emitted) > 2
    assert deep > 0, "some walks must go past the first draft"


# --- graph safety -----------------------------------------------------------------------------


def small_inputs() -> tuple[DDTree, Tensor, Tensor]:
    tree = build_ddtree(torch.randn(3, 4, 12), 8, torch.zeros(3))
    probs = torch.softmax(torch.randn(3, 9, 12), -1)
    return tree, probs, torch.rand(3, 9)


def test_decide_runs_on_fake_tensors() -> None:
    tree, probs, coins = small_inputs()
    links = (tree.tokens, tree.next_token, tree.next_sibling)
    out = run_on_fake(tree_sample, *links, probs, coins, max_accept=4)
    assert tuple(out.accept_nodes.shape) == (3, 5) and tuple(out.emit.shape) == (3, 5)
    assert tuple(out.accept_len.shape) == (3,)
    out = run_on_fake(tree_greedy, *links, probs.argmax(-1))
    assert tuple(out.accept_nodes.shape) == (3, 9) and tuple(out.emit.shape) == (3, 9)

    def whole_step(logits: Tensor, target_logits: Tensor, coins: Tensor):
        tree = build_ddtree(logits, 8, torch.zeros(3, dtype=torch.int64))
        ones = torch.ones(3)
        q = target_probs(target_logits, ones, torch.full((3,), 5), ones * 0.9)
        return tree_sample(tree.tokens, tree.next_token, tree.next_sibling, q, coins)

    out = run_on_fake(whole_step, torch.randn(3, 4, 12), torch.randn(3, 9, 12), coins)
    assert tuple(out.emit.shape) == (3, 9)


def test_fake_guard_catches_host_syncs_and_dynamic_shapes() -> None:
    tree, probs, coins = small_inputs()
    links = (tree.tokens, tree.next_token, tree.next_sibling)

    def with_item(*args: Tensor) -> int:
        return tree_sample(*args).accept_len.sum().item()

    def with_mask(t: DDTree) -> Tensor:
        return t.tokens[t.valid]

    def with_nonzero(*args: Tensor) -> Tensor:
        return tree_greedy(*args).accept_nodes.nonzero()

    def with_branch(*args: Tensor) -> Tensor:
        out = tree_greedy(*args)
        return out.emit if bool((out.accept_len > 0).any()) else out.accept_nodes

    with pytest.raises(DataDependentOutputException):
        run_on_fake(with_item, *links, probs, coins)
    with pytest.raises(DynamicOutputShapeException):
        run_on_fake(with_mask, tree)
    with pytest.raises(DynamicOutputShapeException):
        run_on_fake(with_nonzero, *links, probs.argmax(-1))
    with pytest.raises(DataDependentOutputException):
        run_on_fake(with_branch, *links, probs.argmax(-1))
    # The unplanted calls are fine, so the raises above come from the planted lines.
    run_on_fake(tree_sample, *links, probs, coins)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_replay_matches_cpu() -> None:
    bs, depth, vocab, budget = 4, 7, 64, 16
    n = budget + 1
    g = torch.Generator().manual_seed(0)

    def inputs() -> list[Tensor]:
        return [
            torch.randn(bs, depth, vocab, generator=g),
            torch.randint(0, vocab, (bs,), generator=g),
            torch.randn(bs, n, vocab, generator=g),
            torch.rand(bs, n, generator=g),
        ]

    params = (
        torch.tensor([1.0, 0.7, 1.0, 1.3]),
        torch.tensor([0, 5, 1, 0]),
        torch.tensor([1.0, 0.9, 1.0, 0.8]),
    )

    def step(logits, anchor, target_logits, coins, temp, top_k, top_p):
        tree = build_ddtree(logits, budget, anchor)
        q = target_probs(target_logits, temp, top_k, top_p)
        links = (tree.tokens, tree.next_token, tree.next_sibling)
        sampled = tree_sample(*links, q, coins, max_accept=depth)
        greedy = tree_greedy(*links, target_logits.argmax(-1), max_accept=depth)
        return [
            tree.tokens,
            tree.parent,
            tree.visible,
            sampled.accept_nodes,
            sampled.emit,
            greedy.accept_nodes,
            greedy.emit,
        ]

    static = [x.cuda() for x in inputs() + list(params)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(*static)
    for _ in range(3):
        fresh = inputs()
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        expect = step(*fresh, *params)
        for got, ref in zip(outs, expect):
            assert torch.equal(got.cpu(), ref)


# --- the bounded top-k path of target_probs inside the decide ---------------------------------


class BoundedPathTarget(PathTarget):
    """`PathTarget` through the bounded top-k path with a tiny `bound`, so that top-k and nuclei
    overflow it and the fallback sort serves them; the row counts are the host's
    (`row_promises`)."""

    def __init__(self, vocab: int, temp: float, top_k: int, top_p: float, seed: int, bound: int):
        super().__init__(vocab, temp, top_k, top_p, seed)
        promises = row_promises([(top_k, top_p)], vocab, bound)
        self.kwargs = {"bound": bound, "topk_rows": promises["topk_rows"],
                       "sort_rows": promises["sort_rows"]}
        self.reference = PathTarget(vocab, temp, top_k, top_p, seed)

    def __call__(self, prefix: tuple[int, ...]) -> Tensor:
        if prefix not in self.cache:
            g = torch.Generator().manual_seed(zlib.crc32(repr((self.seed, prefix)).encode()))
            logits = torch.randn(1, self.vocab, generator=g)
            q = target_probs(logits, *self.params, **self.kwargs)[0]
            ref = self.reference(prefix)
            assert torch.equal(q > 0, ref > 0)  # same kept set as the full sort
            torch.testing.assert_close(q, ref, rtol=1e-5, atol=1e-6)
            self.cache[prefix] = q
        return self.cache[prefix]


@pytest.mark.parametrize(
    ("top_k", "top_p", "bound"),
    [(0, 0.9, 2), (3, 1.0, 2), (3, 0.5, 1), (1, 1.0, 1), (0, 0.999, 1)],
)
def test_known_answer_on_the_bounded_path(top_k: int, top_p: float, bound: int) -> None:
    logits = known_answer_logits()
    temp = torch.full((2,), 0.01)
    k, p = torch.full((2,), top_k), torch.full((2,), top_p)
    promises = row_promises([(top_k, top_p)] * 2, 20, bound)
    counts = {k: promises[k] for k in ("topk_rows", "sort_rows")}
    q = target_probs(logits, temp, k, p, bound=bound, **counts)
    assert torch.equal(q, target_probs(logits, temp, k, p, bound=bound))
    assert torch.equal(q > 0, target_probs(logits, temp, k, p, bound=None) > 0)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        out = tree_sample(KA_CAND, KA_NEXT, KA_SIB, q, torch.rand(2, 6, generator=g))
        assert torch.equal(out.accept_nodes, flat_to_local([[0, 3, 4, 5], [6, 10, 11, -1]], 6, 6))
        assert torch.equal(out.accept_len, torch.tensor([3, 2]))
        assert torch.equal(out.emit, padded([[3, 4, 5, 18], [11, 12, 18]], 6))


@pytest.mark.parametrize("config_id", [2, 3, 4])
def test_bounded_path_with_fallback_keeps_the_decide_exact(config_id: int) -> None:
    # As sampled_batch, with every target row from the bounded path at bound 2: top-k 5 and 6
    # overflow it, and so do most nuclei of top-p 0.8 / 0.9 at these temperatures.
    target = BoundedPathTarget(8 + config_id % 5, *CONFIGS[config_id], seed=config_id, bound=2)
    assert int((target(()) > 0).sum()) > 2, "the root row must need the fallback"
    _, _, out, coins = sampled_batch(config_id, 2000, target)
    vocab = target.vocab
    q_root = target(())
    first = out.emit[:, 0]
    assert chi2_ok(torch.bincount(first, minlength=vocab), q_root)
    after_first = torch.stack([target((t,)) for t in range(vocab)])
    fresh = sample_from_probs(after_first[first], coins[:, 1])
    second = torch.where(out.accept_len >= 1, out.emit[:, 1], fresh)
    joint = q_root[:, None] * after_first
    assert chi2_ok(torch.bincount(first * vocab + second, minlength=vocab * vocab), joint.flatten())
    assert int((out.accept_len >= 1).sum()) > DRAWS // 4, "the tree path must be exercised"


def test_decide_on_the_bounded_path_runs_on_fake_tensors() -> None:
    g = torch.Generator().manual_seed(0)

    def whole_step(logits: Tensor, target_logits: Tensor, coins: Tensor):
        tree = build_ddtree(logits, 8, torch.zeros(3, dtype=torch.int64))
        q = target_probs(
            target_logits,
            torch.tensor([0.7, 1.0, 1.0]),
            torch.tensor([0, 1, 5]),
            torch.tensor([0.9, 1.0, 0.8]),
            bound=3,
            topk_rows=2,
            sort_rows=1,
        )
        return tree_sample(tree.tokens, tree.next_token, tree.next_sibling, q, coins)

    out = run_on_fake(
        whole_step,
        torch.randn(3, 4, 12, generator=g),
        torch.randn(3, 9, 12, generator=g),
        torch.rand(3, 9, generator=g),
    )
    assert tuple(out.emit.shape) == (3, 9)
