"""The torch gather path (the CPU's default): the step gathers every slot of its page table
(eager runs trim the table to the batch's live width; a graph gathers its whole fixed width),
the target takes one softmax over the gathered prefix and the tree's own latents, the drafter
one over the gathered context and its block."""

from __future__ import annotations

import torch
from torch import Tensor

from engine.attention.base import AttentionBackend, DraftContext
from ops.attention import PrefixKernel, gather_slots
from ops.paged import table_slots


class TorchBackend(AttentionBackend):
    name = "torch"
    option = "torch"

    def slots(self, page_table: Tensor, page_size: int) -> Tensor:
        return table_slots(page_table, page_size)

    def prefix(self, page_table: Tensor, num_nodes: int, page_size: int, scale: float
               ) -> PrefixKernel | None:
        return None

    def draft_context(self, cache: Tensor, page_table: Tensor, ctx_len: Tensor,
                      page_size: int, slots: Tensor | None) -> DraftContext:
        if slots is None:
            slots = self.slots(page_table, page_size)
        valid = torch.arange(slots.shape[1], device=slots.device) < ctx_len[:, None]
        return gather_slots(cache, slots), valid  # [layers, bs, C, kv_dim], [bs, C]
