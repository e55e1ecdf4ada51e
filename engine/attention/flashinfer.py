"""flashinfer's MLA prefix kernel (`ops.attention_gpu.FlashInferMLAPrefix`, CUDA, the optional
`gpu` extra, imported lazily): one kernel planned per `(padded batch size, tree nodes)` the
runner steps, planned before each step outside the graph; the tree pass and the merge stay
`ops.attention`'s. Everything else (steps without a planned kernel, the drafter's context)
takes the paged kernels, or the torch path where Triton is missing. It runs only where one of
flashinfer's MLA backends can plan every step (`ops.attention_gpu.mla_unsupported_reason`),
decided before any capture, never by a failed one. A prefill's MHA passes run on flashinfer's
ragged prefill where its head widths and dtype fit (`ops.attention_gpu.FlashInferRaggedMHA`),
else as the fallback runs them."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from engine.attention.base import AttentionBackend, DraftContext, Setup
from engine.attention.paged import PagedBackend
from engine.attention.torch import TorchBackend
from ops.attention import PrefixKernel
from ops.prefill import MHAPass


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    option = "flashinfer"
    plans = True

    def __init__(self, kernels: dict[tuple[int, int], Any], fallback: AttentionBackend,
                 prefill: MHAPass | None = None):
        self.kernels = kernels  # (batch size, tree nodes) -> FlashInferMLAPrefix
        self.fallback = fallback
        # flashinfer's ragged prefill, or None: the fallback's pass
        self.prefill = prefill

    @classmethod
    def unavailable(cls, setup: Setup) -> str | None:
        from ops.attention_gpu import MLADevice, flashinfer_unavailable, mla_unsupported_reason

        if setup.device.type != "cuda":
            return "flashinfer needs CUDA"
        why = flashinfer_unavailable()
        if why is not None:  # not installed (the `gpu` extra), or only in part
            return why
        mc, facts = setup.target.cfg, MLADevice.of(setup.device)
        heads = setup.target.model.layers[0].self_attn.num_heads
        return next((why for bs, n in setup.steps if (why := mla_unsupported_reason(
            mc.kv_lora_rank, mc.qk_rope_head_dim, setup.pool.target.dtype, facts,
            num_heads=heads, num_queries=n, batch_size=bs)) is not None), None)

    @classmethod
    def create(cls, setup: Setup) -> FlashInferBackend:
        from ops.attention_gpu import FlashInferMLAPrefix, MLADevice, mla_workspace_bytes
        from ops.custom_ops import triton_available

        mc, dev, dtype = setup.target.cfg, setup.device, setup.pool.target.dtype
        facts = MLADevice.of(dev)
        heads = setup.target.model.layers[0].self_attn.num_heads
        ws = torch.empty(mla_workspace_bytes(mc.kv_lora_rank, facts.num_sms),
                         dtype=torch.uint8, device=dev)  # NOTE: one stream: shared
        kernels = {(bs, n): FlashInferMLAPrefix(
            bs, n, setup.max_pages, setup.pool.page_size, heads, mc.kv_lora_rank,
            mc.qk_rope_head_dim, mc.softmax_scale, dtype, dev, workspace=ws,
            device_facts=facts) for bs, n in setup.steps}
        from ops.attention_gpu import FlashInferRaggedMHA, ragged_prefill_unavailable

        ragged = ragged_prefill_unavailable(mc.qk_head_dim, mc.v_head_dim, dtype) is None
        return cls(kernels, PagedBackend() if triton_available() else TorchBackend(),
                   FlashInferRaggedMHA(dev) if ragged else None)

    def plan(self, page_table: Tensor, cache_len: Tensor, num_nodes: int) -> None:
        kernel = self.kernels.get((page_table.shape[0], num_nodes))
        if kernel is not None:
            kernel.plan(page_table, cache_len)

    def slots(self, page_table: Tensor, page_size: int) -> Tensor | None:
        return self.fallback.slots(page_table, page_size)

    def prefix(self, page_table: Tensor, num_nodes: int, page_size: int, scale: float
               ) -> PrefixKernel | None:
        kernel = self.kernels.get((page_table.shape[0], num_nodes))
        if kernel is not None:
            return kernel
        return self.fallback.prefix(page_table, num_nodes, page_size, scale)

    def draft_context(self, cache: Tensor, page_table: Tensor, ctx_len: Tensor,
                      page_size: int, slots: Tensor | None) -> DraftContext:
        return self.fallback.draft_context(cache, page_table, ctx_len, page_size, slots)

    def prefill_pass(self) -> MHAPass:
        return self.prefill if self.prefill is not None else self.fallback.prefill_pass()

    def __repr__(self) -> str:
        return (f"FlashInferBackend({sorted(self.kernels)}, fallback={self.fallback!r}, "
                f"prefill={'ragged' if self.prefill is not None else 'fallback'})")
