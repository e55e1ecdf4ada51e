"""GPU twins of the absorbed-attention passes in `ops.attention`, on flashinfer (CUDA only).

flashinfer lives in the optional `gpu` extra and is imported lazily, only when CUDA is present.
The prefix pass runs on `BatchMLAPagedAttentionWrapper` (no custom mask, so it serves the
non-causal prefix pass only); the tree pass stays `ops.attention.tree_attention` (small, dense,
under the ancestor mask) and the two merge by log-sum-exp, in torch or with
`flashinfer.merge_state`. The torch functions are the reference: tests/test_graphs_cuda.py
compares each twin with them.

Which flashinfer MLA backend (if any) can plan the prefix pass depends on the model's widths,
the dtype and the GPU: `mla_backend` / `mla_unsupported_reason` answer that on the host, from
the rules flashinfer 0.7.4 itself applies, so an unsupported model takes the torch path before
any capture instead of failing inside one.

A prefill's MHA passes (`ops.prefill.MHAPass`) may run on flashinfer's ragged prefill
(`FlashInferRaggedMHA`, DeepSeek's 192 / 128 head widths), where it imports and fits.

Graph use: one `FlashInferMLAPrefix` per captured (batch size, tree nodes) (its metadata
buffers are fixed), held by `engine.attention.flashinfer.FlashInferBackend`; `plan()` is
host-side work on host tensors and runs before every replay, outside the graph; `__call__` is
what the graph captures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ops.prefill import MHAPass, merge_with_lse

LN2 = math.log(2.0)


def flashinfer_unavailable() -> str | None:
    """Why no flashinfer twin can be chosen here, or None when one can: CUDA is present and
    flashinfer imports with every module the twins call (the MLA wrapper and its plan
    metadata, `merge_state`, the sampling kernels).

    NOTE: any exception counts, not only ImportError: a partial install (a wheel without its
    dependencies, a missing shared library, a release before the keyword MLA plan) may import
    the package and then fail in one of its modules with OSError or RuntimeError, and the
    engine must take the Triton kernels then, not crash at its first step."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        import flashinfer  # noqa: F401
        from flashinfer import merge_state, sampling  # noqa: F401
        from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata  # noqa: F401
    except Exception as e:  # noqa: BLE001 - whatever fails, the twins cannot run
        return f"flashinfer does not import ({type(e).__name__}: {e})"
    return None


# ---- which flashinfer MLA backend can plan the prefix pass (pure; tested on the CPU) -------------

# flashinfer 0.7.4's `_AUTO_BACKEND_CANDIDATES` (mla/_batch_mla/_auto_policy.py:109-119), the
# order "auto" falls back through after each architecture's preferences.
AUTO_ORDER = ("fa2", "fa3", "trtllm-gen", "cute-dsl-monolithic", "cute-dsl-modular",
              "cute-dsl-rubin-mtp", "cutlass", "xqa", "cutile")
FA_MAX_WORK_ITEMS = 16384  # scheduler.cuh MLAPlan `max_total_num_works`; _fa_common.py:255
FA_TILE_Q = 64  # scheduler.cuh MLAPlan `cta_tile_q`
MAX_SMS = 160  # sizes the workspace when the SM count is unknown (H200: 132, B200: 148)
# (shared memory per SM, opt-in shared memory per block) in bytes, from the CUDA C++ programming
# guide's compute-capability table; used when the caller gives no measured device properties.
SMEM_BY_SM: dict[tuple[int, int], tuple[int, int]] = {
    (8, 0): (167936, 166912), (8, 6): (102400, 101376), (8, 7): (167936, 166912),
    (8, 9): (102400, 101376), (9, 0): (233472, 232448), (10, 0): (233472, 232448),
    (10, 3): (233472, 232448), (12, 0): (102400, 101376), (12, 1): (102400, 101376),
}
_SM100 = ((10, 0), (10, 3), (10, 7))
# What `FlashInferMLAPrefix.plan` declares to flashinfer; the rules below are read against it.
_CONTRACT = ("CSR host metadata, use_cuda_graph=True, split query and KV views, "
             "lse_mode='basee', causal=False, query, KV and output of one dtype")


@dataclass(frozen=True)
class MLADevice:
    """The device facts flashinfer's MLA planning reads: compute capability, the CUDA version
    torch was built with (None: assume new enough), the SM count (None: skip the work-item and
    workspace checks) and the shared-memory limits (None: from `SMEM_BY_SM`)."""

    sm: tuple[int, int]
    cuda: str | None = None
    num_sms: int | None = None
    smem_per_sm: int | None = None
    smem_per_block: int | None = None

    @classmethod
    def of(cls, device: torch.device | str | int) -> MLADevice:
        """The facts of a CUDA device, from `torch.cuda.get_device_properties`."""
        props = torch.cuda.get_device_properties(device)
        return cls((props.major, props.minor), torch.version.cuda, props.multi_processor_count,
                   getattr(props, "shared_memory_per_multiprocessor", None),
                   getattr(props, "shared_memory_per_block_optin", None))

    @property
    def smem(self) -> tuple[int, int] | None:
        if self.smem_per_sm is not None and self.smem_per_block is not None:
            return self.smem_per_sm, self.smem_per_block
        return SMEM_BY_SM.get(self.sm)


def _as_device(sm: int | tuple[int, int] | MLADevice) -> MLADevice:
    if isinstance(sm, MLADevice):
        return sm
    if isinstance(sm, int):  # 90 -> (9, 0), 100 -> (10, 0), 86 -> (8, 6)
        return MLADevice((sm // 10, sm % 10))
    return MLADevice((int(sm[0]), int(sm[1])))


def _cuda_at_least(cuda: str | None, want: tuple[int, int]) -> bool:
    if cuda is None:
        return True
    try:
        return tuple(int(x) for x in cuda.split(".")[:2]) >= want
    except ValueError:
        return True


def fa_shared_bytes(backend: str, kv_lora_rank: int, rope_dim: int, smem_per_sm: int) -> int:
    """Shared memory one fa2/fa3 MLA block needs (bf16/fp16 KV): flashinfer 0.7.4
    `_generated_fa_shared_bytes` (mla/_batch_mla/_backends/_fa_common.py:221-252). fa2 picks its
    KV tile from the SM's shared memory; below 92672 bytes per SM it has no configuration (-1)."""
    ckv, kpe = kv_lora_rank, rope_dim
    q_bytes = FA_TILE_Q * (ckv + kpe) * 2
    if backend == "fa3":
        stage = FA_TILE_Q * ckv * 2 + max(FA_TILE_Q * kpe * 2, FA_TILE_Q * 64 * 2)
        return q_bytes + max(2 * stage + 32, FA_TILE_Q * ckv * 2) + 3 * FA_TILE_Q * 4 + 64
    if smem_per_sm >= 221696:
        stages, tile_kv = 2, 64
    elif smem_per_sm >= 147968:
        stages, tile_kv = 2, 32
    elif smem_per_sm >= 92672:
        stages, tile_kv = 1, 16
    else:
        return -1
    kv_bytes = stages * tile_kv * (ckv + max(kpe, 64)) * 2
    return max(q_bytes + kv_bytes + 32 + 2 * FA_TILE_Q * 4, FA_TILE_Q * ckv * 2)


def fa_work_items_bound(batch_size: int, num_queries: int, num_heads: int, num_sms: int) -> int:
    """An upper bound on the work items fa2/fa3 plan for `batch_size` requests of `num_queries`
    queries (any context lengths): flashinfer's `_fa_plan_work_count` (_fa_common.py:258-324)
    counts one item per (query tile, KV split); the KV split limit is at least the mean KV per
    cluster, so the splits add at most one item per cluster to the query tiles."""
    packed = num_queries * num_heads
    cluster = 2 if packed > FA_TILE_Q else 1
    tiles = batch_size * -(-packed // (FA_TILE_Q * cluster))
    return tiles + num_sms // cluster


def _fa_workspace_need(kv_lora_rank: int, num_sms: int) -> int:
    """The float workspace bytes flashinfer 0.7.4's preflight requires of the fa2/fa3 MLA
    wrapper (_fa_common.py:909-928): the partial outputs (fp16/bf16) and partial LSEs (fp32)
    of the split-KV merge."""
    # NOTE: scheduler.cuh MLAPlan (flashinfer 0.7.4 data/include/flashinfer/attention/
    # scheduler.cuh:1882-1885) allocates 2 * num_clusters * cluster_tile_q rows of
    # `2 * head_dim_o` bytes (mla_partial_o) and 4 bytes (mla_partial_lse), each 16-aligned;
    # num_clusters * cluster_tile_q <= num_sms * 64 for cluster size 1 or 2.
    return 2 * num_sms * FA_TILE_Q * (2 * kv_lora_rank + 4)


def mla_workspace_bytes(kv_lora_rank: int, num_sms: int) -> int:
    """Float workspace the fa2/fa3 MLA wrapper needs on a GPU with `num_sms` SMs (with room for
    the two 16-byte alignments), rounded up to a MiB. H200 (132 SMs), rank 512: 17.4 MB."""
    need = _fa_workspace_need(kv_lora_rank, num_sms) + 2 * 16
    return -(-need // (1 << 20)) << 20


def _fa_problems(name: str, ckv: int, kpe: int, dtype: torch.dtype, dev: MLADevice, *,
                 num_heads: int | None, num_queries: int | None, batch_size: int | None,
                 workspace_bytes: int | None) -> list[str]:
    """flashinfer 0.7.4 `_validate_generated_fa_plan` (_fa_common.py:102-218), the work-item
    bound (`_validate_fa_plan_workload`, :362-384) and the workspace preflight (:909-928);
    a workload keyword that is None skips the check that reads it."""
    out = []
    if dtype not in (torch.float16, torch.bfloat16):
        out.append(f"needs fp16/bf16 queries and KV, got {dtype}")
    dims_ok = ckv % 128 == 0 and kpe % 64 == 0
    if not dims_ok:
        out.append("needs kv_lora_rank % 128 == 0 and qk_rope_head_dim % 64 == 0, "
                   f"got {ckv}/{kpe}")
    if name == "fa3":
        if dev.sm[0] != 9 or not _cuda_at_least(dev.cuda, (12, 3)):
            out.append(f"needs SM90 and CUDA >= 12.3, got SM{dev.sm[0]}{dev.sm[1]}"
                       + (f" with CUDA {dev.cuda}" if dev.cuda else ""))
        if ckv not in (128, 256, 512):
            out.append(f"needs kv_lora_rank in (128, 256, 512), got {ckv}")
    elif dev.sm[0] < 8:
        out.append(f"needs SM80 or newer, got SM{dev.sm[0]}{dev.sm[1]}")
    smem = dev.smem
    if dims_ok and smem is not None:
        need = fa_shared_bytes(name, ckv, kpe, smem[0])
        if need < 0:
            out.append(f"needs >= 92672 shared-memory bytes per SM, the GPU has {smem[0]}")
        elif need > smem[1]:
            out.append(f"needs {need} shared-memory bytes per block for {ckv}/{kpe}, "
                       f"the GPU allows {smem[1]}")
    if dev.num_sms is not None and batch_size and num_queries and num_heads:
        items = fa_work_items_bound(batch_size, num_queries, num_heads, dev.num_sms)
        if items > FA_MAX_WORK_ITEMS:
            out.append(f"plans up to {items} work items for {batch_size} x "
                       f"{num_queries} queries x {num_heads} heads; the kernel "
                       f"holds {FA_MAX_WORK_ITEMS}")
    if dev.num_sms is not None and workspace_bytes is not None:
        need = _fa_workspace_need(ckv, dev.num_sms)
        if workspace_bytes < need:
            out.append(f"needs {need} float workspace bytes, got {workspace_bytes}")
    return out


PACKED_ONLY = "needs a packed query and dense device metadata under CUDA graphs"
NO_LSE = "returns no LSE"


def _other_problems(name: str, ckv: int, kpe: int, dtype: torch.dtype, dev: MLADevice,
                    num_queries: int | None) -> list[str]:
    """The non-FA backends, against `_CONTRACT`: each is ruled out by the contract itself, and
    the architecture and width rules say why it could not serve this model even otherwise."""
    sm = f"SM{dev.sm[0]}{dev.sm[1]}"
    out = []
    if name == "trtllm-gen":  # trtllm_gen_backend.py:113-124, 179, 203-268, 963-988
        if dev.sm not in _SM100:
            out.append(f"needs SM100/SM103/SM107, got {sm}")
        out.append(PACKED_ONLY)
        if num_queries is None or num_queries > 1:
            out.append("takes several queries per request only with causal=True")
        if dtype != torch.bfloat16:
            out.append(f"needs bf16 (or fp8 in, bf16 out), got {dtype}")
        if (ckv, kpe) not in ((512, 64), (256, 64)):
            out.append(f"needs widths 512/64 or 256/64, got {ckv}/{kpe}")
    elif name.startswith("cute-dsl"):  # _cute_dsl_common.py:59-124, 456; *_backend.py caps
        need = ((10, 7),) if name == "cute-dsl-rubin-mtp" else _SM100
        if dev.sm not in need:
            out.append("needs " + ("SM107" if len(need) == 1 else "SM100/SM103/SM107")
                       + f", got {sm}")
        out.append(PACKED_ONLY)
        if name == "cute-dsl-modular":
            out.append(NO_LSE)
        if dtype not in (torch.float16, torch.bfloat16, torch.float8_e4m3fn):
            out.append(f"needs fp16/bf16/fp8, got {dtype}")
    elif name == "cutlass":  # cutlass_backend.py:158-199, caps :208-216
        if dev.sm[0] not in (10, 11):
            out.append(f"needs SM10x/SM11x, got {sm}")
        out += [NO_LSE, PACKED_ONLY]
        if (ckv, kpe) != (512, 64):
            out.append(f"needs widths 512/64, got {ckv}/{kpe}")
    elif name == "xqa":  # xqa_backend.py:63-140, caps :184-193
        if dev.sm[0] != 12:
            out.append(f"needs SM12x, got {sm}")
        out += [NO_LSE, PACKED_ONLY]
    elif name == "cutile":  # cutile_backend.py:222-231
        out += ["experimental (FLASHINFER_ALLOW_EXPERIMENTAL_AUTO_BACKENDS=1)", NO_LSE]
    else:
        out.append(f"not a flashinfer 0.7.4 MLA backend: {name!r}")
    return out


def auto_order(dev: MLADevice) -> tuple[str, ...]:
    """The candidates flashinfer 0.7.4's "auto" tries, in order, on this device
    (`_BatchMLAPagedAttentionAutoBackend.plan_from_wrapper`, _auto_policy.py:58-104). SM100's
    order depends on the workload (`ordered_sm100_backends`, :138-264); one of its outcomes is
    used here, which changes nothing: under `_CONTRACT` only fa2/fa3 can plan."""
    def prefer(*names: str) -> tuple[str, ...]:
        return names + tuple(b for b in AUTO_ORDER if b not in names)

    if dev.sm == (8, 0):
        return prefer("fa2")
    if dev.sm[0] == 9 and _cuda_at_least(dev.cuda, (12, 3)):
        return prefer("fa3", "fa2")
    if dev.sm in _SM100:
        return prefer("cute-dsl-monolithic", "trtllm-gen")
    if dev.sm[0] == 12:
        return prefer("fa2", "xqa", "cutile")
    return AUTO_ORDER


def mla_backend_rejections(kv_lora_rank: int, rope_dim: int, dtype: torch.dtype,
                           sm: int | tuple[int, int] | MLADevice, *, backend: str = "auto",
                           num_heads: int | None = None, num_queries: int | None = None,
                           batch_size: int | None = None, workspace_bytes: int | None = None
                           ) -> dict[str, list[str]]:
    """Every backend flashinfer 0.7.4 would try for the prefix pass (in its order; just
    `backend` when one is named), each with the constraints it fails (empty: it plans).

    `sm` is a compute capability (`90`, `(9, 0)`) or an `MLADevice` (its SM count and shared
    memory add the work-item and workspace checks). `num_heads`, `num_queries`, `batch_size`
    and `workspace_bytes` add the checks that depend on them; None skips those.

    Read from flashinfer-python 0.7.4 (0.7.2.post1 has the same rules, without the
    workspace preflight and the SM107 backend), `flashinfer/mla/_batch_mla/`:
    - `_backends/_fa_common.py:102-218` `_validate_generated_fa_plan`: q dtype fp16/bf16
      (:138-141), non-FP8 KV dtype equal to q (:175-179), output dtype equal to q (:148-152),
      `head_dim_ckv % 128 == 0 and head_dim_kpe % 64 == 0` (:185-189); fa3: `is_sm90a_supported`
      (major 9 and CUDA >= 12.3, flashinfer/utils.py:720-722) and ckv in (128, 256, 512)
      (:191-201); fa2: SM80+ (:202-205); shared memory per block (:206-218, sizes :221-252);
      work items <= 16384 (:255-324, :362-384); float workspace (:909-928, 0.7.4 only).
    - `_backends/trtllm_gen_backend.py`: SM100/103/107 only (:225-230), bf16/fp8 (:244-252),
      widths (512, 64)/(256, 64) (:41, :257-263), packed query and KV (:123-124), dense device
      metadata under graphs (:179), no non-causal multi-query (:977-978).
    - `_backends/_cute_dsl_common.py:59-124` (SM100/103/107, fp16/bf16/fp8), :456 (dense
      device metadata), monolithic/modular/rubin-mtp capabilities (packed; modular has no LSE;
      rubin-mtp SM107 only, cute_dsl_rubin_mtp_backend.py:48-50).
    - `_backends/cutlass_backend.py:158-199` (512/64, SM10x/11x), :208-216 (no LSE, packed);
      `_backends/xqa_backend.py:63-75` (SM12x), :184-193 (no LSE, packed);
      `_backends/cutile_backend.py:222-231` (experimental, no LSE).
    - `_backends/_capabilities.py:63-128`: the LSE mode and the packed-input requirement are
      checked against the plan before anything else; `_auto_policy.py:58-104` tries the
      candidates in order and takes the first that plans.
    The bundled model (64/16) and float32 fail every backend; Kimi (512/64, bf16) plans fa3 on
    SM90 and fa2 on SM80, SM100 and SM12x.
    """
    dev = _as_device(sm)
    names = auto_order(dev) if backend == "auto" else (backend,)
    out = {}
    for name in names:
        if name in ("fa2", "fa3"):
            out[name] = _fa_problems(name, kv_lora_rank, rope_dim, dtype, dev,
                                     num_heads=num_heads, num_queries=num_queries,
                                     batch_size=batch_size, workspace_bytes=workspace_bytes)
        else:
            out[name] = _other_problems(name, kv_lora_rank, rope_dim, dtype, dev, num_queries)
    return out


def mla_backend(kv_lora_rank: int, rope_dim: int, dtype: torch.dtype,
                sm: int | tuple[int, int] | MLADevice, **kw: Any) -> str | None:
    """The backend flashinfer 0.7.4 plans the prefix pass on (`backend="auto"`: the first that
    passes, as its auto policy does), or None when none can; `mla_unsupported_reason` says why.
    Keywords as `mla_backend_rejections`."""
    for name, problems in mla_backend_rejections(kv_lora_rank, rope_dim, dtype, sm,
                                                 **kw).items():
        if not problems:
            return name
    return None


def mla_unsupported_reason(kv_lora_rank: int, rope_dim: int, dtype: torch.dtype,
                           sm: int | tuple[int, int] | MLADevice, **kw: Any) -> str | None:
    """None when `mla_backend` finds a backend; else one line naming every candidate's failed
    constraints (what a log or an error shows)."""
    rejected = mla_backend_rejections(kv_lora_rank, rope_dim, dtype, sm, **kw)
    if any(not p for p in rejected.values()):
        return None
    dev = _as_device(sm)
    return (f"no flashinfer MLA backend for kv_lora_rank {kv_lora_rank}, rope {rope_dim}, "
            f"{dtype} on SM{dev.sm[0]}{dev.sm[1]} ({_CONTRACT}): "
            + "; ".join(f"{name}: {', '.join(p)}" for name, p in rejected.items()))


class MLAUnsupportedError(ValueError):
    """No flashinfer MLA backend can plan this model on this GPU: take the torch prefix pass."""


# ---- the prefix kernel ---------------------------------------------------------------------------


class FlashInferMLAPrefix:
    """`ops.attention.prefix_attention` on flashinfer's paged MLA kernel, for `bs` requests of
    `num_queries` queries each over a paged latent cache `[num_slots, R + P]` (one layer; every
    layer reuses the same plan).

    The backend is chosen here, before any capture, by `mla_backend` from the device's facts
    (`device_facts`, read from the device when None); `MLAUnsupportedError` names the failed
    constraints when there is none. `workspace` may be shared between the instances of one
    stream (the kernels use it as scratch only while they run; plan() does not write it).

    Zero-length rows (padding) are planned with one token of the dummy page, so the kernel
    never sees an empty row; their output is zeroed and their LSE set to -inf afterwards, which
    is what the torch twin returns for them.
    """

    def __init__(self, bs: int, num_queries: int, max_pages: int, page_size: int,
                 num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float,
                 dtype: torch.dtype, device: torch.device | str = "cuda", backend: str = "auto",
                 workspace: Tensor | None = None, device_facts: MLADevice | None = None):
        import flashinfer  # lazy: the optional `gpu` extra

        try:
            from flashinfer.mla import MLAPlanMetadata
        except ImportError as e:  # the keyword plan()/run() forms came with 0.7.2
            raise ImportError(f"flashinfer {getattr(flashinfer, '__version__', '?')} has no "
                              "flashinfer.mla.MLAPlanMetadata; install flashinfer-python>=0.7.2"
                              ) from e
        self._metadata = MLAPlanMetadata
        dev = torch.device(device)
        facts = device_facts if device_facts is not None else MLADevice.of(dev)
        self.bs, self.num_queries, self.page_size = bs, num_queries, page_size
        self.num_heads, self.kv_lora_rank, self.rope_dim = num_heads, kv_lora_rank, rope_dim
        self.scale, self.dtype, self.max_pages = float(scale), dtype, max_pages
        if workspace is not None:
            nbytes = workspace.numel() * workspace.element_size()
        else:
            nbytes = mla_workspace_bytes(kv_lora_rank, facts.num_sms or MAX_SMS)
        check: dict[str, Any] = dict(backend=backend, num_heads=num_heads,
                                     num_queries=num_queries, batch_size=bs,
                                     workspace_bytes=nbytes)
        chosen = mla_backend(kv_lora_rank, rope_dim, dtype, facts, **check)
        if chosen is None:
            raise MLAUnsupportedError(
                mla_unsupported_reason(kv_lora_rank, rope_dim, dtype, facts, **check))
        self.backend = chosen
        self.workspace = (workspace if workspace is not None
                          else torch.empty(nbytes, dtype=torch.uint8, device=dev))
        i32 = dict(dtype=torch.int32, device=dev)
        # NOTE: fixed buffers: the captured kernels read the metadata from these addresses, and
        # every plan() rewrites them in place.
        self.qo_indptr = torch.arange(bs + 1, **i32) * num_queries
        self._qo_indptr_host = torch.arange(bs + 1, dtype=torch.int32) * num_queries
        self.kv_indptr = torch.zeros(bs + 1, **i32)
        self.kv_indices = torch.zeros(bs * max_pages, **i32)
        self.kv_len = torch.zeros(bs, **i32)
        self.wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
            float_workspace_buffer=self.workspace, use_cuda_graph=True,
            qo_indptr=self.qo_indptr, kv_indptr=self.kv_indptr, kv_indices=self.kv_indices,
            kv_len_arr=self.kv_len, backend=chosen)

    def plan(self, page_table: Tensor, cache_len: Tensor) -> None:
        """Host side, outside any graph: the host copies of `page_table [bs, W]` and
        `cache_len [bs]`. Everything handed to flashinfer is a host int32 tensor, so planning
        reads no device memory (flashinfer copies the metadata into the fixed device buffers)."""
        if page_table.device.type != "cpu" or cache_len.device.type != "cpu":
            raise ValueError("FlashInferMLAPrefix.plan wants the host copies of the page table "
                             f"and context lengths, got {page_table.device} and "
                             f"{cache_len.device} (a device tensor costs a sync per step)")
        pt = page_table.detach().to(torch.int64)
        n = cache_len.detach().to(torch.int64).clamp(min=1)
        ps = self.page_size
        pages = (n + ps - 1) // ps
        if int(pages.max()) > pt.shape[1]:
            raise ValueError(f"a context of {int(n.max())} tokens needs {int(pages.max())} "
                             f"pages; the page table has {pt.shape[1]}")
        kv_indptr = torch.zeros(self.bs + 1, dtype=torch.int32)
        kv_indptr[1:] = pages.cumsum(0).to(torch.int32)
        cols = torch.arange(pt.shape[1])[None, :] < pages[:, None]
        indices = pt[cols].to(torch.int32).contiguous()  # row-major: each request's pages
        self.wrapper.plan(
            metadata=self._metadata.csr(qo_indptr=self._qo_indptr_host, kv_indptr=kv_indptr,
                                        kv_indices=indices, kv_len_arr=n.to(torch.int32)),
            num_heads=int(self.num_heads), head_dim_ckv=int(self.kv_lora_rank),
            head_dim_kpe=int(self.rope_dim), page_size=int(ps), causal=False,
            sm_scale=self.scale, q_data_type=self.dtype, kv_data_type=self.dtype,
            query_layout="split", kv_cache_layout="split", lse_mode="basee")

    def __call__(self, q_lat: Tensor, q_pe: Tensor, kv_cache: Tensor, ctx_len: Tensor
                 ) -> tuple[Tensor, Tensor]:
        """`q_lat [bs, Q, H, R]`, `q_pe [bs, Q, H, P]`, `kv_cache [num_slots, R + P]`,
        `ctx_len [bs]` -> latent output `[bs, Q, H, R]` (fp32) and natural-log LSE `[bs, Q, H]`,
        like the torch twin."""
        bs, Q, H, R = q_lat.shape
        P = q_pe.shape[-1]
        pages = kv_cache.view(-1, self.page_size, R + P)
        ckv, kpe = pages[..., :R], pages[..., R:]  # strided views: the kernel takes strides
        qn = q_lat.reshape(bs * Q, H, R).to(self.dtype).contiguous()
        qp = q_pe.reshape(bs * Q, H, P).to(self.dtype).contiguous()
        o, lse = self.wrapper.run(query=(qn, qp), kv_cache=(ckv, kpe), return_lse=True,
                                  return_lse_base_on_e=True)
        o = o.view(bs, Q, H, R).float()
        lse = lse.view(bs, Q, H)
        has = (ctx_len > 0)[:, None, None]
        return (torch.where(has[..., None], o, 0.0),
                torch.where(has, lse, float("-inf")))


def merge_states_flashinfer(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor) -> Tensor:
    """`ops.attention.merge_states` on `flashinfer.merge_state`: outputs `[..., H, D]`,
    natural-log LSEs `[..., H]`."""
    from flashinfer import merge_state

    H, D = o1.shape[-2:]
    lead = o1.shape[:-2]
    v, _ = merge_state(o1.reshape(-1, H, D).contiguous(),
                       (lse1 / LN2).reshape(-1, H).float().contiguous(),
                       o2.reshape(-1, H, D).to(o1.dtype).contiguous(),
                       (lse2 / LN2).reshape(-1, H).float().contiguous())
    return v.view(*lead, H, D)



# ---- the prefill's MHA pass on flashinfer's ragged prefill --------------------------------------

# (qk, vo) head widths flashinfer's ragged prefill compiles: DeepSeek's (192, 128) and the
# common equal widths.
RAGGED_HEAD_DIMS = ((192, 128), (64, 64), (128, 128), (256, 256))
RAGGED_WORKSPACE_BYTES = 128 << 20  # the float workspace, as flashinfer's examples size it
RAGGED_PLANS = 4  # planned wrappers kept: a chunk's own square, full and last prefix chunks


def ragged_prefill_unavailable(qk_dim: int, v_dim: int, dtype: torch.dtype) -> str | None:
    """Why `FlashInferRaggedMHA` cannot run a model of these head widths and dtype, or None."""
    if dtype not in (torch.bfloat16, torch.float16):
        return f"flashinfer's ragged prefill runs 16-bit inputs, not {dtype}"
    if (qk_dim, v_dim) not in RAGGED_HEAD_DIMS:
        return f"flashinfer's ragged prefill has no ({qk_dim}, {v_dim}) head widths"
    try:
        from flashinfer import BatchPrefillWithRaggedKVCacheWrapper  # noqa: F401
    except Exception as e:  # noqa: BLE001 - whatever fails, the Triton pass runs instead
        return f"flashinfer's ragged prefill does not import ({type(e).__name__}: {e})"
    return None


class FlashInferRaggedMHA(MHAPass):
    """One MHA prefill pass (`ops.prefill.MHAPass`) on flashinfer's
    `BatchPrefillWithRaggedKVCacheWrapper`, as SGLang prefills DeepSeek models: every batch row
    is one ragged segment of `T` queries over `N` keys (causal for the chunk's own square), the
    shared roped key part broadcast to every head and concatenated to the nope part (one
    bounded chunk of keys at a time), flashinfer's base-2 LSE turned natural, and a previous
    pass merged by `ops.prefill.merge_with_lse`. Plans are host work (the lengths are shapes)
    and kept for the last few shapes, so a chunk's layers after the first reuse them. Eager
    only (a prefill is never captured). Not run by this project's tests (no GPU): chosen only
    where `ragged_prefill_unavailable` says it can run."""

    def __init__(self, device: torch.device | str = "cuda",
                 workspace_bytes: int = RAGGED_WORKSPACE_BYTES):
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self.plans: dict[tuple[Any, ...], Any] = {}

    def _wrapper(self, B: int, T: int, N: int, H: int, qk: int, vo: int, dtype: torch.dtype,
                 causal: bool, scale: float) -> Any:
        key = (B, T, N, H, qk, vo, dtype, causal, scale)
        w = self.plans.pop(key, None)
        if w is None:
            from flashinfer import BatchPrefillWithRaggedKVCacheWrapper

            # NOTE: one float workspace for every wrapper: they run one at a time on one stream
            w = BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD")
            w.plan(torch.arange(B + 1, dtype=torch.int32) * T,
                   torch.arange(B + 1, dtype=torch.int32) * N, H, H, qk, head_dim_vo=vo,
                   causal=causal, sm_scale=scale, q_data_type=dtype, kv_data_type=dtype)
            while len(self.plans) >= RAGGED_PLANS:
                self.plans.pop(next(iter(self.plans)))
        self.plans[key] = w  # most recently used last
        return w

    def __call__(self, q: Tensor, k_nope: Tensor, k_pe: Tensor, v: Tensor, scale: float,
                 causal: bool, prev_o: Tensor | None = None, prev_lse: Tensor | None = None
                 ) -> tuple[Tensor, Tensor]:
        B, T, H, qk = q.shape
        N, vo = k_nope.shape[1], v.shape[-1]
        k = torch.cat([k_nope, k_pe[:, :, None, :].expand(B, N, H, k_pe.shape[-1])], dim=-1)
        w = self._wrapper(B, T, N, H, qk, vo, q.dtype, causal, float(scale))
        o, lse = w.run(q.reshape(B * T, H, qk).contiguous(), k.reshape(B * N, H, qk),
                       v.reshape(B * N, H, vo).contiguous(), return_lse=True)
        o, lse = o.view(B, T, H, vo).float(), lse.view(B, T, H).float() * LN2
        if prev_o is not None and prev_lse is not None:
            return merge_with_lse(prev_o, prev_lse, o, lse)
        return o, lse
