"""Target distributions (temperature, top-k, top-p) and inverse-CDF sampling from given coins.

Fixed-shape tensor programs: per-row parameters are tensors, so one captured graph serves any mix of
greedy and sampling requests (greedy rows arrive as temperature 1, top-k 1).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _per_row(x: Tensor, like: Tensor) -> Tensor:
    """Broadcast a `[bs]` parameter against `like` `[bs, ..., V]` as `[bs, 1, ..., 1]`."""
    return x.view(x.shape[0], *([1] * (like.dim() - 1)))


def target_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor,
                 filtered: bool = True) -> Tensor:
    """Sampling distribution `[bs, ..., V]` (fp32) of `logits` `[bs, ..., V]`.

    softmax(logits / temperature), then keep the `top_k` most likely tokens and renormalise
    (`top_k <= 0` or `>= V` means no top-k), then keep the smallest prefix of the sorted
    probabilities whose mass reaches `top_p` and renormalise (`top_p >= 1` means no top-p; the most
    likely token is always kept). temperature, top_k, top_p: `[bs]`, applied to every middle row.
    Ties in probability are ordered by token id (stable sort), so the kept set is deterministic.
    `filtered=False` promises that no row uses top-k or top-p and skips the sort over the
    vocabulary (most of the cost): the result is then the tempered softmax itself.
    """
    vocab = logits.shape[-1]
    temp = _per_row(temperature.to(torch.float32), logits)
    probs = torch.softmax(logits.float() / temp, dim=-1)
    if not filtered:
        return probs
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=logits.device)
    k = _per_row(top_k.to(torch.int64), logits)
    k = torch.where((k <= 0) | (k >= vocab), vocab, k)
    kept = sorted_p * (rank < k)
    kept = kept / kept.sum(-1, keepdim=True)
    p = _per_row(top_p.to(torch.float32), logits)
    # Exclusive prefix mass below top_p keeps exactly the shortest prefix reaching top_p. top_p >= 1
    # is treated as off explicitly: fp32 prefix sums can reach 1.0 before the tail and drop it.
    below = (kept.cumsum(-1) - kept) < p
    keep = below | (p >= 1.0) | (rank == 0)
    kept = kept * keep
    kept = kept / kept.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter(-1, order, kept)


def sample_from_probs(probs: Tensor, coins: Tensor, *, use_flashinfer: bool = False) -> Tensor:
    """Inverse-CDF draws `[...]` (int64) from `probs` `[..., V]` (need not be normalised).

    Returns the smallest `t` with `p[t] > 0` and `cumsum(p)[t] > u * sum(p)` for `u = coins`
    `[...]` in [0, 1). If rounding pushes `u * sum(p)` to the total, the last positive token is
    returned; an all-zero row gives token 0.

    `use_flashinfer=True` switches CUDA tensors to flashinfer's fused sampler when it imports. That
    kernel draws its own uniforms from its philox state, so the result is a sample of the same
    distribution but does not follow `coins`; it stays opt-in for that reason.
    """
    if use_flashinfer and probs.is_cuda:
        drawn = _flashinfer_sample(probs)
        if drawn is not None:
            return drawn
    p = probs.float()
    cdf = p.cumsum(-1)
    thr = coins.to(cdf.dtype).unsqueeze(-1) * cdf[..., -1:]
    # First index whose cdf exceeds thr: a zero-mass token never raises the cdf, so it is skipped.
    t = torch.searchsorted(cdf.contiguous(), thr.contiguous(), right=True).squeeze(-1)
    ids = torch.arange(p.shape[-1], device=p.device)
    last_pos = torch.where(p > 0, ids, 0).amax(-1)
    return torch.minimum(t, last_pos)


def _flashinfer_sample(probs: Tensor) -> Tensor | None:
    """flashinfer's sampler over the last dim, or None when flashinfer is unavailable."""
    try:
        # NOTE: imported lazily so that CPU runs never load (or need) flashinfer.
        from flashinfer.sampling import sampling_from_probs
    except ImportError:
        return None
    vocab = probs.shape[-1]
    flat = probs.float().reshape(-1, vocab)
    flat = (flat / flat.sum(-1, keepdim=True)).contiguous()
    drawn = sampling_from_probs(flat, deterministic=True)
    return drawn.to(torch.int64).reshape(probs.shape[:-1])
