"""Rotary embeddings: plain, linear and YaRN frequencies; interleaved and rotate-half forms."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ops.yarn import yarn_m


def rope_frequencies(
    dim: int, theta: float, scaling: dict[str, Any] | None, max_position_embeddings: int = 4096
) -> tuple[Tensor, float]:
    """Inverse frequencies `[dim // 2]` (fp32) and the cos/sin amplitude for a rotary head of `dim`.

    YaRN follows DeepSeek-V3: frequencies blended by a linear ramp between the correction dims
    of `beta_fast` and `beta_slow` rotations over the original context, amplitude
    `m(f, mscale) / m(f, mscale_all_dim)` (an explicit `attention_factor` overrides it).

    Computed on the CPU whatever the default device: under a meta device (a model built before
    its weights load) `arange` runs torch's Python reference, whose first call imports dynamo,
    1.5 s of every engine's start.
    """
    extra = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    if not scaling:
        return extra, 1.0
    kind = scaling.get("type")
    factor = scaling.get("factor")
    if kind == "linear":
        return extra / float(factor), 1.0
    if kind != "yarn":
        raise ValueError(f"unsupported rope scaling type {kind!r}")
    orig = int(scaling.get("original_max_position_embeddings") or 4096)
    if factor is None:
        factor = max_position_embeddings / orig
    factor = float(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def corr(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = corr(beta_fast), corr(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    half = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((half - low) / (high - low)).clamp(0, 1)
    inv_freq = (extra / factor) * ramp + extra * (1 - ramp)
    amp = scaling.get("attention_factor")
    if amp is None:
        ms, ms_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        amp = yarn_m(factor, ms) / yarn_m(factor, ms_all) if ms and ms_all else yarn_m(factor, 1.0)
    return inv_freq, float(amp)


def rope_cos_sin(positions: Tensor, inv_freq: Tensor, amplitude: float) -> tuple[Tensor, Tensor]:
    """cos/sin `[..., dim // 2]` (fp32) for integer `positions [...]`."""
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    return freqs.cos() * amplitude, freqs.sin() * amplitude


def apply_rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """DeepSeek's interleaved pairs (dims 2i, 2i+1 rotate together).

    `x [..., heads, dim]`, `cos/sin [..., dim // 2]` (broadcast over heads). The result is laid
    out de-interleaved (all rotated evens, then all odds); queries and keys both use this layout,
    so their dot products equal the interleaved form's exactly.
    """
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rope_tail(x: Tensor, cos: Tensor, sin: Tensor, nope: int) -> Tensor:
    """`x [..., heads, D]` with its last `D - nope` channels rotated (`apply_rope_interleaved`)
    and its first `nope` as they are: an MLA query (`nope` = `qk_nope_head_dim`) or key part
    (`nope` = 0). The torch twin of `ops.rope_triton`."""
    if nope == 0:
        return apply_rope_interleaved(x, cos, sin)
    return torch.cat([x[..., :nope], apply_rope_interleaved(x[..., nope:], cos, sin)], dim=-1)


def apply_rope_half(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half convention (Qwen3, the DFlash drafter). Shapes as in `apply_rope_interleaved`."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h].float(), x[..., h:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
