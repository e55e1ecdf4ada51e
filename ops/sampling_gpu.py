"""GPU twins of `ops.sampling` on flashinfer's sampling kernels (CUDA only, imported lazily).

`target_probs_flashinfer` is `ops.sampling.target_probs` as three fused kernels (softmax with a
per-row temperature, top-k renorm, top-p renorm). `sample_flashinfer` draws from probabilities
with explicit `seed` / `offset` device tensors: inside a CUDA graph the default generator path
would replay the same numbers forever, so the offset lives in a buffer and advances inside the
graph. Leave `check_nan` off: it syncs.

The exact tree walk keeps its own coins (`ops.verify`); these twins serve the probabilities and
any plain draw.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _per_row(x: Tensor, rows: int, per: int, dtype: torch.dtype) -> Tensor:
    return x.to(dtype).repeat_interleave(per) if per > 1 else x.to(dtype).reshape(rows)


def target_probs_flashinfer(logits: Tensor, temperature: Tensor, top_k: Tensor,
                            top_p: Tensor) -> Tensor:
    """`[bs, ..., V]` fp32, the distribution of `ops.sampling.target_probs` (`top_k <= 0` or
    `>= V` and `top_p >= 1` mean off). Ties at a top-k or top-p boundary may keep a different
    token set than the torch twin's stable order."""
    from flashinfer import sampling as fs

    shape, vocab = logits.shape, logits.shape[-1]
    rows = logits.reshape(-1, vocab).float().contiguous()
    per = rows.shape[0] // shape[0]
    temp = _per_row(temperature, rows.shape[0], per, torch.float32)
    k = top_k.to(torch.int64)
    k = torch.where((k <= 0) | (k >= vocab), vocab, k)
    k = _per_row(k, rows.shape[0], per, torch.int32)
    p = _per_row(top_p, rows.shape[0], per, torch.float32)
    probs = fs.softmax(rows, temperature=temp)
    probs = fs.top_k_renorm_probs(probs, k)
    # NOTE: top_p >= 1 is "off" explicitly, as in the torch twin (no kernel boundary effects).
    probs = torch.where(p[:, None] >= 1.0, probs, fs.top_p_renorm_probs(probs, p.clamp(max=1.0)))
    return probs.view(shape)


class DeviceSeed:
    """A philox seed and offset held in device buffers, for draws inside a captured graph."""

    def __init__(self, seed: int, device: torch.device | str = "cuda", stride: int = 1 << 16):
        self.seed = torch.tensor([seed], dtype=torch.int64, device=device)
        self.offset = torch.zeros(1, dtype=torch.int64, device=device)
        self.stride = stride  # offsets consumed per draw: generous, so streams never overlap

    def advance(self) -> None:
        self.offset.add_(self.stride)  # in-graph: every replay moves on


def sample_flashinfer(probs: Tensor, rng: DeviceSeed) -> Tensor:
    """One draw per row of `probs [rows, V]` (int64), graph-safe; advances `rng` in place."""
    from flashinfer.sampling import sampling_from_probs

    drawn = sampling_from_probs(probs.float().contiguous(), deterministic=True,
                                seed=rng.seed, offset=rng.offset)
    rng.advance()
    return drawn.to(torch.int64)
