"""Attention backends: how the spec step's attention reads the paged caches, one file each,
behind the interface of `engine.attention.base`, chosen once by `select_backend` (the engine's
`--attention`). The step and the runner only call the backend's hooks; nothing outside this
folder asks which backend runs. A new kernel is a new file here and a line in `BACKENDS`."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.attention.base import AttentionBackend, DraftContext, Setup
from engine.attention.flashinfer import FlashInferBackend
from engine.attention.paged import KERNEL_MHA, PagedBackend
from engine.attention.torch import TorchBackend
from engine.kv_cache import KVPool
from engine.models.kimi import KimiForCausalLM
from ops.prefill import TORCH_MHA

__all__ = ["BACKENDS", "AttentionBackend", "DraftContext", "FlashInferBackend", "PagedBackend",
           "Setup", "TorchBackend", "options", "prefill_score_bytes", "select_backend"]

# Every backend, in the order `auto` tries them: the first whose `auto` holds is taken (on CUDA
# flashinfer, else the Triton kernels, else torch; on the CPU torch). The last must always hold.
BACKENDS: list[type[AttentionBackend]] = [FlashInferBackend, PagedBackend, TorchBackend]


def options() -> tuple[str, ...]:
    """The `--attention` values: `auto` and each backend's `option`."""
    return ("auto", *(b.option for b in BACKENDS))


def prefill_score_bytes(want: str, device: torch.device) -> int:
    """Bytes per (query, key, head) a prefill's attention materializes under `--attention
    want` on `device` (`ops.prefill.MHAPass.score_bytes`), known before the pool that
    `select_backend` needs: the torch backend's twin materializes its scores; every other
    backend, and `auto`, runs `torch.ops.kimi.mha_prefill` or flashinfer's ragged prefill, flash
    kernels on CUDA where Triton imports (where it does not, `auto` may fall back to the twin:
    counted as the twin)."""
    return (TORCH_MHA if want == "torch" else KERNEL_MHA).score_bytes(device)


def select_backend(want: str, target: KimiForCausalLM, pool: KVPool,
                   steps: Iterable[tuple[int, int]], max_pages: int) -> AttentionBackend:
    """The backend `want` names (`--attention`: a backend's `option`, or `auto`), built for
    `target` over `pool` (its device and dtype), for every `(padded batch size, tree nodes)` in
    `steps` and page tables `max_pages` wide. `auto` never picks a backend whose constraints
    fail; a named one that cannot run raises a ValueError that says why."""
    setup = Setup(target, pool, tuple(sorted(set(steps))), max_pages)
    if want == "auto":
        chosen = next(b for b in BACKENDS if b.auto(setup))
    else:
        chosen = next((b for b in BACKENDS if b.option == want), None)
        if chosen is None:
            raise ValueError(f"--attention must be one of {options()}, got {want!r}")
        why = chosen.unavailable(setup)
        if why is not None:
            raise ValueError(f"--attention {want} cannot run here: {why}")
    return chosen.create(setup)
