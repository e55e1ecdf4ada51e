"""Paged KV storage: a torch-free page allocator and the page pool tensors.

One page table serves both caches of a request: the target's latent cache (`R + P` values per
token per layer) and the drafter's projected-context K/V, because both are indexed by the same
token positions. Page 0 is reserved as the dummy page: padding rows and padding slots point
there, so graph kernels treat them as ordinary rows without touching real requests' memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.config import pages_needed  # noqa: F401 - the pool's unit, named here too

DUMMY_PAGE = 0


class OutOfPages(RuntimeError):
    """The pool cannot satisfy an allocation; the caller queues or preempts."""


class BlockAllocator:
    """Free list plus reference counts over page ids `reserved .. num_pages - 1`."""

    def __init__(self, num_pages: int, reserved: int = 1):
        if num_pages <= reserved:
            raise ValueError(f"need more than {reserved} pages, got {num_pages}")
        self.num_pages = num_pages
        self.reserved = reserved
        self._free = list(range(num_pages - 1, reserved - 1, -1))  # pop() hands out low ids first
        self._ref = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_pages - self.reserved

    def alloc(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._ref[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            if self._ref[p] <= 0:
                raise ValueError(f"page {p} is not allocated")
            self._ref[p] += 1

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p < self.reserved or self._ref[p] <= 0:
                raise ValueError(f"page {p} is not allocated")
            self._ref[p] -= 1
            if self._ref[p] == 0:
                self._free.append(p)

    def refcount(self, page: int) -> int:
        return self._ref[page]


@dataclass
class KVPool:
    """The device tensors. Slot `s` of page `p` is flat index `p * page_size + s`."""

    page_size: int
    num_pages: int
    target: torch.Tensor  # [target_layers, num_pages * page_size, R + P]
    draft: torch.Tensor | None  # [draft_layers, num_pages * page_size, 2 * kv_heads * head_dim]

    @classmethod
    def allocate(
        cls, *, page_size: int, num_pages: int, target_layers: int, target_dim: int,
        draft_layers: int = 0, draft_dim: int = 0, dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> KVPool:
        slots = num_pages * page_size
        zeros = _lazy_zeros if torch.device(device).type == "cpu" else torch.zeros
        target = zeros(target_layers, slots, target_dim, dtype=dtype, device=device)
        draft = (zeros(draft_layers, slots, draft_dim, dtype=dtype, device=device)
                 if draft_layers else None)
        return cls(page_size, num_pages, target, draft)

    @staticmethod
    def pages_for_budget(budget_bytes: int, bytes_per_token: int, page_size: int) -> int:
        """How many pages (dummy included) fit in `budget_bytes`."""
        n = budget_bytes // (bytes_per_token * page_size)
        if n < 2:
            raise ValueError(
                f"KV budget of {budget_bytes} bytes holds {n} pages of {page_size} tokens "
                f"({bytes_per_token} bytes per token); need at least 2")
        return int(n)


def _lazy_zeros(*shape: int, dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """Zeros on the CPU whose memory is taken only as it is written: numpy's zeros come from
    calloc, which maps fresh zero pages (torch's zeros writes every byte). So a pool sized for
    the prefix cache costs its pages as they fill, not all at start."""
    n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    if n == 0:
        return torch.zeros(*shape, dtype=dtype, device=device)
    return torch.from_numpy(np.zeros(n, np.uint8)).view(dtype).view(*shape)
