"""Target distributions (temperature, top-k, top-p) and the race that samples them."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy import stats
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

import ops.sampling
from ops.sampling import (
    argmax,
    race_logits,
    race_noise,
    row_path,
    row_promises,
    sample_from_probs,
    target_probs,
)
from tests.fakeguard import run_on_fake


def reference_probs(
    logits: list[float], temperature: float, top_k: int, top_p: float
) -> list[float]:
    """One row, in float64, straight from the definition."""
    vocab = len(logits)
    top = max(x / temperature for x in logits)
    e = [math.exp(x / temperature - top) for x in logits]
    p = [x / sum(e) for x in e]
    order = sorted(range(vocab), key=lambda t: (-p[t], t))
    if 0 < top_k < vocab:
        order = order[:top_k]
    mass = sum(p[t] for t in order)
    kept, acc = [], 0.0
    for t in order:
        kept.append(t)
        acc += p[t] / mass
        if top_p < 1.0 and acc >= top_p:
            break
    total = sum(p[t] for t in kept)
    out = [0.0] * vocab
    for t in kept:
        out[t] = p[t] / total
    return out


def test_target_probs_matches_reference() -> None:
    g = torch.Generator().manual_seed(7)
    bs, n, vocab = 24, 3, 12
    logits = torch.randn(bs, n, vocab, generator=g) * 2
    temperature = torch.rand(bs, generator=g) * 1.7 + 0.3
    top_k = torch.randint(-1, vocab + 3, (bs,), generator=g)
    top_p = torch.where(torch.rand(bs, generator=g) < 0.3, 1.0, torch.rand(bs, generator=g))
    top_k[:4] = 0  # top-k off, with top-p on
    top_p[4:8] = 1.0  # top-p off, top-k on
    top_k[8], top_p[8] = vocab, 1.0  # both off: plain softmax
    got = target_probs(logits, temperature, top_k, top_p)
    assert got.dtype == torch.float32 and got.shape == logits.shape
    for b in range(bs):
        for i in range(n):
            ref = reference_probs(
                logits[b, i].tolist(), float(temperature[b]), int(top_k[b]), float(top_p[b])
            )
            torch.testing.assert_close(got[b, i], torch.tensor(ref, dtype=torch.float32))
    torch.testing.assert_close(got[8], torch.softmax(logits[8] / temperature[8], -1))
    # [bs, V] logits (one row per request) take the same path.
    torch.testing.assert_close(target_probs(logits[:, 1], temperature, top_k, top_p), got[:, 1])


def test_unfiltered_path_is_the_plain_tempered_softmax() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 5, 40, generator=g) * 3
    temperature = torch.rand(6, generator=g) + 0.2
    off_k = torch.tensor([-1, 0, 40, 99, -1, 0])
    ones = torch.ones(6)
    fast = target_probs(logits, temperature, off_k, ones, filtered=False)
    torch.testing.assert_close(fast, target_probs(logits, temperature, off_k, ones))
    torch.testing.assert_close(fast, torch.softmax(logits / temperature[:, None, None], -1))


def test_greedy_rows_are_one_hot_argmax() -> None:
    logits = torch.randn(5, 4, 30)
    ones = torch.ones(5)
    got = target_probs(logits, ones, torch.ones(5, dtype=torch.int64), ones * 0.9)
    assert torch.equal(got, torch.nn.functional.one_hot(logits.argmax(-1), 30).float())


def test_ties_keep_lower_token_ids() -> None:
    logits = torch.tensor([[[1.0, 3.0, 3.0, 3.0, 0.0]]])
    got = target_probs(logits, torch.ones(1), torch.tensor([2]), torch.ones(1))
    assert torch.equal(got[0, 0], torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0]))
    # Top-p reaching its mass exactly at a prefix stops there.
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    got = target_probs(
        logits, torch.ones(1), torch.zeros(1, dtype=torch.int64), torch.tensor([0.5])
    )
    assert torch.equal(got[0], torch.tensor([1.0, 0.0, 0.0]))
    # top_p = 1 keeps the tail even when the fp32 prefix sum hits 1.0 before it.
    logits = torch.tensor([[30.0, 0.0, 0.0]])
    got = target_probs(logits, torch.ones(1), torch.zeros(1, dtype=torch.int64), torch.ones(1))
    assert float(got[0, 0]) == 1.0 and bool((got[0, 1:] > 0).all())


def race_reference(probs: list[float], coin: float) -> int:
    """One draw, from the definition, in numpy's uint32 arithmetic: the coin's bits, hashed, key
    one 32-bit value per token id; its top 24 bits give `u`, the noise is `-log u`, and the token
    with the largest `p / noise` wins (the first on a tie)."""
    def mix(x: np.ndarray) -> np.ndarray:
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(0x21F0AAAD)
        x = x ^ (x >> np.uint32(15))
        x = x * np.uint32(0x735A2D97)
        return x ^ (x >> np.uint32(15))

    with np.errstate(over="ignore"):
        key = mix(np.array([coin], dtype=np.float32).view(np.uint32))
        ids = np.arange(len(probs), dtype=np.uint32) * np.uint32(0x9E3779B9)
        h = mix(key + ids)
    u = ((h >> np.uint32(8)).astype(np.float64) + 0.5) / (1 << 24)
    return int(np.argmax(np.asarray(probs, dtype=np.float64) / -np.log(u)))


def test_race_matches_its_definition() -> None:
    g = torch.Generator().manual_seed(5)
    probs = torch.rand(300, 40, generator=g) ** 4
    probs[probs < 0.05] = 0.0
    probs[0] = 0.0
    coins = torch.rand(300, generator=g)
    coins[1] = 0.0
    got = sample_from_probs(probs, coins).tolist()
    assert got == [race_reference(p, c) for p, c in zip(probs.tolist(), coins.tolist())]
    assert got[0] == 0  # an all-zero row: token 0
    assert all(probs[i, t] > 0 for i, t in enumerate(got[1:], 1))  # zero mass never wins
    # Scale does not matter, the coin alone keys the noise, and a one-hot row is deterministic.
    assert torch.equal(sample_from_probs(probs * 7.5, coins), sample_from_probs(probs, coins))
    assert sample_from_probs(probs[:5], coins[:5]).tolist() == got[:5]  # whatever the batch
    one_hot = torch.zeros(300, 40)
    one_hot[:, 17] = 1.0
    assert sample_from_probs(one_hot, coins).eq(17).all()


def test_race_noise_is_unit_exponential_and_independent() -> None:
    g = torch.Generator().manual_seed(6)
    noise = race_noise(torch.rand(2000, generator=g), 50)  # [2000, 50]
    assert noise.shape == (2000, 50) and bool((noise > 0).all())
    assert stats.kstest(noise.flatten().numpy(), "expon").pvalue > 1e-4
    # Neighbouring tokens of one coin, and one token across neighbouring coins, are unrelated.
    u = torch.exp(-noise).double()
    for a, b in ((u[:, :-1], u[:, 1:]), (u[:-1], u[1:])):
        r = stats.pearsonr(a.flatten().numpy(), b.flatten().numpy())
        assert abs(r.statistic) < 0.02
    assert torch.equal(race_noise(torch.tensor([0.25, 0.25]), 50)[0],
                       race_noise(torch.tensor([0.25]), 50)[0])


def test_host_paths_are_the_torch_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(8)
    coins = [torch.rand((), generator=g), torch.rand(3, generator=g),
             torch.rand(4, 6, generator=g)[:, ::2], torch.tensor([0.0, 1 - 2**-24])]
    x = torch.randint(0, 4, (5, 3, 40), generator=g).float()  # many ties
    x[0, 0] = float("nan")
    host = [race_noise(c, 3072) for c in coins], argmax(x), argmax(x[:, 1])
    monkeypatch.setattr(ops.sampling, "on_host", lambda t: False)
    dev = [race_noise(c, 3072) for c in coins], argmax(x), argmax(x[:, 1])
    assert all(torch.equal(a, b) for a, b in zip(host[0], dev[0]))
    assert torch.equal(host[1], dev[1]) and torch.equal(host[2], dev[2])
    assert host[1].dtype == torch.int64 and host[0][0].shape == (3072,)


def test_race_logits_rank_the_race() -> None:
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(64, 3, 30, generator=g) * 2
    logits[logits < -3] = float("-inf")
    coins = torch.rand(64, 3, generator=g)
    raced = race_logits(logits, coins)
    assert torch.equal(raced.argmax(-1), sample_from_probs(torch.softmax(logits, -1), coins))
    assert bool(torch.isneginf(raced[logits.isneginf()]).all())
    assert bool(raced[logits.isfinite()].isfinite().all())


def test_sample_from_probs_batched_and_distributed() -> None:
    g = torch.Generator().manual_seed(3)
    p = torch.tensor([0.1, 0.0, 0.4, 0.2, 0.3])
    coins = torch.rand(40, 500, generator=g)
    draws = sample_from_probs(p.expand(40, 500, 5), coins)
    assert draws.shape == (40, 500) and draws.dtype == torch.int64
    counts = torch.bincount(draws.flatten(), minlength=5)
    assert int(counts[1]) == 0
    keep = p > 0
    chi = stats.chisquare(counts[keep].numpy(), (p[keep] * draws.numel()).numpy())
    assert chi.pvalue > 1e-4


def test_target_probs_runs_on_fake_tensors() -> None:
    out = run_on_fake(
        target_probs,
        torch.randn(2, 5, 16),
        torch.ones(2),
        torch.tensor([0, 3]),
        torch.tensor([0.9, 1.0]),
    )
    assert tuple(out.shape) == (2, 5, 16)
    drawn = run_on_fake(sample_from_probs, torch.rand(2, 5, 16), torch.rand(2, 5))
    assert tuple(drawn.shape) == (2, 5)


def assert_race_twin(drawn: Tensor, probs: Tensor, coins: Tensor) -> None:
    """`drawn` is the torch twin's race on the CPU, except where its best two scores are within
    a relative 1e-5 (a different `log` may round them apart the other way)."""
    twin = sample_from_probs(probs, coins)
    differ = drawn != twin
    if bool(differ.any()):
        scores = probs.float() / race_noise(coins, probs.shape[-1])
        top2 = scores[differ].topk(2, dim=-1).values
        assert bool((top2[:, 0] - top2[:, 1] <= 1e-5 * top2[:, 0]).all()), "not a near tie"
    assert int(differ.sum()) <= max(1, differ.numel() // 10_000)


def test_race_kernel_matches_the_torch_twin() -> None:
    pytest.importorskip("triton")
    from ops.sampling_triton import race_sample_triton

    g = torch.Generator().manual_seed(9)
    probs = torch.rand(10, 200, generator=g) ** 3
    probs[probs < 0.2] = 0.0
    probs[0] = 0.0  # all zero: token 0
    probs[1, :190] = 0.0  # all mass in the last block
    probs[2] = 1.0  # uniform: the noise alone decides
    coins = torch.rand(10, generator=g)
    coins[3] = 0.0
    drawn = race_sample_triton(probs, coins, block=64)  # four blocks, the last one partial
    assert drawn.dtype == torch.int64 and drawn.shape == (10,)
    assert drawn.tolist() == sample_from_probs(probs, coins).tolist()
    assert drawn[0] == 0 and drawn[1] >= 190
    assert race_sample_triton(probs.view(2, 5, 200), coins.view(2, 5), block=256).flatten(
        ).tolist() == drawn.tolist()


def test_race_logits_kernel_matches_the_torch_twin() -> None:
    pytest.importorskip("triton")
    from ops.sampling_triton import race_logits_triton

    g = torch.Generator().manual_seed(10)
    logits = torch.randn(3, 2, 150, generator=g) * 3
    logits[0, 0, :40] = float("-inf")
    coins = torch.rand(3, 2, generator=g)
    got = race_logits_triton(logits, coins, block=64)  # three blocks per row, the last partial
    want = race_logits(logits, coins)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert bool(got[0, 0, :40].isneginf().all())
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_race_kernel_on_cuda_at_kimi_vocabulary() -> None:
    pytest.importorskip("triton")
    g = torch.Generator(device="cuda").manual_seed(12)
    probs = torch.softmax(torch.randn(64, 163_840, device="cuda", generator=g) * 3, -1)
    probs[::2] = torch.where(probs[::2] < 1e-6, 0.0, probs[::2])
    coins = torch.rand(64, device="cuda", generator=g)
    assert_race_twin(sample_from_probs(probs, coins).cpu(), probs.cpu(), coins.cpu())
    logits = torch.log(probs[:4, None].expand(4, 3, -1))
    lc = torch.rand(4, 3, device="cuda", generator=g)
    torch.testing.assert_close(race_logits(logits, lc).cpu(), race_logits(logits.cpu(), lc.cpu()),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flashinfer_path_matches_torch_distribution() -> None:
    pytest.importorskip("flashinfer")
    g = torch.Generator(device="cuda").manual_seed(11)
    vocab, rows = 10, 4
    probs = torch.rand(rows, vocab, device="cuda", generator=g)
    probs[:, 3] = 0.0  # a zero-mass token must never be drawn by either path
    probs = probs / probs.sum(-1, keepdim=True)
    draws = 50_000
    expanded = probs[:, None, :].expand(rows, draws, vocab).contiguous()
    coins = torch.rand(rows, draws, device="cuda", generator=g)
    torch_draws = sample_from_probs(expanded, coins)
    fi_draws = sample_from_probs(expanded, coins, use_flashinfer=True)
    assert fi_draws.shape == torch_draws.shape and fi_draws.dtype == torch.int64
    # The race kernel on CUDA is the CPU's torch twin, coin for coin, but where two scores lie
    # within the rounding of log (the kernel's and torch's may differ there).
    assert_race_twin(torch_draws.cpu(), expanded.cpu(), coins.cpu())
    for r in range(rows):
        a = torch.bincount(torch_draws[r], minlength=vocab).cpu()
        b = torch.bincount(fi_draws[r], minlength=vocab).cpu()
        assert int(a[3]) == 0 and int(b[3]) == 0
        keep = (a + b) > 0
        table = torch.stack([a[keep], b[keep]]).numpy()
        # Two independent samples of one distribution: homogeneity test, and each against truth.
        assert stats.chi2_contingency(table).pvalue > 1e-4
        expected = (probs[r].cpu()[keep] * draws).numpy()
        assert stats.chisquare(b[keep].numpy(), expected).pvalue > 1e-4


# --- the bounded top-k path against the full vocabulary sort ------------------------------------


def row_counts(top_k: Tensor, top_p: Tensor, vocab: int, bound: int) -> dict[str, int]:
    """The static row counts an eager caller derives on the host (`row_promises`)."""
    promises = row_promises(zip(top_k.tolist(), top_p.tolist()), vocab, bound)
    return {k: promises[k] for k in ("topk_rows", "sort_rows")}


def assert_same_distribution(got: Tensor, ref: Tensor) -> None:
    """Same kept set exactly, same values up to fp32 rounding."""
    assert torch.equal(got > 0, ref > 0)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def random_case(
    g: torch.Generator, bs: int, n: int, vocab: int, kind: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Logits with plenty of exact ties (`kind` 0: small integers, 1: bf16-rounded, 2: fp32)
    and a mix of plain, greedy, top-k, top-p and both rows."""
    if kind == 0:
        logits = torch.randint(0, 4, (bs, n, vocab), generator=g).float()
    elif kind == 1:
        logits = (torch.randn(bs, n, vocab, generator=g) * 3).to(torch.bfloat16).float()
    else:
        logits = torch.randn(bs, n, vocab, generator=g) * 2
    temperature = torch.rand(bs, generator=g) + 0.3
    top_k = torch.randint(-1, vocab + 2, (bs,), generator=g)
    top_p = torch.where(torch.rand(bs, generator=g) < 0.3, 1.0, torch.rand(bs, generator=g))
    return logits, temperature, top_k, top_p


def test_bounded_path_equals_full_sort_on_random_mixes() -> None:
    g = torch.Generator().manual_seed(11)
    for trial in range(90):
        bs, n = 7, 3
        vocab = int(torch.randint(2, 70, (1,), generator=g))
        bound = int(torch.randint(1, vocab + 3, (1,), generator=g))
        logits, temp, top_k, top_p = random_case(g, bs, n, vocab, trial % 3)
        ref = target_probs(logits, temp, top_k, top_p, bound=None)
        every = target_probs(logits, temp, top_k, top_p, bound=bound)
        assert every.dtype == torch.float32 and every.shape == logits.shape
        assert_same_distribution(every, ref)
        # The host's counts gather the rows; each node's result stays the same, bit for bit.
        counts = row_counts(top_k, top_p, vocab, bound)
        assert torch.equal(target_probs(logits, temp, top_k, top_p, bound=bound, **counts), every)
        for c in ({}, counts):  # an eager caller's sort only where the bounded cut falls short
            assert torch.equal(target_probs(logits, temp, top_k, top_p, bound=bound, **c,
                                            sort_if_needed=True), every)


def test_bounded_path_matches_the_definition_when_it_falls_back() -> None:
    # bound 3 of V = 12: top-k 5 and wide nuclei overflow it; the float64 reference decides.
    g = torch.Generator().manual_seed(5)
    bs, n, vocab = 8, 4, 12
    logits = torch.randn(bs, n, vocab, generator=g)
    temperature = torch.tensor([1.0, 0.5, 2.0, 1.0, 1.5, 1.0, 0.8, 3.0])
    top_k = torch.tensor([5, 0, 0, 3, 2, 1, 11, 0])
    top_p = torch.tensor([1.0, 0.97, 0.5, 0.9, 1.0, 0.3, 0.99, 1.0])
    for counts in ({}, row_counts(top_k, top_p, vocab, 3)):
        got = target_probs(logits, temperature, top_k, top_p, bound=3, **counts)
        for b in range(bs):
            for i in range(n):
                ref = reference_probs(
                    logits[b, i].tolist(), float(temperature[b]), int(top_k[b]), float(top_p[b])
                )
                assert_same_distribution(got[b, i], torch.tensor(ref, dtype=torch.float32))


def test_bounded_ties_keep_lower_token_ids_at_the_bound() -> None:
    # Six tokens tie for first place; bound 3 cuts the tie: topk must still take the lowest ids,
    # in id order, for the top-k cut and for a nucleus ending inside the tie.
    logits = torch.tensor([[1.0, 4.0, 0.0, 4.0, 4.0, 4.0, 4.0, 2.0, 4.0, 0.0]]).expand(3, 10)
    ones = torch.ones(3)
    top_k = torch.tensor([2, 3, 0])
    top_p = torch.tensor([1.0, 1.0, 0.4])
    got = target_probs(logits, ones, top_k, top_p, bound=3, topk_rows=3, sort_rows=0)
    third = 1.0 / 3.0
    assert got[0].tolist() == [0.0, 0.5, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(got[1], torch.tensor([0, third, 0, third, third, 0, 0, 0, 0, 0]))
    assert torch.equal(got > 0, target_probs(logits, ones, top_k, top_p, bound=None) > 0)
    assert_same_distribution(got, target_probs(logits, ones, top_k, top_p, bound=None))


def test_wide_nucleus_takes_the_fallback_sort() -> None:
    # Row 1 is flat: its 0.9 nucleus holds ~90 of 100 tokens, far past the bound of 8. Row 0 is
    # peaked and fits. Both may need the sort (top-p with top-k off), which only the device sees.
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 100, generator=g) * torch.tensor([20.0, 0.1])[:, None, None]
    ones = torch.ones(2)
    off = torch.zeros(2, dtype=torch.int64)
    top_p = torch.tensor([0.9, 0.9])
    ref = target_probs(logits, ones, off, top_p, bound=None)
    assert int((ref[0] > 0).sum(-1).max()) <= 8 < int((ref[1] > 0).sum(-1).min())
    counts = row_counts(off, top_p, 100, 8)
    assert counts == {"topk_rows": 2, "sort_rows": 2}
    assert_same_distribution(target_probs(logits, ones, off, top_p, bound=8), ref)
    assert_same_distribution(target_probs(logits, ones, off, top_p, bound=8, **counts), ref)
    # Without the fallback (a broken sort_rows=0 promise) the wide row is cut at the bound, and
    # the row that fits is unchanged, bit for bit.
    broken = target_probs(logits, ones, off, top_p, bound=8, sort_rows=0)
    assert int((broken[1] > 0).sum(-1).max()) == 8
    assert torch.equal(broken[0], target_probs(logits, ones, off, top_p, bound=8)[0])
    # top-k past the bound falls back too; inside it never needs the sort.
    k = torch.tensor([20, 8])
    one = torch.ones(2)
    assert row_counts(k, one, 100, 8) == {"topk_rows": 2, "sort_rows": 1}
    assert_same_distribution(
        target_probs(logits, ones, k, one, bound=8, topk_rows=2, sort_rows=1),
        target_probs(logits, ones, k, one, bound=None),
    )


def test_sort_if_needed_sorts_only_when_a_nucleus_overflows(monkeypatch) -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 100, generator=g) * torch.tensor([20.0, 0.1])[:, None, None]
    ones, off, top_p = torch.ones(2), torch.zeros(2, dtype=torch.int64), torch.tensor([0.9, 0.9])
    sorts = []
    real_sort = torch.sort
    monkeypatch.setattr(torch, "sort", lambda *a, **kw: sorts.append(1) or real_sort(*a, **kw))
    for rows, sorted_ in ((slice(0, 1), 0), (slice(0, 2), 1)):  # peaked alone; then a flat row
        x, k, p = logits[rows], off[rows], top_p[rows]
        counts = row_counts(k, p, 100, 8)
        sorts.clear()
        got = target_probs(x, ones[rows], k, p, bound=8, **counts, sort_if_needed=True)
        assert len(sorts) == sorted_
        assert torch.equal(got, target_probs(x, ones[rows], k, p, bound=8, **counts))
        assert_same_distribution(got, target_probs(x, ones[rows], k, p, bound=None))


def test_row_counts_pick_the_rows_that_need_each_path() -> None:
    # Truncating rows last, behind plain and greedy rows: the gathers must still find them.
    g = torch.Generator().manual_seed(9)
    bs, n, vocab, bound = 6, 5, 40, 4
    logits = torch.randn(bs, n, vocab, generator=g)
    temperature = torch.rand(bs, generator=g) + 0.5
    top_k = torch.tensor([0, 1, 40, 1, 3, 0])
    top_p = torch.tensor([1.0, 0.5, 1.0, 1.0, 0.7, 0.95])
    paths = [row_path(int(k), float(p), vocab, bound) for k, p in zip(top_k, top_p)]
    assert paths == ["plain", "argmax", "plain", "argmax", "bounded", "sort"]
    assert row_path(300, 0.5, 163_840) == "sort" and row_path(64, 0.5, 163_840) == "bounded"
    assert row_path(0, 0.5, 200) == "bounded"  # the bound covers the whole vocabulary
    ref = target_probs(logits, temperature, top_k, top_p, bound=None)
    counts = row_counts(top_k, top_p, vocab, bound)
    got = target_probs(logits, temperature, top_k, top_p, bound=bound, **counts)
    assert_same_distribution(got, ref)
    plain = torch.softmax(logits / temperature[:, None, None], -1)
    assert torch.equal(got[[0, 2]], plain[[0, 2]])  # plain rows are the softmax itself
    one_hot = torch.nn.functional.one_hot(logits[[1, 3]].argmax(-1), vocab).float()
    assert torch.equal(got[[1, 3]], one_hot)


def test_a_rows_result_does_not_depend_on_the_batch() -> None:
    g = torch.Generator().manual_seed(4)
    bs, n, vocab, bound = 6, 4, 50, 5
    logits, temp, top_k, top_p = random_case(g, bs, n, vocab, 1)
    top_p[:3] = torch.tensor([0.99, 0.9, 0.6])
    top_k[:3] = 0
    batch = target_probs(
        logits, temp, top_k, top_p, bound=bound, **row_counts(top_k, top_p, vocab, bound)
    )
    every = target_probs(logits, temp, top_k, top_p, bound=bound)
    for b in range(bs):
        sl = slice(b, b + 1)
        alone = target_probs(logits[sl], temp[sl], top_k[sl], top_p[sl], bound=bound)
        assert torch.equal(alone[0], batch[b]) and torch.equal(alone[0], every[b])


def test_bounded_path_runs_on_fake_tensors() -> None:
    g = torch.Generator().manual_seed(0)
    args = (
        torch.randn(4, 5, 64, generator=g),
        torch.ones(4),
        torch.tensor([0, 1, 20, 3]),
        torch.tensor([0.9, 1.0, 1.0, 0.5]),
    )
    for kwargs in (
        {"bound": 8},  # every row may take either path: a graph serving any mix
        {"bound": 8, "topk_rows": 3, "sort_rows": 2},  # gathered rows
        {"bound": 8, "topk_rows": 1, "sort_rows": 0},
        {"bound": 200},  # the bound covers the vocabulary: no sort at all
        {"bound": None},
    ):
        out = run_on_fake(target_probs, *args, **kwargs)
        assert tuple(out.shape) == (4, 5, 64) and out.dtype == torch.float32
    logits = torch.randn(3, 300, generator=g)
    out = run_on_fake(target_probs, logits, torch.ones(3), args[2][:3], args[3][:3])
    assert tuple(out.shape) == (3, 300)


# --- the captured sampling variants -------------------------------------------------------------


class _VocabSorts(TorchDispatchMode):
    """Records `(phase, op)` for every sort, argsort and topk over a `vocab`-wide last dim;
    `phase` is the step phase the timer last entered (`spec_step`'s `timer`)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.phase, self.calls = vocab, "", []

    @contextlib.contextmanager
    def timer(self, name: str) -> Iterator[None]:
        self.phase = name
        yield

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("sort", "argsort", "topk") and args[0].shape[-1] == self.vocab:
            self.calls.append((self.phase, name))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from tests.graph_helpers import load_models, write_pair

    return load_models(*write_pair(tmp_path_factory.mktemp("sampling")))


def test_variant_promises_are_exact_for_the_rows_that_pick_them() -> None:
    """A batch's sampling variant (`engine.runner.sampling_variant`), captured as every row or
    none (`variant_promises`), gives each row the reference distribution."""
    from engine.runner import sampling_variant, variant_promises

    g = torch.Generator().manual_seed(21)
    bound, vocab, bs = 8, 60, 5
    picked = set()
    for trial in range(60):
        logits, temp, top_k, top_p = random_case(g, bs, 3, vocab, trial % 3)
        if trial % 4 == 0:  # untruncated and greedy rows only
            top_k = torch.where(torch.rand(bs, generator=g) < 0.5, 1, 0)
            top_p = torch.ones(bs)
        elif trial % 4 == 1:  # top-k inside the bound, with or without top-p
            top_k = torch.randint(1, bound + 1, (bs,), generator=g)
        variant = sampling_variant(list(zip(top_k.tolist(), top_p.tolist())), vocab, bound)
        picked.add(variant)
        got = target_probs(logits, temp, top_k, top_p, bound=bound,
                           **variant_promises(variant, bs))
        assert_same_distribution(got, target_probs(logits, temp, top_k, top_p, bound=None))
    assert picked == {"plain", "bounded", "sort"}
    assert sampling_variant([(0, 1.0), (1, 1.0)], 163_840) == "plain"
    assert sampling_variant([(0, 1.0), (40, 0.9)], 163_840) == "bounded"
    assert sampling_variant([(0, 0.95), (40, 0.9)], 163_840) == "sort"
    assert sampling_variant([(300, 1.0)], 163_840) == "sort"


@pytest.mark.parametrize("mode", ["tree", "ar"])
def test_captured_step_sorts_only_what_truncates(tiny_models, mode) -> None:
    """The step a graph captures (every row alike, no host reads) in each sampling variant:
    greedy and untruncated sampled steps run no vocabulary-wide sort or topk (the drafter's
    candidates in `build` aside); a top-k batch runs the bounded topk, a top-p batch the sort."""
    from engine.runner import sampling_variant, variant_promises
    from engine.spec import StepBuffers, StepShape, spec_step
    from tests.graph_helpers import BLOCK, make_pool

    models = tiny_models
    vocab = models.target.cfg.vocab_size
    greedy, free = (1, 1.0), (0, 1.0)
    cases = [(False, [greedy, greedy, greedy], "plain", set()),
             (True, [free, free, free], "plain", set()),
             (True, [free, greedy, free], "plain", set()),
             (True, [(20, 1.0), greedy, free], "bounded", {"topk"}),
             (True, [(0, 0.9), (20, 0.8), free], "sort", {"sort"})]
    for sample, cuts, want, sorts in cases:
        shape = StepShape(mode, 6, BLOCK, sample)
        pool = make_pool(models, num_pages=16)
        buf = StepBuffers.allocate(3, 4, shape, models.target, "cpu")
        buf.cache_len.fill_(5)
        buf.page_table[:, :2] = torch.arange(1, 7).view(3, 2)
        buf.top_k.copy_(torch.tensor([k for k, _ in cuts]))
        buf.top_p.copy_(torch.tensor([p for _, p in cuts]))
        buf.temperature.fill_(0.8)
        buf.coins.uniform_(generator=torch.Generator().manual_seed(3))
        if sample:
            assert sampling_variant(cuts, vocab) == want
            shape = replace(shape, **variant_promises(want, 3))
        spy = _VocabSorts(vocab)
        with torch.no_grad(), spy:
            spec_step(models, pool, buf, shape, timer=spy.timer)
        outside = [(phase, op) for phase, op in spy.calls if phase != "build"]
        assert {op for _, op in outside} == sorts, (sample, cuts, outside)
        assert all(phase == "decide" for phase, _ in outside)
