"""How many KV pages the engine allocates: one rule, pure arithmetic (no torch), so the engine
(with the memory it reads after loading the weights) and `graphs.plan` (with planned numbers)
size the pool the same way.

The rule, vLLM's `--gpu-memory-utilization`:

    pool bytes = budget - used - reserve
    budget     = total device memory x --gpu-memory-utilization (CUDA), or
                 --cpu-memory-budget (the CPU; default CPU_MEMORY_SHARE of MemAvailable)
    used       = what is already taken when the pool is sized: the weights, and on CUDA
                 everything `mem_get_info` shows in use (CUDA context, NCCL, other processes)
    reserve    = what the engine still allocates after the pool (`activation_reserve`)
    pages      = pool bytes // (page_size x KV bytes per token), at least 1 + pages per
                 context (the dummy page and one full `max_model_len` context), else
                 `KVMemoryError` naming the knobs.

With the prefix cache (on by default) every page the memory holds is used: pages past every
batch slot at full context keep cached prefixes (`PoolSize.cache_tokens`). Without it the pool
is capped at 1 + max_batch_size x pages per context: more would never be written. (The engine
keeps the cap on the CPU under its default budget, a guess: `engine.llm`.)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default
# NOTE: the CPU shares its RAM with the OS, other processes, inductor's compile workers and the
# page cache of the checkpoint being read; half of what is available when the engine starts is
# what it takes without `--cpu-memory-budget`.
CPU_MEMORY_SHARE = 0.5
# NOTE: not plannable, so a fixed reserve on CUDA: the allocator's fragmentation, cuBLAS and
# attention workspaces, and what the captured graphs' private pool holds beyond one step's
# activations (every captured size keeps its own outputs).
CUDA_OVERHEAD_BYTES = 2 * 2**30
# NOTE: only for planning (`graphs.plan`): the CUDA context and NCCL's buffers, which a real
# engine reads as used memory from `mem_get_info` after loading its weights.
CUDA_RUNTIME_BYTES = 2**30

# The most prompt tokens one engine step prefills (`--prefill-chunk`'s default): on the CPU, as
# many as a batched prefill took before prompts were chunked; on CUDA, the largest power of two
# whose prefill activations stay under 4 GB per rank for Kimi K2.5 at --tp 8 (`python -m
# graphs.plan --rehearse` measures them).
PREFILL_CHUNK = {"cpu": 2048, "cuda": 4096}

UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
         "t": 1e12, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class KVMemoryError(ValueError):
    """Not even one full context fits in the memory left for the KV pool."""


def parse_size(s: str | int) -> int:
    """Bytes from `17179869184`, `16GB`, `16 GiB` or `1.5tb` (decimal and binary units)."""
    if isinstance(s, int) and not isinstance(s, bool):
        n = s
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", str(s))
        if not m or m.group(2).lower() not in UNITS:
            raise ValueError(f"expected a size such as 16GB, 80GiB or a number of bytes, "
                             f"got {s!r}")
        n = int(float(m.group(1)) * UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"a memory size must be positive, got {s!r}")
    return n


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def mem_available() -> int | None:
    """The RAM the kernel says new work can take without swapping (`MemAvailable`), or None
    where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def default_cpu_budget() -> int | None:
    """`--cpu-memory-budget`'s default: CPU_MEMORY_SHARE of MemAvailable (None: unknown)."""
    avail = mem_available()
    return int(avail * CPU_MEMORY_SHARE) if avail else None


def checkpoint_bytes(path: str | Path | None) -> int:
    """Bytes of a checkpoint directory's safetensors as stored (0 for a config-only dir): the
    index's `total_size` when it has one, else the files' sizes."""
    if path is None:
        return 0
    p = Path(path)
    index = p / "model.safetensors.index.json"
    if index.is_file():
        import json

        try:
            total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
            if total:
                return int(total)
        except (OSError, ValueError):
            pass
    return sum(f.stat().st_size for f in p.glob("*.safetensors") if f.is_file())


# ---- the reserve -------------------------------------------------------------------------------


def step_activation_bytes(*, rows: int, vocab_size: int) -> int:
    """A step's live activations, estimated: float32 logits over every verified and drafted
    row, three times over (logits, probabilities, the sampler's temporaries: a sampled step
    with a top-p row at batch 64 measured 1.05x twice over). `graphs.plan` measures every
    captured step on the meta device and says when one exceeds this."""
    return 3 * rows * vocab_size * 4


def default_prefill_chunk(device_type: str) -> int:
    """`--prefill-chunk`'s default on a device of `device_type` ("cpu", "cuda", or "meta",
    which plans for CUDA)."""
    return PREFILL_CHUNK["cpu" if device_type == "cpu" else "cuda"]


def prefill_activation_bytes(mc: Any, *, tokens: int, tp: int, dtype_bytes: int,
                             score_bytes: int) -> int:
    """One prefill forward's live activations over `tokens` tokens (a `ModelConfig`), estimated:
    every layer's cache rows (listed, then stacked), one layer's attention in the MHA form
    (queries, keys and values expanded per head, `score_bytes` per query, key and head of the
    chunk's causal square: `ops.prefill.MHAPass.score_bytes`, 0 for a flash kernel, and one
    prefix chunk, `ops.prefill.PREFIX_CHUNK_BYTES`, with its float32 partial outputs), the
    widest MLP of one layer, the grouped expert kernels' scratch (a hidden row and an activation
    row per token and chosen expert, `ops.moe.fused_workspace_bytes`) and a few hidden-state
    copies in float32."""
    # NOTE: here, so the HTTP process imports no torch
    from ops.moe import fused_workspace_bytes
    from ops.prefill import PREFIX_CHUNK_BYTES

    heads = -(-mc.num_attention_heads // tp)
    rows = 2 * mc.num_hidden_layers * tokens * mc.kv_cache_dim * dtype_bytes
    attn = heads * tokens * (2 * mc.qk_head_dim + mc.v_head_dim) * dtype_bytes \
        + heads * tokens * tokens * score_bytes \
        + PREFIX_CHUNK_BYTES + 3 * heads * tokens * (mc.v_head_dim + 1) * 4
    moe = (mc.num_experts_per_tok + mc.n_shared_experts) * mc.moe_intermediate_size
    mlp = 3 * tokens * max(mc.intermediate_size // tp, moe) * dtype_bytes
    scratch = fused_workspace_bytes(tokens, mc.num_experts_per_tok, mc.hidden_size,
                                    -(-mc.moe_intermediate_size // tp), dtype_bytes)
    hidden = 6 * tokens * mc.hidden_size * 4
    return rows + attn + mlp + scratch + hidden


def image_activation_bytes(vc: Any, *, patches: int, dtype_bytes: int) -> int:
    """One image through the vision tower and projector (a `VisionConfig`; the engine encodes
    a prompt's images one at a time, `engine.runner`), estimated: per patch a block's live
    rows (its input, the normed rows, query/key/value, the attention's output and the residual:
    seven widths, and the MLP's hidden rows twice) and the rotary cos/sin in float32; per merged
    token the projector's rows (the normed members, the wide layer's output and activation, the
    text-width output). Attention runs per image through SDPA's fused kernels on CUDA: no
    patches x patches scores."""
    d, i = vc.hidden_size, vc.intermediate_size
    tower = patches * ((7 * d + 2 * i) * dtype_bytes + 2 * (vc.head_dim // 2) * 4)
    tokens = patches // vc.merge
    projector = tokens * (3 * vc.merge * d + vc.text_hidden_size) * dtype_bytes
    return tower + projector


@dataclass(frozen=True)
class Reserve:
    """What the engine allocates after the KV pool, by part (bytes)."""

    step: int  # the largest batch's step activations (the captured graphs' pool)
    prefill: int  # the largest batched prefill's activations
    overhead: int  # CUDA_OVERHEAD_BYTES on CUDA, 0 on the CPU
    image: int = 0  # the largest image's encoding (a vision tower's checkpoint), before a prefill

    @property
    def total(self) -> int:
        return self.step + self.prefill + self.overhead + self.image


def activation_reserve(mc: Any, *, tp: int, max_batch_size: int, step_rows: int,
                       prefill_tokens: int, dtype_bytes: int, cuda: bool,
                       prefill_score_bytes: int, vision: Any = None,
                       image_patches: int = 0) -> Reserve:
    """The reserve for `mc` (a `ModelConfig`): the step of `max_batch_size` rows of `step_rows`
    tokens each (tree nodes plus draft block), a prefill of `prefill_tokens` tokens (one engine
    step's prefill, `--prefill-chunk`: a longer prompt is chunked) whose attention materializes
    `prefill_score_bytes` per query, key and head (`engine.attention.prefill_score_bytes`), with
    a vision tower (`vision`, a `VisionConfig`) the encoding of an image of `image_patches`
    patches (the most the preprocessing leaves) and, on CUDA, the fixed overhead."""
    return Reserve(
        step=step_activation_bytes(rows=max_batch_size * step_rows, vocab_size=mc.vocab_size),
        prefill=prefill_activation_bytes(mc, tokens=prefill_tokens, tp=tp,
                                         dtype_bytes=dtype_bytes,
                                         score_bytes=prefill_score_bytes),
        overhead=CUDA_OVERHEAD_BYTES if cuda else 0,
        image=image_activation_bytes(vision, patches=image_patches, dtype_bytes=dtype_bytes)
        if vision is not None else 0)


# ---- the rule ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolSize:
    """A sized KV pool: `num_pages` pages (the dummy page included) of `page_size` tokens."""

    num_pages: int
    page_size: int
    bytes_per_token: int
    pages_per_context: int  # one full `max_model_len` context (and a step's span)
    max_model_len: int
    fit_pages: int  # what the memory holds, before the cap
    cap_pages: int  # every batch slot at full context
    budget_bytes: int
    used_bytes: int
    reserve_bytes: int
    source: str = "memory"  # "memory", or "--kv-pages" when given

    @property
    def tokens(self) -> int:
        """KV tokens requests can use (the dummy page left out)."""
        return (self.num_pages - 1) * self.page_size

    @property
    def contexts(self) -> int:
        """Full `max_model_len` contexts the pool holds at once."""
        return (self.num_pages - 1) // self.pages_per_context

    @property
    def pool_bytes(self) -> int:
        return self.num_pages * self.page_size * self.bytes_per_token

    @property
    def cache_tokens(self) -> int:
        """Tokens the pool holds past every batch slot at full context: room that only the
        prefix cache uses."""
        return max(self.num_pages - self.cap_pages, 0) * self.page_size

    def describe(self) -> str:
        why = ("set by --kv-pages" if self.source != "memory" else
               "capped at every batch slot at full context" if self.num_pages == self.cap_pages
               and self.fit_pages > self.cap_pages
               else f"from {gb(self.budget_bytes)} budget - {gb(self.used_bytes)} used - "
                    f"{gb(self.reserve_bytes)} reserve")
        room = (f"; {self.cache_tokens:,} tokens past every batch slot at full context keep "
                f"cached prefixes" if self.cache_tokens else "")
        return (f"KV pool: {self.tokens:,} tokens ({self.num_pages - 1:,} pages of "
                f"{self.page_size}, {gb(self.pool_bytes)}), {self.contexts} full "
                f"{self.max_model_len:,}-token context{'s' if self.contexts != 1 else ''} "
                f"({why}{room})")


def size_kv_pool(*, budget_bytes: int, used_bytes: int, reserve_bytes: int,
                 bytes_per_token: int, page_size: int, max_model_len: int,
                 pages_per_context: int, max_batch_size: int, budget_flag: str = "",
                 tp: int = 1, prefix_caching: bool = True) -> PoolSize:
    """The module's rule. `pages_per_context`: a full `max_model_len` context plus the widest
    step's span, in pages. `budget_flag` says where the budget came from (for the error).
    Without `prefix_caching` the pool is capped at every batch slot at full context."""
    if bytes_per_token <= 0 or page_size <= 0 or pages_per_context <= 0:
        raise ValueError("bytes_per_token, page_size and pages_per_context must be positive")
    room = budget_bytes - used_bytes - reserve_bytes
    fit = max(room, 0) // (page_size * bytes_per_token)
    cap = 1 + max_batch_size * pages_per_context
    need = 1 + pages_per_context
    if fit < need:
        raise KVMemoryError(
            f"the KV cache does not fit one full context: --max-model-len {max_model_len:,} "
            f"needs {need * page_size * bytes_per_token / 1e9:.2f} GB of KV "
            f"({bytes_per_token:,} bytes a token), but {gb(max(room, 0))} is left of the "
            f"{gb(budget_bytes)} budget ({budget_flag or 'the memory budget'}) after "
            f"{gb(used_bytes)} in use (the weights) and a {gb(reserve_bytes)} reserve for "
            f"activations: " + (
                f"lower --max-model-len (at most {(fit - 1) * page_size:,} tokens fit), "
                if fit > 1 else "no --max-model-len fits (the weights and the reserve alone "
                f"pass the budget by {gb(-room)}), so ") +
            f"raise --tp (now {tp}: the weights split over more GPUs) or raise "
            f"--gpu-memory-utilization (or --cpu-memory-budget on the CPU)")
    return PoolSize(fit if prefix_caching else min(fit, cap), page_size, bytes_per_token,
                    pages_per_context, max_model_len, fit, cap, budget_bytes, used_bytes,
                    reserve_bytes)


def engine_pool(mc: Any, *, kv_pages: int | None, budget_bytes: int | None, used_bytes: int,
                budget_flag: str, tp: int, max_batch_size: int, step_rows: int,
                prefill_tokens: int, dtype_bytes: int, cuda: bool, prefill_score_bytes: int,
                bytes_per_token: int, page_size: int, max_model_len: int, pages_per_context: int,
                prefix_caching: bool = True, vision: Any = None, image_patches: int = 0
                ) -> tuple[Reserve, PoolSize | None, KVMemoryError | None]:
    """What the engine sizes once its weights are loaded (`engine.llm.LLM`, and `graphs.plan`
    with planned numbers): its `activation_reserve` for `mc` and the KV pool, `kv_pages` pages
    (`--kv-pages`) when given, every batch slot at full context when the budget is unknown
    (None), else `size_kv_pool`'s; no pool and the error when not one full context fits."""
    reserve = activation_reserve(mc, tp=tp, max_batch_size=max_batch_size, step_rows=step_rows,
                                 prefill_tokens=prefill_tokens, dtype_bytes=dtype_bytes,
                                 cuda=cuda, prefill_score_bytes=prefill_score_bytes,
                                 vision=vision, image_patches=image_patches)
    if kv_pages is not None or budget_bytes is None:
        cap = 1 + max_batch_size * pages_per_context
        pages = cap if kv_pages is None else kv_pages
        return reserve, PoolSize(pages, page_size, bytes_per_token, pages_per_context,
                                 max_model_len, pages, cap, 0, 0, 0,
                                 source="memory" if kv_pages is None else "--kv-pages"), None
    try:
        return reserve, size_kv_pool(
            budget_bytes=budget_bytes, used_bytes=used_bytes, reserve_bytes=reserve.total,
            bytes_per_token=bytes_per_token, page_size=page_size, max_model_len=max_model_len,
            pages_per_context=pages_per_context, max_batch_size=max_batch_size,
            budget_flag=budget_flag, tp=tp, prefix_caching=prefix_caching), None
    except KVMemoryError as e:
        return reserve, None, e
