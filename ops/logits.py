"""Per-row adjustments of the target's logits and their log-probabilities, at fixed shapes.

A row's logit bias arrives as a fixed number of `(token id, bias)` entries (unused ones: token 0,
bias 0, which changes nothing) and a grammar's allowed tokens as a bitmask of `ceil(V / 32)`
int32 words (bit `t % 32` of word `t // 32`: token `t` allowed; every bit set: no constraint),
the layout llguidance and xgrammar fill. Both apply in place, with no host sync, so a captured
step applies them whatever its rows ask.

Log-probabilities are what plain decoding reports for a token: the log-softmax of the row's
logits as the model gave them (vLLM's default: before the temperature, the bias and top-k /
top-p), with a grammar's mask applied. `emitted_logprobs` reads them off the logits a step has
already biased, one emitted position at a time, so nothing `[bs, N, V]` beside the logits is
made.
"""

from __future__ import annotations

import torch
from torch import Tensor

# NOTE: llguidance and vLLM report a token the grammar rules out at -inf; JSON has no -inf, and
# vLLM's API clamps to this, as the server does.
MIN_LOGPROB = -9999.0


def add_bias_(logits: Tensor, ids: Tensor, values: Tensor) -> Tensor:
    """Add each row's bias `values [bs, B]` (fp32) at `ids [bs, B]` to every node of its
    `logits [bs, N, V]`, in place; returns `logits`."""
    bs, n, _ = logits.shape
    return logits.scatter_add_(2, ids[:, None].expand(bs, n, -1),
                               values[:, None].expand(bs, n, -1).to(logits.dtype))


def allowed_tokens(bitmask: Tensor, vocab: int) -> Tensor:
    """The bool `[bs, V]` of a token bitmask `[bs, ceil(V / 32)]` (int32)."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = (bitmask[..., None] >> bits) & 1  # [bs, W, 32]
    return allowed.reshape(*bitmask.shape[:-1], -1)[..., :vocab].bool()


def mask_(logits: Tensor, bitmask: Tensor) -> Tensor:
    """Set to -inf, in place, the `logits [bs, V]` of the tokens `bitmask [bs, ceil(V / 32)]`
    rules out; returns `logits`."""
    return logits.masked_fill_(~allowed_tokens(bitmask, logits.shape[-1]), float("-inf"))


def token_logprobs(x: Tensor, tokens: Tensor, top: int) -> tuple[Tensor, Tensor, Tensor]:
    """The log-softmax of `x [n, V]` at `tokens [n]` (negative entries: any token, the result
    unused) and at the `top` most likely tokens: `[n]`, `[n, top]` and their ids `[n, top]`
    (int64), most likely first."""
    lse = torch.logsumexp(x, -1, keepdim=True)
    vals, ids = x.topk(top, dim=-1)
    return (x.gather(1, tokens[:, None].clamp(min=0)) - lse)[:, 0], vals - lse, ids


def emitted_logprobs(logits: Tensor, nodes: Tensor, tokens: Tensor, top: int,
                     bias_ids: Tensor | None = None, bias_values: Tensor | None = None
                     ) -> tuple[Tensor, Tensor, Tensor]:
    """Log-probabilities of the emitted `tokens [bs, S]`, token `j` drawn from the logits of
    node `nodes[:, j]` of `logits [bs, N, V]` (-1 entries: any node, the result unused), and
    the `top` most likely tokens there: the token's `[bs, S]`, the top ones' `[bs, S, top]`
    and their ids `[bs, S, top]` (int64), most likely first. With `bias_ids` and
    `bias_values` (`add_bias_`'s), the logits carry that bias and it is taken off first, so
    the result is the unbiased one (to float32 rounding: `(x + b) - b`).
    NOTE: one position at a time over a `[bs, V]` copy of its rows; `S` is small."""
    bs, S = tokens.shape
    rows = torch.arange(bs, device=logits.device)
    token_lp, top_lp, top_ids = [], [], []
    for j in range(S):
        x = logits[rows, nodes[:, j].clamp(min=0)]  # [bs, V], a copy
        if bias_ids is not None and bias_values is not None:
            x.scatter_add_(1, bias_ids, -bias_values.to(x.dtype))
        lp, vals, ids = token_logprobs(x, tokens[:, j], top)
        token_lp.append(lp)
        top_lp.append(vals)
        top_ids.append(ids)
    return (torch.stack(token_lp, 1), torch.stack(top_lp, 1), torch.stack(top_ids, 1))
