"""RMSNorm as transformers' DeepSeek-V3 computes it, the torch twin of `ops.norm_triton`."""

from __future__ import annotations

import torch
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`weight * (x * rsqrt(mean(x^2) + eps))` over the last dim: the row widened to fp32,
    normalized, rounded to x's dtype, then times the weight (rounded again)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The residual stream's next value `s = x + delta` (in x's dtype, as a decoder layer adds
    its branch) and `rms_norm(s)`: what the next norm of a layer reads."""
    s = x + delta
    return s, rms_norm(s, weight, eps)
