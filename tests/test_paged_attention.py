"""Paged attention: the Triton kernels (`ops.attention_triton`) against their torch twins
(`ops.paged`), and the twins against the existing gather path (`ops.attention.prefix_attention`
over `engine.spec.slot_of` slots) and the drafter's attention (`DraftAttention.forward`).

Without CUDA the kernels run under Triton's interpreter on CPU tensors whatever
`TRITON_INTERPRET` says (`ops.triton_util.kernel_for`; they call no `@jit` function of
`triton.language.standard`, which `import triton` decorates), so nothing sets it: the kernels
stay compiled-mode functions that the sm_90a compile below takes as they are, in this process.
With CUDA the `cuda` cases run the compiled kernels.

Tolerances: fp32 caches `rtol=1e-5, atol=2e-5` (different summation order only); bf16 caches
(bf16 dot inputs and bf16 probabilities in the kernel, fp32 math in the twin) `rtol=atol=1e-2`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine.kv_cache import pages_needed
from engine.models.dflash import DraftAttention, DraftConfig
from engine.spec import slot_of
from ops import paged
from ops.attention import prefix_attention
from ops.rope import apply_rope_half, rope_cos_sin, rope_frequencies
from tests.fakeguard import run_on_fake

try:
    import triton  # noqa: F401

    from ops import attention_triton as at
except ImportError:  # triton is in the optional `gpu` extra
    at = None

ROOT = Path(__file__).resolve().parents[1]
needs_triton = pytest.mark.skipif(at is None, reason="triton is not installed")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
FP32 = dict(rtol=1e-5, atol=2e-5)
BF16 = dict(rtol=1e-2, atol=1e-2)
# ragged rows: padding (0), mid-page, exactly the full table, exactly at a page boundary,
# one past a boundary, a single token
RAGGED = [0, 5, 24, 8, 9, 1]
PS, W = 4, 6


def _paged_case(ctx: list[int], width: int, page_size: int, table_width: int,
                dtype: torch.dtype = torch.float32, seed: int = 0,
                index_dtype: torch.dtype = torch.int64):
    """A cache `[num_slots, width]` with shuffled, non-contiguous pages per row (dummy page 0
    past each row's live pages), the page table `[bs, W]` and `ctx_len [bs]`. The cache holds
    only the live pages and 3 unused ones, so a table may be far wider than the cache."""
    g = torch.Generator().manual_seed(seed)
    bs = len(ctx)
    num_pages = 1 + sum(pages_needed(n, page_size) for n in ctx) + 3
    cache = torch.randn(num_pages * page_size, width, generator=g).to(dtype)
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    table = torch.zeros(bs, table_width, dtype=torch.int64)
    for b, n in enumerate(ctx):
        live = pages_needed(n, page_size)
        table[b, :live] = torch.tensor(perm[:live], dtype=torch.int64)
        perm = perm[live:]
    return cache, table.to(index_dtype), torch.tensor(ctx, dtype=index_dtype)


def _mla_queries(bs: int, nq: int, nh: int, R: int, P: int, dtype: torch.dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(bs, nq, nh, R, generator=g).to(dtype),
            torch.randn(bs, nq, nh, P, generator=g).to(dtype))


def _to(device: str, *ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(device) for t in ts]


def _poisoned(cache: torch.Tensor, table: torch.Tensor, ctx: torch.Tensor, page_size: int
              ) -> torch.Tensor:
    """`cache` with NaN in every slot no row may read (the dummy page, tails of partial
    pages, unused pages)."""
    out = torch.full_like(cache, float("nan"))
    slots = paged.table_slots(table, page_size)
    for b in range(table.shape[0]):
        s = slots[b, : int(ctx[b])]
        out[s] = cache[s]
    return out


# --- the twins against the existing paths ----------------------------------------------------


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("nq", [1, 2, 65])
def test_mla_twin_equals_gather_path(nq, index_dtype):
    R, P, H = 64, 16, 4
    cache, table, ctx = _paged_case(RAGGED, R + P, PS, W, index_dtype=index_dtype)
    q_lat, q_pe = _mla_queries(len(RAGGED), nq, H, R, P, torch.float32)
    o, lse = paged.mla_prefix_attention(q_lat, q_pe, cache, table, ctx, PS, 0.1)
    pos = torch.arange(W * PS)[None, :].expand(len(RAGGED), -1)
    slots = slot_of(table.long(), pos, PS)
    o_ref, lse_ref = prefix_attention(q_lat, q_pe, cache, slots, ctx.long(), R, 0.1)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse_ref, rtol=0, atol=0)
    assert (o[0] == 0).all() and (lse[0] == float("-inf")).all()


def _draft_attention_module(nh: int, kvh: int, hd: int, seed: int = 3) -> DraftAttention:
    c = DraftConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=nh,
                    num_key_value_heads=kvh, head_dim=hd, intermediate_size=32, block_size=4,
                    target_layer_ids=(0,), mask_token_id=0)
    torch.manual_seed(seed)
    attn = DraftAttention(c)
    for p in attn.parameters():
        p.data.normal_(0, 0.3)
    return attn.eval()


@pytest.mark.parametrize("context", ["twin", pytest.param("kernel", marks=needs_triton)])
@pytest.mark.parametrize("rows", [None, (1, 4)], ids=["all_rows", "rows_1_4"])
def test_draft_paged_plus_block_equals_drafter_attention(context, rows):
    """Paged context pass + in-block pass merged by LSE == `DraftAttention.forward`
    (scaled_dot_product_attention over `[ctx ; block]` with the context validity mask)."""
    nh, kvh, hd, B = 4, 2, 16, 4
    attn = _draft_attention_module(nh, kvh, hd)
    c = attn.c
    cache, table, ctx = _paged_case(RAGGED, c.kv_dim, PS, W, seed=5)
    bs = len(RAGGED)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(bs, B, c.hidden_size, generator=g)
    inv_freq, amp = rope_frequencies(hd, 10000.0, None, 4096)
    cos, sin = rope_cos_sin(ctx[:, None] + torch.arange(B), inv_freq.float(), amp)
    slots = paged.table_slots(table, PS)
    ctx_valid = torch.arange(W * PS)[None, :] < ctx[:, None]
    with torch.no_grad():
        ref = attn(x, cos, sin, cache[slots], ctx_valid, rows)
        a, b = rows or (0, B)
        q = attn.q_norm(attn.q_proj(x[:, a:b]).view(bs, b - a, nh, hd))
        q = apply_rope_half(q, cos[:, a:b], sin[:, a:b])
        fn = paged.draft_context_attention if context == "twin" else at.draft_context_attention
        o = paged.draft_attention(q, attn.kv(x, cos, sin), cache, table, ctx, PS, hd ** -0.5,
                                  context=fn)
        got = attn.o_proj(o.reshape(bs, b - a, nh * hd))
    torch.testing.assert_close(got, ref, **FP32)


def test_twins_run_on_fake_tensors():
    """No host sync, no data-dependent shape: the twins run under `FakeTensorMode()`."""
    R, P, H, nq = 64, 16, 4, 3
    cache, table, ctx = _paged_case(RAGGED, R + P, PS, W)
    q_lat, q_pe = _mla_queries(len(RAGGED), nq, H, R, P, torch.float32)
    o, lse = run_on_fake(paged.mla_prefix_attention, q_lat, q_pe, cache, table, ctx, PS, 0.1)
    assert o.shape == (len(RAGGED), nq, H, R) and lse.shape == (len(RAGGED), nq, H)
    assert o.dtype == lse.dtype == torch.float32
    nh, kvh, hd, M = 8, 2, 16, 4
    dcache, dtable, dctx = _paged_case(RAGGED, 2 * kvh * hd, PS, W)
    q = torch.randn(len(RAGGED), M, nh, hd)
    block_kv = torch.randn(len(RAGGED), M, 2 * kvh * hd)
    o, lse = run_on_fake(paged.draft_context_attention, q, dcache, dtable, dctx, PS, 0.25)
    assert o.shape == q.shape and lse.shape == (len(RAGGED), M, nh)
    o = run_on_fake(paged.draft_attention, q, block_kv, dcache, dtable, dctx, PS, 0.25)
    assert o.shape == q.shape and o.dtype == torch.float32


def test_pages_needed_and_splits():
    assert [pages_needed(n, 4) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
    if at is None:
        return
    for bs, progs, cap, bn, want in [(1, 1, 4096, 32, None), (64, 8, 4096, 32, None),
                                     (1, 1, 24, 64, None), (2, 3, 1000, 32, 5)]:
        S = at.kv_splits(bs, progs, cap, bn, want)
        assert 1 <= S <= min(at.MAX_SPLITS, -(-cap // bn))
    assert at.kv_splits(1, 1, 4096, 32) == at.MAX_SPLITS
    assert at.kv_splits(64, 8, 4096, 32) == 1  # a big batch needs no split
    assert at.kv_splits(1, 1, 1 << 18, 32, split_bytes=at.MAX_PARTIAL_BYTES // 4) == 4
    for S in (1, 3, 64):
        for n in (0, 1, 31, 32, 33, 100, 4096, 262144):
            chunk = at.split_chunk(n, S, 32)
            assert chunk % 32 == 0 and chunk >= 32 and -(-n // chunk) <= S
            assert S * chunk >= n and (chunk == 32 or S * (chunk - 32) < n)


# --- the MLA prefix kernel --------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 3, None], ids=["one_split", "three_splits", "auto"])
@pytest.mark.parametrize("nq", [1, 2, 65])
def test_mla_kernel_equals_twin(device, nq, num_splits):
    R, P, H = 64, 16, 4
    index_dtype = torch.int32 if nq == 2 else torch.int64
    cache, table, ctx = _paged_case(RAGGED, R + P, PS, W, index_dtype=index_dtype)
    q_lat, q_pe = _mla_queries(len(RAGGED), nq, H, R, P, torch.float32)
    q_lat, q_pe, cache, table, ctx = _to(device, q_lat, q_pe, cache, table, ctx)
    o_ref, lse_ref = paged.mla_prefix_attention(q_lat, q_pe, cache, table, ctx, PS, 0.1)
    o, lse = at.mla_prefix_attention(q_lat, q_pe, cache, table, ctx, PS, 0.1,
                                     num_splits=num_splits, block_n=16)
    torch.testing.assert_close(o, o_ref, **FP32)
    torch.testing.assert_close(lse, lse_ref, **FP32)


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_mla_kernel_odd_widths(device):
    """Latent and rope widths that are not powers of two (nor multiples of 16), odd heads,
    page size 3 (pages straddle every key tile), a row ending mid-page."""
    R, P, H, nq, ps = 40, 8, 3, 5, 3
    cache, table, ctx = _paged_case([7, 0, 12, 3], R + P, ps, 5, seed=4)
    q_lat, q_pe = _mla_queries(4, nq, H, R, P, torch.float32)
    q_lat, q_pe, cache, table, ctx = _to(device, q_lat, q_pe, cache, table, ctx)
    o_ref, lse_ref = paged.mla_prefix_attention(q_lat, q_pe, cache, table, ctx, ps, 0.2)
    o, lse = at.mla_prefix_attention(q_lat, q_pe, cache, table, ctx, ps, 0.2, num_splits=2,
                                     block_n=16)
    torch.testing.assert_close(o, o_ref, **FP32)
    torch.testing.assert_close(lse, lse_ref, **FP32)


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_mla_kernel_bf16_cache(device):
    R, P, H, nq = 64, 16, 4, 2
    cache, table, ctx = _paged_case(RAGGED, R + P, PS, W, dtype=torch.bfloat16)
    q_lat, q_pe = _mla_queries(len(RAGGED), nq, H, R, P, torch.bfloat16)
    q_lat, q_pe, cache, table, ctx = _to(device, q_lat, q_pe, cache, table, ctx)
    o_ref, lse_ref = paged.mla_prefix_attention(q_lat, q_pe, cache, table, ctx, PS, 0.1)
    o, lse = at.mla_prefix_attention(q_lat, q_pe, cache, table, ctx, PS, 0.1, num_splits=2)
    torch.testing.assert_close(o, o_ref, **BF16)
    torch.testing.assert_close(lse, lse_ref, **BF16)


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_kernel_at_kimi_rank_sizes(device, dtype):
    """Kimi's per-rank MLA at TP 8: R 512, P 64, 8 heads; small batch, short contexts
    (page size 16: one row ends at a page boundary, one just past it, one is padding)."""
    R, P, H, nq, ps, width = 512, 64, 8, 3, 16, 3
    cache, table, ctx = _paged_case([32, 0, 17], R + P, ps, width, dtype=dtype, seed=11)
    q_lat, q_pe = _mla_queries(3, nq, H, R, P, dtype, seed=12)
    scale = 192 ** -0.5
    q_lat, q_pe, cache, table, ctx = _to(device, q_lat, q_pe, cache, table, ctx)
    o_ref, lse_ref = paged.mla_prefix_attention(q_lat, q_pe, cache, table, ctx, ps, scale)
    o, lse = at.mla_prefix_attention(q_lat, q_pe, cache, table, ctx, ps, scale)
    tol = FP32 if dtype == torch.float32 else BF16
    torch.testing.assert_close(o, o_ref, **tol)
    torch.testing.assert_close(lse, lse_ref, **tol)


class _Recorder:
    """Stands in for `_kernel_for`: fills the per-split partial buffers with NaN before each
    forward launch and keeps them (with the launch's arguments and grid), so a test can see
    which programs wrote."""

    def __init__(self, real):
        self.real, self.partials, self.launches = real, [], []

    def __call__(self, kernel, device):
        launcher = self.real(kernel, device)
        if kernel is not at._paged_attn_fwd:
            return launcher
        rec = self

        class _Grid:
            def __getitem__(self, grid):
                def run(*args, **kwargs):
                    args[5].fill_(float("nan"))
                    args[6].fill_(float("nan"))
                    launcher[grid](*args, **kwargs)
                    rec.partials.append((args[5].clone(), args[6].clone(), args))
                    rec.launches.append((grid, kwargs))
                return run
        return _Grid()


@needs_triton
def test_mla_kernel_reads_and_writes_only_live_pages(monkeypatch):
    """Slots no row may read hold NaN and the result is still the twin's; split programs
    past a row's length leave their partials untouched (they exit at once)."""
    R, P, H, nq, lens = 64, 16, 4, 2, [*RAGGED, 40]
    cache, table, ctx = _paged_case(lens, R + P, PS, 12)
    q_lat, q_pe = _mla_queries(len(lens), nq, H, R, P, torch.float32)
    o_ref, lse_ref = paged.mla_prefix_attention(q_lat, q_pe, cache, table, ctx, PS, 0.1)
    rec = _Recorder(at._kernel_for)
    monkeypatch.setattr(at, "_kernel_for", rec)
    poisoned = _poisoned(cache, table, ctx, PS)
    o, lse = at.mla_prefix_attention(q_lat, q_pe, poisoned, table, ctx, PS, 0.1,
                                     num_splits=3, block_n=16)
    torch.testing.assert_close(o, o_ref, **FP32)
    torch.testing.assert_close(lse, lse_ref, **FP32)
    (part, plse, args), = rec.partials
    assert plse.shape[0] == 3
    for b, n in enumerate(lens):
        live = max(1, -(-n // at.split_chunk(n, 3, 16)))
        assert not plse[:live, b].isnan().any()
        assert plse[live:, b].isnan().all() and part[live:, b].isnan().all()


# --- the drafter's grouped-query context kernel -----------------------------------------------


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nh,kvh,hd,M", [(8, 2, 16, 4), (4, 4, 24, 1), (6, 2, 16, 7)],
                         ids=["gqa4", "mha_hd24", "gqa3_rows7"])
@pytest.mark.parametrize("num_splits", [1, None], ids=["one_split", "auto"])
def test_draft_kernel_equals_twin(device, nh, kvh, hd, M, num_splits):
    cache, table, ctx = _paged_case(RAGGED, 2 * kvh * hd, PS, W, seed=7,
                                    index_dtype=torch.int32 if M == 1 else torch.int64)
    q = torch.randn(len(RAGGED), M, nh, hd, generator=torch.Generator().manual_seed(8))
    q, cache, table, ctx = _to(device, q, cache, table, ctx)
    o_ref, lse_ref = paged.draft_context_attention(q, cache, table, ctx, PS, hd ** -0.5)
    o, lse = at.draft_context_attention(q, cache, table, ctx, PS, hd ** -0.5,
                                        num_splits=num_splits, block_n=16)
    torch.testing.assert_close(o, o_ref, **FP32)
    torch.testing.assert_close(lse, lse_ref, **FP32)
    assert (o[0] == 0).all() and (lse[0] == float("-inf")).all()


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_draft_kernel_bf16_at_kimi_drafter_rank_sizes(device):
    """Kimi-K2.5-DFlash per rank at TP 8 (8 query heads, 1 KV head, head_dim 128), a block
    of 8, bf16 cache; NaN in every slot no row may read."""
    nh, kvh, hd, M, ps = 8, 1, 128, 8, 16
    cache, table, ctx = _paged_case([17, 0, 48], 2 * kvh * hd, ps, 3, dtype=torch.bfloat16,
                                    seed=9)
    q = torch.randn(3, M, nh, hd, generator=torch.Generator().manual_seed(10)).bfloat16()
    poisoned = _poisoned(cache, table, ctx, ps)
    q, cache, poisoned, table, ctx = _to(device, q, cache, poisoned, table, ctx)
    o_ref, lse_ref = paged.draft_context_attention(q, cache, table, ctx, ps, hd ** -0.5)
    o, lse = at.draft_context_attention(q, poisoned, table, ctx, ps, hd ** -0.5)
    torch.testing.assert_close(o, o_ref, **BF16)
    torch.testing.assert_close(lse, lse_ref, **BF16)


# --- splits follow each row's live length ---------------------------------------------------

# Kimi K2.5 per rank at TP 8: 8 MLA heads, kv_lora_rank 512, rope 64; its DFlash drafter
# (64 query heads, 8 KV heads, head_dim 128, block 8) has 8 query heads and 1 KV head per rank.
KIMI_MLA = dict(heads=8, kv_heads=1, dv=512)
KIMI_DRAFT = dict(heads=8, kv_heads=1, dv=128)
LONG_TABLE, KIMI_PS = 262144, 16


def _wrote(plse: torch.Tensor, kwargs: dict, kv_heads: int) -> torch.Tensor:
    """`[S, bs]`: how many of a launch's `(KV head, row tile)` programs wrote partials per
    split and row (their first row's LSE is no longer NaN)."""
    _, _, M, NH = plse.shape
    G, bm = kwargs["G"], kwargs["BLOCK_M"]
    first = torch.arange(0, M * G, bm)
    m = first // G
    h = (torch.arange(kv_heads)[:, None] * G + first % G).flatten()
    m = m.repeat(kv_heads)
    return (~plse[:, :, m, h].isnan()).sum(-1)


@needs_triton
def test_programs_with_work_follow_the_live_context():
    """Batch 1, a 4,096-token context in a 262,144-token table: both kernels have at least 64
    programs with work at Kimi's per-rank sizes (the table's capacity cut into splits left
    one to five), growing with the context; a prefill chunk of 4,096 queries takes one split."""
    W_long = LONG_TABLE // KIMI_PS

    def work(kernel: dict, rows: int, ctx: list[int]) -> int:
        return at.programs_with_work(len(ctx), rows, kernel["heads"], ctx, W_long, KIMI_PS,
                                     torch.bfloat16, kv_heads=kernel["kv_heads"],
                                     dv=kernel["dv"])

    for rows in (1, 5, 9):  # plain decoding, tree budgets 4 and 8
        assert work(KIMI_MLA, rows, [4096]) >= 64
    for rows in (1, 4, 8):
        assert work(KIMI_DRAFT, rows, [4096]) >= 64
    lens = [0, 1, 32, 100, 1000, 4096, 65536, LONG_TABLE]
    counts = [work(KIMI_MLA, 1, [n]) for n in lens]
    assert counts[0] == 0 and counts[1] == 1 and counts == sorted(counts)
    assert counts[-1] == at.MAX_SPLITS
    assert work(KIMI_MLA, 1, [0, 4096, 1]) == work(KIMI_MLA, 1, [4096]) + 1 > 64
    # a prefill chunk of 4,096 tokens: its rows fill the GPU, one split, no partials
    row_tiles, S = at.launch_shape(1, 4096, 8, LONG_TABLE, torch.bfloat16, kv_heads=1,
                                   dv=512, num_splits=None, block_n=None)[:2]
    assert S == 1 and row_tiles * 32 == 4096 * 8
    for q in (16, 64, 256, 1024):
        S = at.launch_shape(1, q, 8, LONG_TABLE, torch.bfloat16, kv_heads=1, dv=512,
                            num_splits=None, block_n=None).num_splits
        assert S == 1 or S * q * 8 * 513 * 4 <= at.MAX_PARTIAL_BYTES


@needs_triton
@pytest.mark.parametrize("kernel", ["mla", "draft"])
def test_kimi_sizes_long_table_grid_has_the_counted_work(monkeypatch, kernel):
    """At Kimi's per-rank sizes (bf16), batch 1, a 4,096-token context in a 262,144-token
    table: the programs that wrote partials are `programs_with_work`'s count (at least 64),
    and the result is the twin's over the live pages."""
    ctx_list, rows = [4096], (1 if kernel == "mla" else 8)
    W_long = LONG_TABLE // KIMI_PS
    live_w = pages_needed(ctx_list[0], KIMI_PS)
    if kernel == "mla":
        R, P, H = 512, 64, KIMI_MLA["heads"]
        cache, table, ctx = _paged_case(ctx_list, R + P, KIMI_PS, W_long, torch.bfloat16, 13)
        q = _mla_queries(1, rows, H, R, P, torch.bfloat16, seed=14)
        run, twin, dims = at.mla_prefix_attention, paged.mla_prefix_attention, KIMI_MLA
        scale = 192 ** -0.5
    else:
        hd, nh = 128, KIMI_DRAFT["heads"]
        cache, table, ctx = _paged_case(ctx_list, 2 * hd, KIMI_PS, W_long, torch.bfloat16, 15)
        q = (torch.randn(1, rows, nh, hd, generator=torch.Generator().manual_seed(16))
             .bfloat16(),)
        run, twin, dims = at.draft_context_attention, paged.draft_context_attention, KIMI_DRAFT
        scale = hd ** -0.5
    rec = _Recorder(at._kernel_for)
    monkeypatch.setattr(at, "_kernel_for", rec)
    o, lse = run(*q, cache, table, ctx, KIMI_PS, scale)
    (_, plse, _), = rec.partials
    (grid, kwargs), = rec.launches
    want = at.programs_with_work(1, rows, dims["heads"], ctx_list, W_long, KIMI_PS,
                                 torch.bfloat16, kv_heads=dims["kv_heads"], dv=dims["dv"])
    assert grid[2] == plse.shape[0] == at.MAX_SPLITS
    assert int(_wrote(plse, kwargs, dims["kv_heads"]).sum()) == want >= 64
    o_ref, lse_ref = twin(*q, cache, table[:, :live_w], ctx, KIMI_PS, scale)
    torch.testing.assert_close(o, o_ref, **BF16)
    torch.testing.assert_close(lse, lse_ref, **BF16)


@needs_triton
@pytest.mark.parametrize("num_splits", [3, None], ids=["three_splits", "auto"])
@pytest.mark.parametrize("kernel", ["mla", "draft"])
def test_kernels_split_by_live_length_equal_twins(monkeypatch, kernel, num_splits):
    """Short, page-aligned, long and empty rows in one batch of a table far wider than any of
    them: each row's work is cut by its own length (chunks of many key tiles with three
    splits, of one or two with the automatic count), the partials that wrote are the counted
    ones, and the results are the twins'."""
    lens, ps, width, bn = [3, 48, 1000, 0], 16, 256, 16
    rec = _Recorder(at._kernel_for)
    monkeypatch.setattr(at, "_kernel_for", rec)
    if kernel == "mla":
        R, P, H, rows, kvh, dv = 32, 16, 4, 2, 1, 32
        cache, table, ctx = _paged_case(lens, R + P, ps, width, seed=17)
        q = _mla_queries(len(lens), rows, H, R, P, torch.float32, seed=18)
        run, twin = at.mla_prefix_attention, paged.mla_prefix_attention
    else:
        H, kvh, dv, rows = 4, 2, 16, 3
        cache, table, ctx = _paged_case(lens, 2 * kvh * dv, ps, width, seed=19)
        q = (torch.randn(len(lens), rows, H, dv, generator=torch.Generator().manual_seed(20)),)
        run, twin = at.draft_context_attention, paged.draft_context_attention
    o, lse = run(*q, cache, table, ctx, ps, 0.3, num_splits=num_splits, block_n=bn)
    o_ref, lse_ref = twin(*q, cache, table, ctx, ps, 0.3)
    torch.testing.assert_close(o, o_ref, **FP32)
    torch.testing.assert_close(lse, lse_ref, **FP32)
    (_, plse, _), = rec.partials
    (grid, kwargs), = rec.launches
    S = grid[2]
    auto = at.launch_shape(len(lens), rows, H, width * ps, torch.float32, kv_heads=kvh, dv=dv,
                           num_splits=None, block_n=bn).num_splits
    assert S == (num_splits or auto) and auto > 3
    wrote = _wrote(plse, kwargs, kvh)
    per_row = wrote.sum(0).tolist()
    for b, n in enumerate(lens):
        work = at.programs_with_work(1, rows, H, [n], width, ps, torch.float32, kv_heads=kvh,
                                     dv=dv, num_splits=S, block_n=bn)
        # a zero-length row's split 0 writes its empty result and reads nothing
        assert per_row[b] == (work if n else int(wrote[0, b]))
    chunk = at.split_chunk(1000, S, bn)
    assert chunk <= 2 * bn if num_splits is None else chunk > 20 * bn
    assert per_row[2] == wrote[0, 2] * -(-1000 // chunk)


# --- interpreter robustness and GPU block shapes ---------------------------------------------


@needs_triton
def test_kernels_run_on_cpu_when_triton_was_imported_without_interpreter():
    """Triton and the kernels were imported without `TRITON_INTERPRET` (nothing in the suite
    sets it): the kernels are compiled-mode functions and still run on CPU tensors, equal to
    the twins."""
    from triton.runtime.jit import JITFunction

    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        assert isinstance(at._paged_attn_fwd, JITFunction)
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(40, 80, generator=g)
    table = torch.tensor([[3, 7, 0], [0, 0, 0], [9, 2, 5]])
    ctx = torch.tensor([6, 0, 12])
    ql, qp = torch.randn(3, 2, 4, 64, generator=g), torch.randn(3, 2, 4, 16, generator=g)
    o, lse = at.mla_prefix_attention(ql, qp, cache, table, ctx, 4, 0.1, num_splits=2)
    o2, lse2 = paged.mla_prefix_attention(ql, qp, cache, table, ctx, 4, 0.1)
    torch.testing.assert_close(o, o2, **FP32)
    torch.testing.assert_close(lse, lse2, **FP32)


def compile_sm90(fn, sig: dict[str, str], const: dict, num_warps: int,
                 attrs: dict | None = None) -> dict:
    """`fn` compiled for sm_90a by Triton's compiler (no GPU), its PTX assembled by ptxas -v
    (`graphs.kernels.compile_source`): `{"mma", "registers", "spills", "shared_bytes"}`.
    Shared with `tests/test_prefill_attention.py`."""
    from graphs.kernels import compile_source

    return compile_source(fn, sig, const, attrs or {}, {"num_warps": num_warps})


def _ptxas() -> str | None:
    if at is None:
        return None
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for name in ("ptxas-blackwell", "ptxas"):
        if (bindir / name).is_file():
            return str(bindir / name)
    return None


@needs_triton
@pytest.mark.skipif(_ptxas() is None, reason="triton's NVIDIA backend (ptxas) is missing")
def test_kernels_compile_for_sm90_without_spills():
    """The wrappers' tile choices compile for an H200 (sm_90a) with no register spills and
    shared memory within its 227 KB, without a GPU: Triton compiles to PTX, ptxas reports. Kimi's
    widths in bf16 (fp32 weights at those widths fit no GPU), toy widths in both."""

    def fwd(dtype, da, db, dv, group, m, v_is_a):
        launch = at.launch_shape(1, m, group, 16, dtype, kv_heads=1, dv=dv, num_splits=None,
                                 block_n=None)
        meta = at.fwd_meta(dtype, "cuda", launch, group=group, page_size=16, da=da, db=db,
                           dv=dv, v_is_a=v_is_a)
        t = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
        return at._paged_attn_fwd, meta, launch.num_warps, dict(
            qa_ptr="*" + t, qb_ptr="*" + t, kv_ptr="*" + t)

    cases = dict(
        mla_kimi_bf16=fwd(torch.bfloat16, 512, 64, 512, 8, 65, True),
        mla_toy_fp32=fwd(torch.float32, 64, 16, 64, 4, 65, True),
        mla_toy_bf16=fwd(torch.bfloat16, 64, 16, 64, 4, 65, True),
        draft_kimi_bf16=fwd(torch.bfloat16, 128, 0, 128, 8, 8, False),
        merge=(at._merge_splits, dict(DV=512, BLOCK_R=8, BLOCK_DV=512), 4, {}),
    )
    for name, (fn, const, nw, ptrs) in cases.items():
        sig = {}
        for a in fn.arg_names:
            if a in const:
                sig[a] = "constexpr"
            elif a.endswith("_ptr"):
                sig[a] = ptrs.get(a, "*i64" if a in ("pt_ptr", "len_ptr") else "*fp32")
            else:
                sig[a] = "fp32" if a == "qk_scale" else "i32"
        r = compile_sm90(fn, sig, const, nw)
        assert r["spills"] == 0, (name, r["registers"])
        assert r["shared_bytes"] <= 227 * 1024, (name, r["shared_bytes"])
