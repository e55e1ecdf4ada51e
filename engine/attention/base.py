"""The attention backend interface: how the spec step's attention reads the paged caches.

A backend answers, for one step, the few questions the step and the runner ask of it, so
neither ever looks at which kernel runs (mini-sglang's backends behind a few hooks):

- `plan(page_table, cache_len, num_nodes)`: host-side work before every step (where `plans`)
  and every capture, outside the graph, from the host copies of the page table and context
  lengths the step is about to read (a no-op for most);
- `slots(page_table, page_size)`: the flat cache slots the step gathers its context through,
  or None when the kernels read the pages in place;
- `prefix(page_table, num_nodes, page_size, scale)`: the target's prefix-attention kernel
  (`ops.attention.PrefixKernel`), or None for one softmax over the gathered slots;
- `draft_context(cache, page_table, ctx_len, page_size, slots)`: the drafter's committed
  context, gathered `[layers, bs, C, kv_dim]` with its validity mask, or a `PagedContext` that
  carries the context attention reading it in place;
- `prefill_pass()`: the MHA pass every prefill chunk's attention runs (`ops.prefill.MHAPass`:
  the chunk's own causal square and each up-projected prefix chunk), by default the torch twin.

Each class also says whether it can run where the engine runs (`unavailable`), whether `auto`
takes it there (`auto`), and builds itself (`create`) from a `Setup`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from engine.kv_cache import KVPool
from engine.models.dflash import PagedContext
from engine.models.kimi import KimiForCausalLM
from ops.attention import PrefixKernel
from ops.prefill import TORCH_MHA, MHAPass

# The drafter's context as the step hands it over: gathered rows with their validity mask
# (`[layers, bs, C, kv_dim]`, `[bs, C]`), or read in place (`PagedContext`, no mask).
DraftContext = tuple[Tensor | PagedContext, Tensor | None]


@dataclass(frozen=True)
class Setup:
    """What a backend is chosen and built from: the target, the KV pool (its device and
    dtype), every `(padded batch size, tree nodes)` the runner steps, and the page-table
    width."""

    target: KimiForCausalLM
    pool: KVPool
    steps: tuple[tuple[int, int], ...]
    max_pages: int

    @property
    def device(self) -> torch.device:
        return self.pool.target.device


class AttentionBackend:
    """One way of reading the paged caches. Subclasses set `name` (what it is called) and
    `option` (the `--attention` value that asks for it) and override the hooks they need."""

    name: ClassVar[str]
    option: ClassVar[str]
    # Whether `plan` does any work: the runner calls it before a step only then (and times it
    # as a phase of its own), and before every capture.
    plans: ClassVar[bool] = False

    @classmethod
    def unavailable(cls, setup: Setup) -> str | None:
        """Why this backend cannot run in `setup`, or None when it can."""
        return None

    @classmethod
    def auto(cls, setup: Setup) -> bool:
        """Whether `--attention auto` takes this backend in `setup` (the registry's order
        decides between those that qualify)."""
        return cls.unavailable(setup) is None

    @classmethod
    def create(cls, setup: Setup) -> AttentionBackend:
        return cls()

    def plan(self, page_table: Tensor, cache_len: Tensor, num_nodes: int) -> None:
        """Before every step and capture, outside the graph: the host copies of the page table
        `[bs, W]` and context lengths `[bs]` the step of `num_nodes` tree nodes will read."""
        return None

    def slots(self, page_table: Tensor, page_size: int) -> Tensor | None:
        """The flat cache slots `[bs, W * page_size]` the step gathers its context through, or
        None when this backend's kernels read the pages in place."""
        raise NotImplementedError

    def prefix(self, page_table: Tensor, num_nodes: int, page_size: int, scale: float
               ) -> PrefixKernel | None:
        """The target's prefix-attention kernel for a step of `page_table [bs, W]` and
        `num_nodes` tree nodes, or None: one softmax over the gathered slots."""
        raise NotImplementedError

    def draft_context(self, cache: Tensor, page_table: Tensor, ctx_len: Tensor,
                      page_size: int, slots: Tensor | None) -> DraftContext:
        """The drafter's committed context from its cache `[layers, num_slots, kv_dim]`:
        `slots` is what `self.slots` returned for this step."""
        raise NotImplementedError

    def prefill_pass(self) -> MHAPass:
        """The MHA pass of a prefill's attention (`ops.prefill.mla_prefill`): the first chunk
        of a prompt and every later one (chunked prefill, the drafter's catch-up, prompt
        log-probabilities, a prefix-cache hit's remainder)."""
        return TORCH_MHA

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
