"""Target distributions (temperature, top-k, top-p) and inverse-CDF sampling."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from ops.sampling import sample_from_probs, target_probs
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


@pytest.mark.parametrize(
    ("probs", "coin", "token"),
    [
        ([0.0, 0.5, 0.0, 0.5], 0.0, 1),  # u = 0 picks the first positive token, zeros skipped
        ([0.0, 0.5, 0.0, 0.5], 0.49, 1),
        ([0.0, 0.5, 0.0, 0.5], 0.5, 3),  # cumsum must strictly exceed u * sum
        ([0.0, 0.5, 0.0, 0.5], 0.999, 3),
        ([0.0, 2.0, 0.0, 6.0], 0.25, 3),  # unnormalised
        ([0.0, 2.0, 0.0, 6.0], 0.2499, 1),
        ([0.2, 0.8, 0.0, 0.0], 0.9999999, 1),  # never a trailing zero
        ([0.5, 0.5, 0.0], 1.0, 1),  # u * sum at the total: last positive token
        ([0.0, 0.0, 0.0], 0.3, 0),  # all zero: token 0
    ],
)
def test_sample_from_probs_hand_cases(probs: list[float], coin: float, token: int) -> None:
    got = sample_from_probs(torch.tensor([probs]), torch.tensor([coin]))
    assert got.tolist() == [token]


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
    # The torch path on CUDA is the CPU path, coin for coin.
    assert torch.equal(torch_draws.cpu(), sample_from_probs(expanded.cpu(), coins.cpu()))
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
