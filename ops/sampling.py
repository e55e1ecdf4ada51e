"""Target distributions (temperature, top-k, top-p) and sampling by a race keyed by given coins.

Fixed-shape tensor programs: per-row parameters are tensors, so one captured graph serves any mix of
greedy and sampling requests (greedy rows arrive as temperature 1, top-k 1).

Top-k / top-p without sorting the vocabulary. Each row (request) takes one of four paths:

- plain (`top_k` off and `top_p >= 1`): the tempered softmax itself;
- argmax (`top_k == 1`: greedy and padding rows): one-hot at the argmax, lowest id on ties;
- bounded: the `K = min(bound, V)` most likely tokens by one `torch.topk` over a unique integer
  key (probability bits, then token id), so that they come out exactly in the order of the stable
  descending sort; top-k and the nucleus are cut inside those `K`;
- full sort, per node, where the bounded result is not exact: a top-k wider than `K`, or top-k
  off and a nucleus that does not end inside the `K` (only the probabilities tell).

What each row may cost is static, so that no host sync and no data-dependent shape is needed:
`topk_rows` bounds how many rows are neither plain nor top-k 1, and `sort_rows` how many of those
may need the full sort (`row_path` tells on the host). The rows are picked on the device from their
parameters (a fixed-size stable `argsort`: rows that may need the sort, then the other truncating
rows) and gathered: a batch with one top-p request sorts that request's `[N, V]` only, the other
truncating rows run one topk each, plain and greedy rows neither. A sorted row takes its `K`
candidates from the sort, so no row pays for both. `None` means every row: exact for any mix,
which a captured graph serving any batch needs, and then every row is sorted whenever `bound < V`
(the old cost). An eager caller knows the rows' parameters on the host and passes the counts; a
runner with graphs can capture one variant per count it wants to serve (e.g. `sort_rows=0` for
batches without top-p or wide top-k) and pick one on the host. Either way a node's result is the
bounded one where that is exact and the full sort's elsewhere, so on the CPU it is the same, bit
for bit, whatever the other rows or the counts. An eager caller, for whom reading a flag on the host
costs nothing, may also pass `sort_if_needed`: the rows that may need the sort run the bounded cut
first and are sorted only when some node's cut is not exact (a peaked model's nucleus at
`top_p <= 0.95` nearly always fits), with the same result, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import Tensor

# Candidates per node for top-k / top-p without a full sort. 256 covers the top-k values clients
# send (20-100 typically) and the nucleus of top_p <= 0.95 at most positions of a trained model.
# topk's cost grows slowly with K, while a node past the bound costs a whole row's sort (many
# times a topk of 256), and a top-k past it is always sorted.
TOPK_BOUND = 256


def _per_row(x: Tensor, like: Tensor) -> Tensor:
    """Broadcast a `[bs]` parameter against `like` `[bs, ..., V]` as `[bs, 1, ..., 1]`."""
    return x.view(x.shape[0], *([1] * (like.dim() - 1)))


def _effective_k(top_k: Tensor, vocab: int) -> Tensor:
    """`[bs]` int64 top-k with "off" (`<= 0` or `>= V`) as `V`."""
    k = top_k.to(torch.int64)
    return torch.where((k <= 0) | (k >= vocab), vocab, k)


def row_path(top_k: int, top_p: float, vocab: int, bound: int = TOPK_BOUND) -> str:
    """The path `target_probs` may take for a row with these parameters, decided on the host.

    `"plain"` (no truncation), `"argmax"` (top-k 1), `"bounded"` (top-k within the bound), or
    `"sort"` (top-k wider than the bound, or top-p with top-k off or wider than the bound: the
    nucleus may not fit, which only the probabilities tell). `topk_rows` counts the `"bounded"` and
    `"sort"` rows, `sort_rows` the `"sort"` rows.
    """
    k = vocab if top_k <= 0 or top_k >= vocab else top_k
    if k == 1:
        return "argmax"
    if k == vocab and top_p >= 1.0:
        return "plain"
    return "bounded" if k <= min(bound, vocab) else "sort"


def row_promises(rows: Iterable[tuple[int, float]], vocab: int, bound: int = TOPK_BOUND
                 ) -> dict[str, Any]:
    """What a caller that knows its rows' `(top_k, top_p)` on the host can promise
    `target_probs` (`row_path` per row): whether any row truncates (`filtered`; top-k 1
    included), how many need a top-k (`topk_rows`), how many may need the full sort
    (`sort_rows`)."""
    paths = [row_path(k, p, vocab, bound) for k, p in rows]
    return {"filtered": any(x != "plain" for x in paths),
            "topk_rows": sum(x in ("bounded", "sort") for x in paths),
            "sort_rows": sum(x == "sort" for x in paths)}


def on_host(x: Tensor) -> bool:
    """Whether `x` is a real CPU tensor outside a compile, which numpy can read in place. An
    eager CPU step then runs two ops through numpy that torch's CPU kernels run slowly at a
    step's sizes: the last-dimension argmax (torch's is not vectorized across a row) and the
    race's integer hash (`race_noise`: numpy's uint32 arithmetic wraps by definition, where torch
    needs int64 and masks).
    Both give the same values, bit for bit."""
    return (x.device.type == "cpu" and type(x) is Tensor and x.dtype == torch.float32
            and not torch.compiler.is_compiling())


def argmax(x: Tensor) -> Tensor:
    """`x.argmax(-1)` (int64; the first index on ties), through numpy on the host (`on_host`)."""
    if on_host(x):
        return torch.from_numpy(x.detach().numpy().argmax(-1).astype(np.int64, copy=False))
    return x.argmax(-1)


def _take(x: Tensor, rows: Tensor | None) -> Tensor:
    return x if rows is None else x.index_select(0, rows)


def _argmax_rows(probs: Tensor, greedy: Tensor) -> Tensor:
    """`probs` `[bs, ..., V]` with the `greedy` `[bs]` rows one-hot at the argmax (lowest id on
    ties, as the stable sort puts it first); a new tensor."""
    greedy = _per_row(greedy, probs)
    top1 = argmax(probs)[..., None]
    out = torch.where(greedy, 0.0, probs)
    return out.scatter_(-1, top1, torch.where(greedy, 1.0, probs.gather(-1, top1)))


def _sorted_cut(sorted_p: Tensor, k: Tensor, p: Tensor) -> Tensor:
    """Top-k then top-p renormalisation of the whole stably sorted vocabulary `[R, ..., V]`, in
    sorted order. k: `[R]` int64 in `1..V` (`V`: off); p: `[R]` fp32 (`>= 1`: off)."""
    rank = torch.arange(sorted_p.shape[-1], device=sorted_p.device)
    kept = sorted_p * (rank < _per_row(k, sorted_p))
    kept = kept / kept.sum(-1, keepdim=True)
    p = _per_row(p, sorted_p)
    # Exclusive prefix mass below top_p keeps exactly the shortest prefix reaching top_p. top_p >= 1
    # is treated as off explicitly: fp32 prefix sums can reach 1.0 before the tail and drop it.
    below = (kept.cumsum(-1) - kept) < p
    keep = below | (p >= 1.0) | (rank == 0)
    kept = kept * keep
    return kept / kept.sum(-1, keepdim=True)


def _sorted_probs(probs: Tensor, k: Tensor, p: Tensor) -> Tensor:
    """Top-k then top-p of `probs` `[R, ..., V]` over the whole sorted vocabulary: the reference
    (k, p as in `_sorted_cut`)."""
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    return torch.zeros_like(probs).scatter_(-1, order, _sorted_cut(sorted_p, k, p))


def _bounded_cut(top: Tensor, k: Tensor, p: Tensor, total: Tensor,
                 vocab: int) -> tuple[Tensor, Tensor]:
    """Top-k then top-p inside the `K` most likely tokens `top` `[R, ..., K]` (in the stable
    sort's order) of a `vocab`-token distribution of mass `total` `[R, ..., 1]`.

    k, p as in `_sorted_cut`. Returns the kept, renormalised probabilities `[R, ..., K]` (every
    other token is 0) and whether that is exact `[R, ...]`: the top-k is within the `K`, or top-k
    is off and the nucleus ends inside them (their prefix mass reaches `top_p`).
    """
    K = top.shape[-1]
    rank = torch.arange(K, device=top.device)
    k, p = _per_row(k, top), _per_row(p, top)
    inside = k <= K
    kept = top * (rank < k)
    # Top-k off: renormalise by the whole vocabulary's mass, as the full sort does.
    kept = kept / torch.where(inside, kept.sum(-1, keepdim=True), total)
    mass = kept.cumsum(-1)
    keep = ((mass - kept) < p) | (p >= 1.0) | (rank == 0)
    out = kept * keep
    out = out / out.sum(-1, keepdim=True)
    fits = inside | ((k == vocab) & (p < 1.0) & (mass[..., -1:] >= p))
    return out, fits.squeeze(-1)


def _rows_probs(probs: Tensor, base: Tensor, k: Tensor, p: Tensor, own: Tensor,
                rows: Tensor | None, bound: int, sort: bool, sort_if_needed: bool = False
                ) -> Tensor:
    """The distributions `[R, ..., V]` of `rows` (`[R]` ids; None: all) of `probs` `[bs, ..., V]`.

    Rows without `own` `[bs]` copy `base` `[bs, ..., V]`. The others take the bounded cut over
    their `K = min(bound, V)` most likely tokens, found by `torch.topk`, or with `sort` by a full
    stable sort, whose result then also serves the nodes the bounded cut cannot. Both find the
    same `K` tokens in the same order, so a node that fits gets the same result from either;
    `sort_if_needed` (eager only: it reads the device) sorts only when some node does not fit.
    """
    vocab = probs.shape[-1]
    K = min(bound, vocab)
    sub, src = _take(probs, rows), _take(base, rows)
    k, p = _take(k, rows), _take(p, rows)
    total = sub.sum(-1, keepdim=True)
    rest = _per_row(~_take(own, rows), sub)
    if not sort or sort_if_needed:
        # NOTE: a non-negative fp32 orders like its bit pattern, so (bits, V - 1 - id) is a
        # unique key whose descending order is the stable descending sort: topk then keeps the
        # lowest ids of a tie at the cut and returns ties in id order, as the sort does.
        shift = max(1, (vocab - 1).bit_length())
        key = sub.view(torch.int32).to(torch.int64).bitwise_left_shift_(shift)
        key = key.bitwise_or_(torch.arange(vocab - 1, -1, -1, device=sub.device))
        ids = key.topk(K, dim=-1).indices
        vals, fits = _bounded_cut(sub.gather(-1, ids), k, p, total, vocab)
        if not sort or bool((fits | rest[..., 0]).all()):
            vals = torch.where(rest, src.gather(-1, ids), vals)
            return torch.where(rest, src, 0.0).scatter_(-1, ids, vals)
    sorted_p, ids = torch.sort(sub, dim=-1, descending=True, stable=True)
    vals, fits = _bounded_cut(sorted_p[..., :K].contiguous(), k, p, total, vocab)
    fits = fits.unsqueeze(-1)
    full = torch.where(fits, 0.0, _sorted_cut(sorted_p, k, p))
    full[..., :K] = torch.where(fits, vals, full[..., :K])
    # ids is a permutation here: every token is written.
    dense = torch.empty_like(sub).scatter_(-1, ids, full)
    return torch.where(rest, src, dense)


def target_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor,
                 filtered: bool = True, *, bound: int | None = TOPK_BOUND,
                 topk_rows: int | None = None, sort_rows: int | None = None,
                 sort_if_needed: bool = False) -> Tensor:
    """Sampling distribution `[bs, ..., V]` (fp32) of `logits` `[bs, ..., V]`.

    softmax(logits / temperature), then keep the `top_k` most likely tokens and renormalise
    (`top_k <= 0` or `>= V` means no top-k), then keep the smallest prefix of the sorted
    probabilities whose mass reaches `top_p` and renormalise (`top_p >= 1` means no top-p; the most
    likely token is always kept). temperature, top_k, top_p: `[bs]`, applied to every middle row.
    Ties in probability are ordered by token id (stable sort), so the kept set is deterministic.

    `filtered=False` promises that no row uses top-k or top-p (greedy rows included) and skips all
    of it: the result is then the tempered softmax itself. The rest are static promises too (see the
    module docstring): `bound` is the candidate count of the bounded path (`None`: sort the whole
    vocabulary for every row, the reference path); at most `topk_rows` rows are neither plain nor
    top-k 1, and at most `sort_rows` rows may need the full sort (`row_path` decides both on the
    host; `None`: every row). A promise broken gives those rows a wrong distribution.
    `sort_if_needed` (eager only: it reads the device on the host) sorts those rows only when the
    bounded cut is not exact at some node.
    """
    vocab = logits.shape[-1]
    temp = _per_row(temperature.to(torch.float32), logits)
    probs = torch.softmax(logits.float() / temp, dim=-1)
    if not filtered:
        return probs
    bs = probs.shape[0]
    k = _effective_k(top_k, vocab)
    p = top_p.to(torch.float32)
    if bound is None:
        return _sorted_probs(probs, k, p)
    if bound < 1:
        raise ValueError(f"bound must be >= 1 (or None), got {bound}")
    K = min(bound, vocab)
    greedy = k == 1
    truncated = (k > 1) & ((k < vocab) | (p < 1.0))
    may_sort = truncated & (k > K)  # top-k past the bound, or top-k off with top-p
    n_topk = bs if topk_rows is None else max(0, min(topk_rows, bs))
    n_sort = 0 if K == vocab else n_topk if sort_rows is None else max(0, min(sort_rows, n_topk))
    if n_topk == 0:
        return _argmax_rows(probs, greedy)
    if n_topk == bs and n_sort in (0, bs):
        # One group of every row; the bounded cut gives top-k 1 rows the same one-hot.
        return _rows_probs(probs, probs, k, p, truncated | greedy, None, bound, n_sort > 0,
                           sort_if_needed)
    # Gathered groups: the rows that may need the sort first, then the other truncating rows.
    order = torch.argsort(torch.where(may_sort, 0, torch.where(truncated, 1, 2)), stable=True)
    if n_topk == bs:
        base, own, out = probs, truncated | greedy, torch.empty_like(probs)
    else:
        base, own = _argmax_rows(probs, greedy), truncated
        out = base
    for rows, sort in ((order[:n_sort], True), (order[n_sort:n_topk], False)):
        if rows.shape[0] > 0:
            out = out.index_copy_(0, rows, _rows_probs(probs, base, k, p, own, rows, bound, sort,
                                                       sort_if_needed))
    return out


# The race's noise: every (coin, token) pair hashes to its own uniform. A coin is a position's
# randomness (the engine gives each output position one); its 32 bits key a stream of 32-bit
# values, one per token id, mixed by an integer finalizer (two multiply-xorshift rounds with
# multipliers below 2**31, so every product fits an int64 on any device). Written by hand: torch's
# generators give one stream per call, not a value per (coin, token) that any step, batch or
# device reproduces from the coin alone.
_M32 = 0xFFFFFFFF
_BELOW_ONE = 1.0 - 2.0**-24  # the largest float32 below 1


def _mix32(x: Any) -> Any:
    """A 32-bit hash finalizer over values in [0, 2**32): int64 tensors, or numpy uint32 arrays
    (whose products wrap modulo 2**32, so there the masks change nothing)."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def race_noise(coins: Tensor, vocab: int) -> Tensor:
    """Exponential variates `[..., V]` (fp32, rate 1), one per token id for each coin `[...]` in
    [0, 1): the same coin gives the same noise to a token on every device and in every batch.
    The integer hash runs in numpy on the host (`on_host`), bit for bit the same."""
    coins = coins.to(torch.float32).contiguous()
    if on_host(coins):
        with np.errstate(over="ignore"):
            key = _mix32(coins.numpy().view(np.uint32).reshape(-1, 1))
            h = _mix32(key + np.arange(vocab, dtype=np.uint32) * np.uint32(0x9E3779B9))
        u = torch.from_numpy((h >> 8).astype(np.float32)).view(*coins.shape, vocab)
    else:
        key = _mix32(coins.view(torch.int32).to(torch.int64) & _M32)
        ids = torch.arange(vocab, device=coins.device, dtype=torch.int64)
        u = (_mix32((key.unsqueeze(-1) + ids * 0x9E3779B9) & _M32) >> 8).to(torch.float32)
    # NOTE: 24 bits, in (0, 1): the largest, (2**24 - 0.5) / 2**24, rounds to 1.0 in float32,
    # and E = 0 would let a zero-probability token win (0 / 0 is NaN, which argmax takes), so
    # it is held at the float just below 1.
    return -torch.log(((u + 0.5) * (1.0 / (1 << 24))).clamp_(max=_BELOW_ONE))


def sample_from_probs(probs: Tensor, coins: Tensor, *, use_flashinfer: bool = False) -> Tensor:
    """Draws `[...]` (int64) from `probs` `[..., V]` (need not be normalised), one per coin
    `[...]` in [0, 1): an exponential race, the token with the largest `p[t] / E[t]` for the
    coin's noise `E = race_noise(coins)`.

    With independent unit exponentials, token `t` wins with probability `p[t] / sum(p)` (the
    first of independent exponential clocks of rates `p` to ring): an exact sample, and the
    Gumbel-max trick in another form. A zero-mass token never wins; an all-zero row gives token 0.
    Because the noise belongs to the coin, not to the distribution, a drafter's distribution raced
    with the same coin picks the same token whenever it is close to the target's
    (`race_logits`): that is what lets a sampled row draft the token the target will draw.

    On CUDA the race is one Triton kernel (`ops.sampling_triton`) that reads each row once; the
    torch twin below writes the noise of every token. `use_flashinfer=True` switches CUDA tensors
    to flashinfer's fused sampler when it imports. That kernel draws its own uniforms from its
    philox state, so the result is a sample of the same distribution but does not follow `coins`;
    it stays opt-in for that reason.
    """
    if use_flashinfer and probs.is_cuda:
        drawn = _flashinfer_sample(probs)
        if drawn is not None:
            return drawn
    if probs.is_cuda and (kernels := _race_kernels()) is not None:
        return kernels.race_sample_triton(probs, coins)
    return argmax(probs.float() / race_noise(coins, probs.shape[-1]))


def race_logits(logits: Tensor, coins: Tensor) -> Tensor:
    """`logits + G` `[..., V]` (fp32) for the race's noise of `coins` `[...]` (`G = -log E`,
    standard Gumbel): its argmax is `sample_from_probs(softmax(logits), coins)`, and its softmax
    is the chance of each token to win that race if the logits were off by independent Gumbel
    noise. Raced with the coins the target will draw with, a drafter's logits rank its
    candidates by how likely each is to be the target's draw. On CUDA one Triton pass
    (`ops.sampling_triton`) writes it."""
    if logits.is_cuda and (kernels := _race_kernels()) is not None:
        return kernels.race_logits_triton(logits, coins)
    return logits.float() - torch.log(race_noise(coins, logits.shape[-1]))


def _race_kernels() -> Any:
    """`ops.sampling_triton`, or None without triton (the `gpu` extra): imported lazily, so a
    CPU run never needs it."""
    try:
        import ops.sampling_triton as kernels
    except ImportError:
        return None
    return kernels


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
