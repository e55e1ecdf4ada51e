"""GPU twins of the absorbed-attention passes in `ops.attention`, on flashinfer (CUDA only).

flashinfer lives in the optional `gpu` extra and is imported lazily, only when CUDA is present.
The prefix pass runs on `BatchMLAPagedAttentionWrapper` (no custom mask, so it serves the
non-causal prefix pass only); the tree pass stays `ops.attention.tree_attention` (small, dense,
under the ancestor mask) and the two merge by log-sum-exp, in torch or with
`flashinfer.merge_state`. The torch functions are the reference: tests/test_graphs_cuda.py
compares each twin with them.

Graph use: one `FlashInferMLAPrefix` per captured batch size (its metadata buffers are fixed);
`plan()` is host-side work and runs before every replay, outside the graph; `__call__` is what
the graph captures.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

LN2 = math.log(2.0)


def flashinfer_available() -> bool:
    """CUDA is present and flashinfer imports (only then is any GPU twin chosen)."""
    if not torch.cuda.is_available():
        return False
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


class FlashInferMLAPrefix:
    """`ops.attention.prefix_attention` on flashinfer's paged MLA kernel, for `bs` requests of
    `num_queries` queries each over a paged latent cache `[num_slots, R + P]` (one layer; every
    layer reuses the same plan).

    Zero-length rows (padding) are planned with one token of the dummy page, so the kernel
    never sees an empty row; their output is zeroed and their LSE set to -inf afterwards, which
    is what the torch twin returns for them.
    """

    def __init__(self, bs: int, num_queries: int, max_pages: int, page_size: int,
                 num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float,
                 dtype: torch.dtype, device: torch.device | str = "cuda",
                 workspace_bytes: int = 128 << 20, backend: str = "auto"):
        import flashinfer  # lazy: the optional `gpu` extra

        dev = torch.device(device)
        self.bs, self.num_queries, self.page_size = bs, num_queries, page_size
        self.num_heads, self.kv_lora_rank, self.rope_dim = num_heads, kv_lora_rank, rope_dim
        self.scale, self.dtype, self.max_pages = scale, dtype, max_pages
        i32 = dict(dtype=torch.int32, device=dev)
        # NOTE: fixed buffers: the captured kernels read the metadata from these addresses, and
        # every plan() rewrites them in place.
        self.qo_indptr = torch.arange(bs + 1, **i32) * num_queries
        self._qo_indptr_host = torch.arange(bs + 1, dtype=torch.int32) * num_queries
        self.kv_indptr = torch.zeros(bs + 1, **i32)
        self.kv_indices = torch.zeros(bs * max_pages, **i32)
        self.kv_len = torch.zeros(bs, **i32)
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=dev)
        self.wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
            self.workspace, use_cuda_graph=True, qo_indptr=self.qo_indptr,
            kv_indptr=self.kv_indptr, kv_indices=self.kv_indices, kv_len_arr=self.kv_len,
            backend=backend)

    def plan(self, page_table: Tensor, cache_len: Tensor) -> None:
        """Host side, outside any graph: `page_table [bs, W]` and `cache_len [bs]` (read on the
        host; pass CPU tensors to avoid a device sync)."""
        pt = page_table.detach().to("cpu", torch.int64)
        n = cache_len.detach().to("cpu", torch.int64).clamp(min=1)
        ps = self.page_size
        pages = (n + ps - 1) // ps
        if int(pages.max()) > pt.shape[1]:
            raise ValueError(f"a context of {int(n.max())} tokens needs {int(pages.max())} "
                             f"pages; the page table has {pt.shape[1]}")
        kv_indptr = torch.zeros(self.bs + 1, dtype=torch.int32)
        kv_indptr[1:] = pages.cumsum(0).to(torch.int32)
        cols = torch.arange(pt.shape[1])[None, :] < pages[:, None]
        indices = pt[cols].to(torch.int32)  # row-major: each request's pages in order
        self.wrapper.plan(
            self._qo_indptr_host, kv_indptr, indices, n.to(torch.int32), self.num_heads,
            self.kv_lora_rank, self.rope_dim, ps, False, self.scale, self.dtype, self.dtype)

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
        o, lse = self.wrapper.run(qn, qp, ckv, kpe, return_lse=True)
        o = o.view(bs, Q, H, R).float()
        lse = lse.view(bs, Q, H) * LN2  # flashinfer's LSE is base 2
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


def prefix_planner(backends: dict[int, FlashInferMLAPrefix]):
    """A step runner's planner: before each step (and each capture), plan the backend of the
    step's batch size from the host copies of the page table `[bs, W]` and context lengths
    `[bs]` the step is about to read."""

    def plan(page_table: Tensor, cache_len: Tensor) -> None:
        backends[page_table.shape[0]].plan(page_table, cache_len)

    return plan
