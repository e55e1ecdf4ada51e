"""Static-shape expert alignment, the expert bank over it (torch twin and Triton kernels, float,
INT4 W4A16 and FP8 block weights), the `kimi::moe_experts*` custom ops, and `ExpertBank`'s
quantized dispatch.

Triton kernels run on CPU tensors under Triton's interpreter (`ops.triton_util.kernel_for`
picks it per call; no `TRITON_INTERPRET` setup needed) and compiled on CUDA when present.
Tolerances: integer paths (alignment, INT4 unpacking) and per-chunk dequantization (INT4,
FP8: elementwise, so the quantized twins equal the float twin on the dequantized bank) exact;
the torch twin against `experts_dense` / `experts_sparse` at the fp32 defaults of
`assert_close`; the Triton kernels against the twin (same rounding points, other summation
order) at the fp32 defaults for fp32, and `rtol = 1e-2` with `atol = 1e-2 * max|ref|` for bf16
/ fp16 (they agree bit for bit on almost every element; that bound allows a one-ulp bf16 flip
of intermediate values).
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

import ops.custom_ops  # (registers torch.ops.kimi.*)
from engine.models.layers import ExpertBank
from ops.moe import (
    dequant_experts_fp8,
    dequant_experts_int4,
    expected_aligned_rows,
    expert_ranks,
    experts_aligned,
    experts_aligned_fp8,
    experts_aligned_w4a16,
    experts_dense,
    experts_grouped,
    experts_sparse,
    experts_sparse_by,
    moe_align_block_size,
    moe_align_capacity,
    moe_bytes,
    moe_flops,
    route_noaux_tc,
    weighted_slot_sum,
)
from ops.quant import dequant_fp8_block, dequant_int4, pack_int4, quantize_fp8_block

try:
    from ops.moe_triton import (
        moe_experts_fp8_triton,
        moe_experts_triton,
        moe_experts_w4a16_triton,
        slot_sum,
    )
except ImportError:  # triton is the optional `gpu` extra
    moe_experts_triton = moe_experts_w4a16_triton = moe_experts_fp8_triton = slot_sum = None

needs_triton = pytest.mark.skipif(moe_experts_triton is None, reason="needs triton")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
ops.custom_ops.register_flop_formulas()


def _align_loop(ids: torch.Tensor, E: int, block: int) -> tuple[list[int], list[int]]:
    """The alignment spelled out: each expert's pairs in flat order, padded with `N`."""
    flat = ids.reshape(-1).tolist()
    rows: list[int] = []
    experts: list[int] = []
    for e in range(E):
        mine = [i for i, v in enumerate(flat) if v == e]
        if mine:
            run = mine + [len(flat)] * (-len(mine) % block)
            rows += run
            experts += [e] * (len(run) // block)
    return rows, experts


def _routing(kind: str, T: int, k: int, E: int, g: torch.Generator) -> torch.Tensor:
    if kind == "random":
        return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if kind == "one_expert":  # every pair to the last expert (k > 1: repeated ids in a row)
        return torch.full((T, k), E - 1, dtype=torch.int64)
    if kind == "empty_experts":  # only experts 1 and 3 of E used
        return torch.randint(0, 2, (T, k), generator=g) * 2 + 1
    if kind == "ties":  # all router scores equal: topk breaks the tie, weights are equal
        return route_noaux_tc(torch.zeros(T, E), torch.zeros(E), k, 1, 1, True, 1.0)[0]
    if kind == "duplicates":
        return torch.randint(0, 2, (T, k), generator=g)
    raise ValueError(kind)


KINDS = ["random", "one_expert", "empty_experts", "ties", "duplicates"]


@pytest.mark.parametrize("kind", KINDS + ["dropped"])
@pytest.mark.parametrize(("T", "k", "E", "block"), [(1, 1, 4, 16), (1, 8, 16, 16),
                                                    (7, 2, 5, 4), (13, 3, 6, 32),
                                                    (6, 2, 4, 1), (40, 4, 8, 64)])
def test_align_matches_loop(kind: str, T: int, k: int, E: int, block: int) -> None:
    g = torch.Generator().manual_seed(T * 100 + k)
    if kind == "dropped":  # ids outside [0, E): no row
        ids = torch.randint(-1, E + 1, (T, k), generator=g)
    else:
        ids = _routing(kind, T, k, E, g)
    sorted_ids, block_expert, num_padded = moe_align_block_size(ids, E, block)
    cap = moe_align_capacity(T * k, E, block)
    assert cap % block == 0 and cap >= T * k
    assert sorted_ids.shape == (cap,) and block_expert.shape == (cap // block,)
    assert num_padded.shape == (1,)
    assert sorted_ids.dtype == block_expert.dtype == num_padded.dtype == torch.int64
    rows, experts = _align_loop(ids, E, block)
    n = len(rows)
    assert num_padded.item() == n
    assert sorted_ids[:n].tolist() == rows
    assert torch.all(sorted_ids[n:] == T * k)
    assert block_expert.tolist() == experts + [-1] * (cap // block - len(experts))


def test_align_capacity_bounds() -> None:
    assert moe_align_capacity(8, 384, 16) == 128  # decode: 8 experts at most, not 384
    assert moe_align_capacity(4096, 384, 16) == 4096 + 384 * 15
    assert moe_align_capacity(0, 8, 16) == 0
    with pytest.raises(ValueError):
        moe_align_capacity(8, 8, 12)
    # The bound is reached: every expert holds exactly one pair.
    ids = torch.arange(8).view(4, 2)
    assert moe_align_block_size(ids, 8, 16)[2].item() == moe_align_capacity(8, 8, 16)


@pytest.mark.parametrize("T,k,E,block", [(17, 8, 384, 16), (4096, 8, 384, 64), (40, 3, 8, 16)])
def test_expected_rows_are_uniform_routings_mean(T: int, k: int, E: int, block: int) -> None:
    """`expected_aligned_rows` (what the cost model charges the Triton grid) is the mean of
    `num_padded` over routings where each token picks k distinct experts uniformly, to 1%;
    between the pairs and the worst case; exact for one token (k experts, a block each)."""
    g = torch.Generator().manual_seed(T)
    got = [moe_align_block_size(torch.rand(T, E, generator=g).topk(k).indices, E, block)[2]
           .item() for _ in range(40)]
    want = expected_aligned_rows(T, k, E, block)
    assert want == pytest.approx(sum(got) / len(got), rel=0.01)
    assert T * k <= want <= moe_align_capacity(T * k, E, block)
    assert expected_aligned_rows(1, k, E, block) == k * block


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_sum_equals_its_twin(dtype: torch.dtype) -> None:
    """The weighted sum over the k slots: fp32 products added in slot order and rounded once
    (bit for bit), over a width that is no whole tile and wider than one program's (1,024), a
    zero weight and a zero row; the twin (torch's sum, another order) to its rounding. A
    dropped pair's row (an expert outside the bank) is never read: NaN there changes nothing.
    With the shared experts' rows, their sum is rounded as `twin + add` rounds."""
    g = torch.Generator().manual_seed(3)
    E = 6
    y = torch.randn(5, 8, 1100, generator=g).to(dtype)
    w = torch.rand(5, 8, generator=g)
    idx = torch.randint(0, E, (5, 8), generator=g)
    w[1, 3] = 0
    y[2, 5] = 0
    acc = torch.zeros(5, 1100)
    for j in range(8):
        acc = acc + w[:, j, None] * y[:, j].float()
    got = slot_sum(y, w, idx, E, dtype)
    assert torch.equal(got, acc.to(dtype))
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got, weighted_slot_sum(y, w), rtol=tol, atol=tol)
    shared = torch.randn(5, 1100, generator=g).to(dtype)
    assert torch.equal(slot_sum(y, w, idx, E, dtype, shared), acc.to(dtype) + shared)
    dropped = idx.clone()
    dropped[0, 2], dropped[4, 7] = -1, E
    y_nan = y.clone()
    y_nan[0, 2] = y_nan[4, 7] = float("nan")
    keep = (dropped >= 0) & (dropped < E)
    want = (acc - w[0, 2] * y[0, 2].float() * (torch.arange(5) == 0)[:, None]
            - w[4, 7] * y[4, 7].float() * (torch.arange(5) == 4)[:, None])
    got = slot_sum(y_nan, w, dropped, E, dtype)
    assert not got.isnan().any()
    ref = torch.zeros(5, 1100)
    for j in range(8):
        ref = ref + torch.where(keep[:, j, None], w[:, j, None] * y[:, j].float(), 0.0)
    assert torch.equal(got, ref.to(dtype))
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="add"):
        slot_sum(y, w, idx, E, dtype, shared[:, :7])


def test_align_and_twins_under_fake_tensors() -> None:
    """FakeTensorMode raises on host syncs and data-dependent shapes (bincount, nonzero); the
    meta device runs the twins at no cost."""
    T, k, E, H, inter = 5, 3, 6, 64, 32
    with FakeTensorMode():
        ids = torch.randint(0, E, (T, k))
        s, b, n = moe_align_block_size(ids, E, 16)
        cap = moe_align_capacity(T * k, E, 16)
        assert s.shape == (cap,) and b.shape == (cap // 16,) and n.shape == (1,)
        x, w = torch.randn(T, H, dtype=torch.bfloat16), torch.rand(T, k)
        y = experts_aligned(x, ids, w, torch.randn(E, 2 * inter, H, dtype=torch.bfloat16),
                            torch.randn(E, H, inter, dtype=torch.bfloat16))
        assert y.shape == (T, H) and y.dtype == torch.bfloat16
        y = experts_aligned_w4a16(
            x, ids, w, torch.zeros(E, 2 * inter, H // 8, dtype=torch.int32),
            torch.ones(E, 2 * inter, H // 32, dtype=torch.bfloat16),
            torch.zeros(E, H, inter // 8, dtype=torch.int32),
            torch.ones(E, H, inter // 32, dtype=torch.bfloat16), chunk_blocks=2)
        assert y.shape == (T, H) and y.dtype == torch.bfloat16
        f8 = torch.float8_e4m3fn
        y = experts_aligned_fp8(
            x, ids, w, torch.zeros(E, 2 * inter, H, dtype=f8), torch.ones(E, 1, 2),
            torch.zeros(E, H, inter, dtype=f8), torch.ones(E, 2, 1), (64, 32), chunk_blocks=2)
        assert y.shape == (T, H) and y.dtype == torch.bfloat16
    meta = {"device": "meta"}
    y = experts_aligned(torch.empty(T, H, **meta), torch.empty(T, k, dtype=torch.int64, **meta),
                        torch.empty(T, k, **meta), torch.empty(E, 2 * inter, H, **meta),
                        torch.empty(E, H, inter, **meta))
    assert y.device.type == "meta" and y.shape == (T, H)


def _bank(E: int, inter: int, H: int, g: torch.Generator,
          dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = torch.randn(E, 2 * inter, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, inter, generator=g) / inter**0.5
    return w13.to(dtype), w2.to(dtype)


def _pack_bank(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [pack_int4(w[e].float()) for e in range(w.shape[0])]
    return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])


def _dequant_bank(packed: torch.Tensor, scale: torch.Tensor, cols: int,
                  dtype: torch.dtype) -> torch.Tensor:
    return torch.stack([dequant_int4(packed[e], scale[e], (packed.shape[1], cols), 32, dtype)
                        for e in range(packed.shape[0])])


def _fp8_bank(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [quantize_fp8_block(w[e].float(), block) for e in range(w.shape[0])]
    return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])


def _dequant_fp8_bank(w8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype) -> torch.Tensor:
    return torch.stack([dequant_fp8_block(w8[e], scale_inv[e], block, dtype)
                        for e in range(w8.shape[0])])


# FP8 blocks with partial edges: w13 [80, 96] in 3 x 2 blocks (the last row block 16 rows, the
# last column block 32 columns), w2 [96, 40] in 3 x 1.
FP8_BLOCK = (32, 64)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("T", "k", "E", "block"), [(1, 1, 4, 16), (1, 4, 8, 16),
                                                    (9, 2, 5, 16), (17, 3, 6, 32)])
def test_experts_aligned_matches_dense_and_sparse(kind: str, T: int, k: int, E: int,
                                                  block: int) -> None:
    g = torch.Generator().manual_seed(7 * T + k)
    H, inter = 48, 24
    idx = _routing(kind, T, k, E, g)
    x = torch.randn(T, H, generator=g)
    x[T // 2] = 0.0  # a padding-like row of zeros
    w = torch.rand(T, k, generator=g)
    w13, w2 = _bank(E, inter, H, g)
    got = experts_aligned(x, idx, w, w13, w2, block)
    torch.testing.assert_close(got, experts_dense(x, idx, w, w13, w2))
    torch.testing.assert_close(got, experts_sparse(x, idx, w, w13, w2))
    assert torch.equal(got[T // 2], torch.zeros(H))
    # Chunking bounds memory only: one block at a time gives the same bits.
    assert torch.equal(experts_aligned(x, idx, w, w13, w2, block, chunk_blocks=1), got)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("T", "k", "E"), [(1, 1, 4), (9, 2, 8), (17, 3, 6), (40, 8, 64)])
def test_experts_grouped_matches_the_sorted_pass(kind: str, T: int, k: int, E: int) -> None:
    g = torch.Generator().manual_seed(11 * T + k)
    H, inter = 48, 24
    idx = _routing(kind, T, k, E, g)
    x, w = torch.randn(T, H, generator=g), torch.rand(T, k, generator=g)
    w13, w2 = _bank(E, inter, H, g)
    rank, cap = expert_ranks(idx, E)
    flat = idx.reshape(-1).tolist()
    # a pair's rank counts the earlier pairs of its expert; cap is the busiest expert's count
    assert rank.tolist() == [flat[:i].count(e) for i, e in enumerate(flat)]
    assert cap == max(flat.count(e) for e in set(flat))
    got = experts_grouped(x, idx, w, w13, w2, rank, cap)
    want = experts_sparse_by(x, idx, w, E, lambda e: (w13[e], w2[e]))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got, experts_dense(x, idx, w, w13, w2))
    torch.testing.assert_close(experts_sparse(x, idx, w, w13, w2), want)


def test_experts_sparse_takes_the_grouped_pass_only_while_its_padding_is_small(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import ops.moe as moe

    taken = []
    monkeypatch.setattr(moe, "experts_grouped",
                        lambda *a: taken.append(a[-1]) or experts_grouped(*a))
    g = torch.Generator().manual_seed(3)
    E, H, inter = 16, 32, 8
    w13, w2 = _bank(E, inter, H, g)
    for T, one, grouped in ((12, False, True), (12, True, False), (600, False, False)):
        idx = _routing("one_expert" if one else "random", T, 2, E, g)
        x, w = torch.randn(T, H, generator=g), torch.rand(T, 2, generator=g)
        taken.clear()
        torch.testing.assert_close(moe.experts_sparse(x, idx, w, w13, w2),
                                   experts_dense(x, idx, w, w13, w2))
        # 24 random pairs pad to 16 x (the busiest expert's few) rows, within 4 x 24; all on one
        # expert they would pad to 16 x 24; 1,200 pairs are past the cap
        assert bool(taken) == grouped, (T, one)


def test_experts_aligned_drops_out_of_range_ids() -> None:
    g = torch.Generator().manual_seed(3)
    T, k, E, H, inter = 6, 2, 4, 32, 16
    idx = torch.randint(0, E, (T, k), generator=g)
    idx[1, 0], idx[4, 1], idx[5] = -1, E, -1  # token 5 routed nowhere at all
    x, w = torch.randn(T, H, generator=g), torch.rand(T, k, generator=g)
    w13, w2 = _bank(E, inter, H, g)
    ok = (idx >= 0) & (idx < E)
    want = experts_dense(x, idx.clamp(0, E - 1), w * ok, w13, w2)
    got = experts_aligned(x, idx, w, w13, w2, 16)
    torch.testing.assert_close(got, want)
    assert torch.equal(got[5], torch.zeros(H))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_quantized_twin_is_the_float_twin_on_the_dequantized_bank(fmt: str,
                                                                  dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(11 if fmt == "int4" else 13)
    T, k, E, H, inter = 7, 3, 5, 96, 40  # inter = 40: a partial last group / block
    idx = _routing("random", T, k, E, g)
    x, w = torch.randn(T, H, generator=g).to(dtype), torch.rand(T, k, generator=g)
    w13, w2 = _bank(E, inter, H, g)
    if fmt == "int4":
        (p13, s13), (p2, s2) = _pack_bank(w13), _pack_bank(w2)
        d13, d2 = _dequant_bank(p13, s13, H, dtype), _dequant_bank(p2, s2, inter, dtype)

        def twin(**kw: int) -> torch.Tensor:
            return experts_aligned_w4a16(x, idx, w, p13, s13, p2, s2, 32, 16, **kw)
    else:
        (q13, r13), (q2, r2) = _fp8_bank(w13, FP8_BLOCK), _fp8_bank(w2, FP8_BLOCK)
        d13 = _dequant_fp8_bank(q13, r13, FP8_BLOCK, dtype)
        d2 = _dequant_fp8_bank(q2, r2, FP8_BLOCK, dtype)

        def twin(**kw: int) -> torch.Tensor:
            return experts_aligned_fp8(x, idx, w, q13, r13, q2, r2, FP8_BLOCK, 16, **kw)
    got = twin()
    # Exact: per-chunk dequantization is elementwise, then the same ops on the same shapes.
    assert torch.equal(got, experts_aligned(x, idx, w, d13, d2, 16))
    assert torch.equal(twin(chunk_blocks=1), got)
    want = experts_dense(x, idx, w, d13, d2)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want)  # only the summation order differs
    else:  # experts_dense rounds g, u, silu and the products to bf16 at every step
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2,
                                   atol=2e-2 * want.float().abs().max().item())


def test_dequant_experts_picks_tensor_int_or_all() -> None:
    """The bank helpers dequantize just the chosen experts (an index tensor, an int, or all)
    bit for bit as the per-matrix `dequant_int4` / `dequant_fp8_block`."""
    g = torch.Generator().manual_seed(12)
    E, H, inter = 5, 96, 40
    w13, w2 = _bank(E, inter, H, g)
    p2, s2 = _pack_bank(w2)
    q13, r13 = _fp8_bank(w13, FP8_BLOCK)
    for dtype in (torch.float32, torch.bfloat16):
        d4 = _dequant_bank(p2, s2, inter, dtype)
        d8 = _dequant_fp8_bank(q13, r13, FP8_BLOCK, dtype)
        for pick, want in ((None, slice(None)), (3, slice(3, 4)), (torch.tensor([4, 0, 4]),
                                                                    [4, 0, 4])):
            got4 = dequant_experts_int4(p2, s2, pick, inter, 32, dtype)
            got8 = dequant_experts_fp8(q13, r13, pick, FP8_BLOCK, dtype)
            assert got4.dtype == got8.dtype == dtype
            assert torch.equal(got4, d4[want]) and torch.equal(got8, d8[want])


def test_w4a16_twin_real_size_full_expert() -> None:
    """Kimi's hidden 7168 and full expert intermediate 2048 (group 32), two experts, fp32
    activations, against dequantize-everything-then-`experts_dense`."""
    g = torch.Generator().manual_seed(5)
    T, E, H, inter = 2, 2, 7168, 2048
    p13 = torch.randint(-2**31, 2**31, (E, 2 * inter, H // 8), generator=g, dtype=torch.int64)
    p2 = torch.randint(-2**31, 2**31, (E, H, inter // 8), generator=g, dtype=torch.int64)
    p13, p2 = p13.to(torch.int32), p2.to(torch.int32)
    s13 = (torch.rand(E, 2 * inter, H // 32, generator=g) * 2e-3 + 1e-4).to(torch.bfloat16)
    s2 = (torch.rand(E, H, inter // 32, generator=g) * 2e-3 + 1e-4).to(torch.bfloat16)
    x = torch.randn(T, H, generator=g)
    idx = torch.tensor([[1, 0], [1, 1]])  # a repeated id in row 1
    w = torch.tensor([[0.5, 0.5], [0.25, 0.75]])
    got = experts_aligned_w4a16(x, idx, w, p13, s13, p2, s2, 32, 16)
    want = experts_dense(x, idx, w, _dequant_bank(p13, s13, H, torch.float32),
                         _dequant_bank(p2, s2, inter, torch.float32))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def _tol(ref: torch.Tensor) -> dict[str, float]:
    if ref.dtype == torch.float32:
        return {}
    return {"rtol": 1e-2, "atol": 1e-2 * max(ref.float().abs().max().item(), 1e-6)}


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("kind", "T", "k", "E", "block"), [
    ("random", 5, 2, 4, 16), ("random", 1, 8, 16, 16), ("one_expert", 9, 2, 3, 32),
    ("empty_experts", 6, 2, 6, 16), ("ties", 4, 2, 4, 16), ("duplicates", 3, 3, 2, 64),
])
def test_triton_experts_match_twin(device: str, dtype: torch.dtype, kind: str, T: int, k: int,
                                   E: int, block: int) -> None:
    g = torch.Generator().manual_seed(T * 31 + E)
    H, inter = 80, 48  # not multiples of the tiles: masked edges in every dimension
    idx = _routing(kind, T, k, E, g)
    x = torch.randn(T, H, generator=g)
    x[0] = 0.0
    w = torch.rand(T, k, generator=g)
    w13, w2 = _bank(E, inter, H, g)
    p13, s13 = _pack_bank(w13)
    p2, s2 = _pack_bank(w2)
    x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
    ref = experts_aligned(x, idx, w, w13, w2, block)
    dev = [t.to(device) for t in (x, idx, w, w13, w2)]
    got = moe_experts_triton(*dev, block).cpu()
    assert got.dtype == dtype and got.shape == (T, H)
    torch.testing.assert_close(got, ref, **_tol(ref))
    assert torch.equal(got[0], torch.zeros(H, dtype=dtype))
    # INT4: the twin dequantizes per chunk; the kernel per tile. In-kernel unpacking is exact:
    # the packed kernel gives the float kernel's bits on the dequantized bank.
    ref4 = experts_aligned_w4a16(x, idx, w, p13, s13, p2, s2, 32, block)
    got4 = moe_experts_w4a16_triton(dev[0], dev[1], dev[2], p13.to(device), s13.to(device),
                                    p2.to(device), s2.to(device), 32, block).cpu()
    torch.testing.assert_close(got4, ref4, **_tol(ref4))
    d13, d2 = _dequant_bank(p13, s13, H, dtype), _dequant_bank(p2, s2, inter, dtype)
    plain = moe_experts_triton(dev[0], dev[1], dev[2], d13.to(device), d2.to(device), block)
    assert torch.equal(got4, plain.cpu())
    # FP8 blocks (partial edge blocks in both matrices), likewise exact against the float
    # kernel on the dequantized bank.
    q13, r13 = _fp8_bank(w13.float(), FP8_BLOCK)
    q2, r2 = _fp8_bank(w2.float(), FP8_BLOCK)
    ref8 = experts_aligned_fp8(x, idx, w, q13, r13, q2, r2, FP8_BLOCK, block)
    got8 = moe_experts_fp8_triton(dev[0], dev[1], dev[2], q13.to(device), r13.to(device),
                                  q2.to(device), r2.to(device), FP8_BLOCK, block).cpu()
    torch.testing.assert_close(got8, ref8, **_tol(ref8))
    d13 = _dequant_fp8_bank(q13, r13, FP8_BLOCK, dtype)
    d2 = _dequant_fp8_bank(q2, r2, FP8_BLOCK, dtype)
    plain = moe_experts_triton(dev[0], dev[1], dev[2], d13.to(device), d2.to(device), block)
    assert torch.equal(got8, plain.cpu())


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_triton_experts_dropped_pairs_and_fp32_truth(device: str) -> None:
    g = torch.Generator().manual_seed(9)
    T, k, E, H, inter = 6, 2, 4, 64, 32
    idx = torch.randint(0, E, (T, k), generator=g)
    idx[2, 1], idx[3] = -1, E
    x, w = torch.randn(T, H, generator=g), torch.rand(T, k, generator=g)
    w13, w2 = _bank(E, inter, H, g)
    ok = (idx >= 0) & (idx < E)
    want = experts_dense(x, idx.clamp(0, E - 1), w * ok, w13, w2)
    got = moe_experts_triton(*(t.to(device) for t in (x, idx, w, w13, w2)), 16).cpu()
    torch.testing.assert_close(got, want)
    assert torch.equal(got[3], torch.zeros(H))


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_triton_experts_real_size_slice(device: str) -> None:
    """Kimi's hidden 7168 with the TP-8 shard of the expert intermediate (256), group 32, bf16
    activations: four experts (two empty), a repeated expert, a dropped pair, tied weights and
    a zero row."""
    g = torch.Generator().manual_seed(1)
    T, E, H, inter = 3, 4, 7168, 256
    idx = torch.tensor([[2, 0], [0, 2], [2, -1]])
    w = torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.7, 0.3]])
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    x[1] = 0.0
    p13 = torch.randint(-2**31, 2**31, (E, 2 * inter, H // 8), generator=g, dtype=torch.int64)
    p2 = torch.randint(-2**31, 2**31, (E, H, inter // 8), generator=g, dtype=torch.int64)
    p13, p2 = p13.to(torch.int32), p2.to(torch.int32)
    s13 = (torch.rand(E, 2 * inter, H // 32, generator=g) * 4e-3 + 1e-4).to(torch.bfloat16)
    s2 = (torch.rand(E, H, inter // 32, generator=g) * 4e-2 + 1e-3).to(torch.bfloat16)
    # The interpreter pays per tile, so the CPU run takes the largest tiles; a GPU the defaults.
    tiles = {"block_n": 512, "block_k": 512} if device == "cpu" else {}
    ref = experts_aligned_w4a16(x, idx, w, p13, s13, p2, s2, 32, 16)
    got = moe_experts_w4a16_triton(*(t.to(device) for t in (x, idx, w, p13, s13, p2, s2)),
                                   32, 16, **tiles).cpu()
    torch.testing.assert_close(got, ref, **_tol(ref))
    assert torch.equal(got[1], torch.zeros(H, dtype=torch.bfloat16))
    assert ref.float().abs().max() > 0.1  # the scales give outputs of order one
    d13 = _dequant_bank(p13, s13, H, torch.bfloat16)
    d2 = _dequant_bank(p2, s2, inter, torch.bfloat16)
    ref = experts_aligned(x, idx, w, d13, d2, 16)
    got = moe_experts_triton(*(t.to(device) for t in (x, idx, w, d13, d2)), 16, **tiles).cpu()
    torch.testing.assert_close(got, ref, **_tol(ref))
    # Kimi K2's FP8 bank at TP 8: 128 x 128 blocks, the shard's 256 rows two blocks of gate
    # and two of up.
    q13 = (torch.randn(E, 2 * inter, H, generator=g) * 64).to(torch.float8_e4m3fn)
    q2 = (torch.randn(E, H, inter, generator=g) * 64).to(torch.float8_e4m3fn)
    r13 = torch.rand(E, 2 * inter // 128, H // 128, generator=g) * 3e-4 + 5e-5
    r2 = torch.rand(E, H // 128, inter // 128, generator=g) * 2e-3 + 1e-4
    ref = experts_aligned_fp8(x, idx, w, q13, r13, q2, r2, (128, 128), 16)
    got = moe_experts_fp8_triton(*(t.to(device) for t in (x, idx, w, q13, r13, q2, r2)),
                                 (128, 128), 16, **tiles).cpu()
    torch.testing.assert_close(got, ref, **_tol(ref))
    assert torch.equal(got[1], torch.zeros(H, dtype=torch.bfloat16))
    assert ref.float().abs().max() > 0.1


def _op_args(T: int = 5, k: int = 2, E: int = 4, H: int = 64, inter: int = 32,
             dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(2)
    idx = _routing("random", T, k, E, g)
    w13, w2 = _bank(E, inter, H, g)
    return torch.randn(T, H, generator=g).to(dtype), idx, torch.rand(T, k, generator=g), w13, w2


def test_custom_ops_cpu_run_the_twins() -> None:
    x, idx, w, w13, w2 = _op_args()
    got = torch.ops.kimi.moe_experts(x, idx, w, w13, w2, 32)
    assert torch.equal(got, experts_aligned(x, idx, w, w13, w2, 32))
    p13, s13 = _pack_bank(w13)
    p2, s2 = _pack_bank(w2)
    got = torch.ops.kimi.moe_experts_w4a16(x, idx, w, p13, s13, p2, s2)
    assert torch.equal(got, experts_aligned_w4a16(x, idx, w, p13, s13, p2, s2, 32, 16))
    q13, r13 = _fp8_bank(w13, (16, 32))
    q2, r2 = _fp8_bank(w2, (16, 32))
    got = torch.ops.kimi.moe_experts_fp8(x, idx, w, q13, r13, q2, r2, 16, 32)
    assert torch.equal(got, experts_aligned_fp8(x, idx, w, q13, r13, q2, r2, (16, 32), 16))


def test_custom_ops_opcheck() -> None:
    x, idx, w, w13, w2 = _op_args()
    p13, s13 = _pack_bank(w13)
    p2, s2 = _pack_bank(w2)
    torch.library.opcheck(torch.ops.kimi.moe_experts.default, (x, idx, w, w13, w2, 16))
    torch.library.opcheck(torch.ops.kimi.moe_experts_w4a16.default,
                          (x, idx, w, p13, s13, p2, s2, 32, 16))
    q13, r13 = _fp8_bank(w13, (16, 32))
    q2, r2 = _fp8_bank(w2, (16, 32))
    # NOTE: opcheck's test_schema multiplies every input tensor, which CPU float8 lacks.
    torch.library.opcheck(torch.ops.kimi.moe_experts_fp8.default,
                          (x, idx, w, q13, r13, q2, r2, 16, 32, 16),
                          test_utils=("test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))


def _meta_args(T: int, k: int, E: int, H: int, inter: int, device: str = "meta"):
    def t(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device=device)

    return (t(T, H), t(T, k, dtype=torch.int64), t(T, k, dtype=torch.float32),
            t(E, 2 * inter, H // 8, dtype=torch.int32), t(E, 2 * inter, H // 32),
            t(E, H, inter // 8, dtype=torch.int32), t(E, H, inter // 32))


def test_custom_ops_fake_meta_and_flops() -> None:
    """Kimi's real bank (384 experts of 7168 x 2048, top-8) on the meta device costs nothing."""
    T, k, E, H, inter = 16, 8, 384, 7168, 2048
    args = _meta_args(T, k, E, H, inter)
    with FlopCounterMode(display=False) as fc:
        y = torch.ops.kimi.moe_experts_w4a16(*args)
    assert y.device.type == "meta" and y.shape == (T, H) and y.dtype == torch.bfloat16
    useful, executed = moe_flops(T, k, E, H, inter, 16)
    assert fc.get_total_flops() == useful == 2 * T * k * 3 * inter * H
    assert executed == moe_align_capacity(T * k, E, 16) * 6 * inter * H > useful
    w13 = torch.empty(E, 2 * inter, H, dtype=torch.bfloat16, device="meta")
    w2 = torch.empty(E, H, inter, dtype=torch.bfloat16, device="meta")
    with FlopCounterMode(display=False) as fc:
        torch.ops.kimi.moe_experts(*args[:3], w13, w2, block=64)
    assert fc.get_total_flops() == useful
    f8 = torch.float8_e4m3fn
    fp8 = (torch.empty(E, 2 * inter, H, dtype=f8, device="meta"),
           torch.empty(E, 2 * inter // 128, H // 128, device="meta"),
           torch.empty(E, H, inter, dtype=f8, device="meta"),
           torch.empty(E, H // 128, inter // 128, device="meta"))
    with FlopCounterMode(display=False) as fc:
        y = torch.ops.kimi.moe_experts_fp8(*args[:3], *fp8)
    assert y.device.type == "meta" and y.shape == (T, H) and y.dtype == torch.bfloat16
    assert fc.get_total_flops() == useful
    with FakeTensorMode():
        fake = _meta_args(4, 2, 8, 256, 64, device="cpu")
        y = torch.ops.kimi.moe_experts_w4a16(*fake, 32, 32)
        assert y.shape == (4, 256) and y.dtype == torch.bfloat16
        with pytest.raises(RuntimeError, match="w2"):
            torch.ops.kimi.moe_experts_w4a16(*fake[:5], fake[5][:, :128], fake[6])
        f13, f2 = torch.empty(8, 128, 256, dtype=f8), torch.empty(8, 256, 64, dtype=f8)
        r13, r2 = torch.ones(8, 1, 2), torch.ones(8, 2, 1)
        y = torch.ops.kimi.moe_experts_fp8(*fake[:3], f13, r13, f2, r2, 128, 128, 32)
        assert y.shape == (4, 256) and y.dtype == torch.bfloat16
        with pytest.raises(RuntimeError, match="w2_scale_inv"):
            torch.ops.kimi.moe_experts_fp8(*fake[:3], f13, r13, f2, r2[:, :1])
        with pytest.raises(RuntimeError, match="float8"):
            torch.ops.kimi.moe_experts_fp8(*fake[:3], f13.float(), r13, f2, r2)


def test_moe_bytes() -> None:
    T, k, E, H, inter = 2, 8, 384, 7168, 256
    b = moe_bytes(T, k, E, H, inter, weights="int4", block=16)
    assert b["experts"] == 16  # min(E, T*k)
    per = 2 * inter * H // 2 + H * inter // 2 + 2 * (2 * inter * H // 32 + H * inter // 32)
    assert b["weights"] == 16 * per
    assert b["activations"] == 2 * T * H * 2 + T * k * 12
    assert b["scratch"] == 2 * moe_align_capacity(T * k, E, 16) * inter * 2 + 2 * T * k * H * 2
    assert b["total"] == b["weights"] + b["activations"] + b["scratch"]
    assert moe_bytes(1, 8, 4, H, inter, weights="bf16")["weights"] == 4 * 3 * inter * H * 2
    # FP8: a byte a value and an fp32 scale per 128 x 128 block (Kimi K2's TP-8 expert shard)
    scales = 4 * (2 * inter // 128 * H // 128 + H // 128 * inter // 128)
    assert moe_bytes(1, 8, 4, H, inter, weights="fp8")["weights"] == 4 * (3 * inter * H + scales)


@needs_triton
@pytest.mark.cuda
@pytest.mark.parametrize("quant", ["int4", "fp8"])
def test_cuda_graph_replays_new_routing_without_syncs(quant: str) -> None:
    T, k, E, H, inter = 8, 4, 16, 256, 128
    g = torch.Generator().manual_seed(4)
    w13, w2 = _bank(E, inter, H, g, torch.bfloat16)
    pack = _pack_bank if quant == "int4" else lambda t: _fp8_bank(t, (128, 128))
    p13, s13 = (t.cuda() for t in pack(w13.float()))
    p2, s2 = (t.cuda() for t in pack(w2.float()))
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()
    idx = _routing("random", T, k, E, g).cuda()
    w = torch.rand(T, k, generator=g).cuda()
    args = (x, idx, w, p13, s13, p2, s2)
    op = torch.ops.kimi.moe_experts_w4a16 if quant == "int4" else torch.ops.kimi.moe_experts_fp8
    twin = experts_aligned_w4a16 if quant == "int4" else experts_aligned_fp8
    op(*args)  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        op(*args)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(*args)
    for kind in ("one_expert", "empty_experts", "random"):
        idx.copy_(_routing(kind, T, k, E, g))
        graph.replay()
        want = twin(*(t.cpu() for t in args))
        torch.testing.assert_close(out.cpu(), want, **_tol(want))


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_quantized_bank_dequantizes_only_the_chosen_experts(monkeypatch, fmt: str) -> None:
    """A quantized `ExpertBank`'s "aligned" mode (`kimi::moe_experts_w4a16` / `_fp8`) and
    "sparse" mode give its "dense" result without dequantizing the whole bank; "sparse" asks
    for one expert at a time by int (no index tensor to copy to the device per expert)."""
    g = torch.Generator().manual_seed(14)
    T, k, E, H, inter = 9, 3, 6, 96, 64
    idx = _routing("empty_experts", T, k, E, g)  # experts 1 and 3 only
    x, w = torch.randn(T, H, generator=g), torch.rand(T, k, generator=g)
    bank = ExpertBank(E, H, inter, fmt=fmt, block=FP8_BLOCK)
    assert bank.fmt == fmt
    w13, w2 = _bank(E, inter, H, g)
    pack = _pack_bank if fmt == "int4" else lambda t: _fp8_bank(t, FP8_BLOCK)
    for (q, s), name in ((pack(w13), "w13"), (pack(w2), "w2")):
        names = ("_packed", "_scale") if fmt == "int4" else ("", "_scale_inv")
        getattr(bank, name + names[0]).copy_(q)
        getattr(bank, name + names[1]).copy_(s)
    dense = bank(x, idx, w, "dense")
    whole = bank.weights(None, torch.float32)
    torch.testing.assert_close(dense, experts_dense(x, idx, w, *whole))
    real, asked = ExpertBank.weights, []

    def weights(self: ExpertBank, experts, dtype: torch.dtype):
        assert experts is not None, "the whole bank was dequantized"
        asked.append(experts)
        return real(self, experts, dtype)

    monkeypatch.setattr(ExpertBank, "weights", weights)
    torch.testing.assert_close(bank(x, idx, w, "aligned"), dense)
    assert asked == []  # the op dequantizes each chunk's experts itself
    torch.testing.assert_close(bank(x, idx, w, "sparse"), dense)
    assert asked == [1, 3] and all(type(e) is int for e in asked)
