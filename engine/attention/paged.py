"""The paged kernels: the target's prefix pass and the drafter's context pass read the caches
in place through the page table, with work that follows each row's length
(`torch.ops.kimi.mla_prefix_attention` / `draft_context_attention`: Triton on CUDA, their
`ops.paged` torch twins elsewhere). `auto` takes them on CUDA where Triton imports; asked for
on the CPU (`--attention triton`) they run as the twins. A prefill's MHA passes run
`torch.ops.kimi.mha_prefill` (`ops.prefill_triton` on CUDA, `ops.prefill.mha_attention`
elsewhere)."""

from __future__ import annotations

import torch
from torch import Tensor

from engine.attention.base import AttentionBackend, DraftContext, Setup
from engine.models.dflash import PagedContext
from ops.attention import PrefixKernel
from ops.custom_ops import triton_available  # importing it registers the kimi:: ops
from ops.prefill import MHAPass


class KernelMHA(MHAPass):
    """One MHA prefill pass as `torch.ops.kimi.mha_prefill`: the flash kernel on CUDA (and on
    the meta device, which stands in for CUDA), the twin elsewhere."""

    def score_bytes(self, device: torch.device) -> int:
        return 0 if device.type in ("cuda", "meta") and triton_available() else 8

    def __call__(self, q: Tensor, k_nope: Tensor, k_pe: Tensor, v: Tensor, scale: float,
                 causal: bool, prev_o: Tensor | None = None, prev_lse: Tensor | None = None
                 ) -> tuple[Tensor, Tensor]:
        return torch.ops.kimi.mha_prefill(q, k_nope, k_pe, v, scale, causal, prev_o, prev_lse)


KERNEL_MHA = KernelMHA()


class PagedBackend(AttentionBackend):
    name = "paged"
    option = "triton"

    @classmethod
    def auto(cls, setup: Setup) -> bool:
        # NOTE: off CUDA (or without Triton) the ops run as their twins, which gather the
        # table's whole width as the torch path does: only the kernels' length-bound reads pay.
        return setup.device.type == "cuda" and triton_available()

    def slots(self, page_table: Tensor, page_size: int) -> None:
        return None

    def prefix(self, page_table: Tensor, num_nodes: int, page_size: int, scale: float
               ) -> PrefixKernel:
        def paged(q_lat: Tensor, q_pe: Tensor, kv: Tensor, ctx_len: Tensor
                  ) -> tuple[Tensor, Tensor]:
            return torch.ops.kimi.mla_prefix_attention(q_lat, q_pe, kv, page_table, ctx_len,
                                                       page_size, scale)

        return paged

    def draft_context(self, cache: Tensor, page_table: Tensor, ctx_len: Tensor,
                      page_size: int, slots: Tensor | None) -> DraftContext:
        return PagedContext(cache, page_table, ctx_len, page_size,
                            torch.ops.kimi.draft_context_attention), None

    def prefill_pass(self) -> MHAPass:
        return KERNEL_MHA
