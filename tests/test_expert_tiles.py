"""The expert GEMMs' launch configurations keyed by tokens (`ops.moe.EXPERT_TILES`), the kernels
at each of them against the torch twins under Triton's interpreter (the fused SiLU of the gate
and up GEMM, the GROUP_M-swizzled grid and its tail group, INT4, FP8 and float weights), and
the sm_90a kernel audit (`graphs.kernels`: Triton's compiler and ptxas, no GPU).

Tolerances as in tests/test_moe_kernels.py: fp32 at `assert_close`'s defaults, bf16 at `rtol =
1e-2` with `atol = 1e-2 * max|ref|` (a one-ulp bf16 flip of an intermediate value).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ops.moe import (
    EXPERT_TILES,
    ExpertTiles,
    expert_block,
    expert_tiles,
    experts_aligned,
    experts_aligned_fp8,
    experts_aligned_w4a16,
)
from ops.quant import pack_int4, quantize_fp8_block

try:
    import triton  # noqa: F401

    from graphs import kernels
    from ops.moe_triton import (
        moe_experts_fp8_triton,
        moe_experts_triton,
        moe_experts_w4a16_triton,
    )
    from ops.quant_triton import dequant_gemm
except ImportError:  # triton is the optional `gpu` extra
    kernels = None

needs_triton = pytest.mark.skipif(kernels is None, reason="needs triton")
STEP = ExpertTiles(16, 64, 64, 1, 4, 3)


def _has_ptxas() -> bool:
    try:
        return kernels is not None and Path(kernels.ptxas_path(90)).is_file()
    except (ImportError, RuntimeError):  # no NVIDIA backend in this triton
        return False


def test_tiles_follow_the_tokens() -> None:
    """Steps of up to 512 tokens keep the 16-row configuration; larger passes take 64 and then
    128 rows with GROUP_M swizzling, 8 warps and 3 stages; the last entry catches all."""
    assert expert_tiles(1) == expert_tiles(512) == STEP
    assert expert_tiles(513).block_m == expert_tiles(4096).block_m == 64
    assert expert_tiles(8192).block_m == expert_tiles(1 << 20).block_m == 128
    assert EXPERT_TILES[-1][0] is None
    most = [m for m, _ in EXPERT_TILES[:-1]]
    assert most == sorted(most)
    for _, t in EXPERT_TILES:
        for v in (t.block_m, t.block_n, t.block_k):
            assert v >= 16 and v & (v - 1) == 0
        if t.block_m >= 64:
            assert (t.group_m, t.num_warps, t.num_stages) == (16, 8, 3)
    assert expert_block(4096) == 64 and expert_block(4096, 16) == 16


def _bank(E: int, inter: int, H: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(E, 2 * inter, H, generator=g) / H**0.5,
            torch.randn(E, H, inter, generator=g) / inter**0.5)


def _stack(parts: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])


def _tol(ref: torch.Tensor) -> dict[str, float]:
    if ref.dtype == torch.float32:
        return {}
    return {"rtol": 1e-2, "atol": 1e-2 * max(ref.float().abs().max().item(), 1e-6)}


# The table's prefill entries (tests/test_moe_kernels.py runs the step's 16-row blocks), and a
# small-tile variant whose grid has several column tiles and a tail group of row tiles (5 row
# tiles in groups of 2).
CASES = [t for _, t in EXPERT_TILES if t.block_m > 16] + [ExpertTiles(64, 32, 64, 2, 8, 3)]


@needs_triton
@pytest.mark.parametrize("tiles", CASES, ids=lambda t: "x".join(map(str, t[:4])))
def test_kernels_equal_twins_at_each_configuration(tiles: ExpertTiles) -> None:
    """INT4 (bf16 activations), FP8 and float (fp32) banks through the Triton kernels at
    `tiles` equal the twins at the same block; hidden 80 and width 48 leave masked edges in
    every tile, one token is all zeros, and a pair is dropped (its row of the pair outputs,
    never written, is never read); with the shared experts' rows added in the reduction."""
    g = torch.Generator().manual_seed(tiles.block_m + tiles.block_n)
    T, k, E, H, inter = 40, 2, 3, 80, 48
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    idx[5, 1] = -1
    x, w = torch.randn(T, H, generator=g), torch.rand(T, k, generator=g)
    x[0] = 0.0
    w13, w2 = _bank(E, inter, H, g)
    block = tiles.block_m

    ref = experts_aligned(x, idx, w, w13, w2, block)
    got = moe_experts_triton(x, idx, w, w13, w2, tiles=tiles)
    torch.testing.assert_close(got, ref)
    assert torch.equal(got[0], torch.zeros(H))

    xb = x.to(torch.bfloat16)
    p13, s13 = _stack([pack_int4(w13[e]) for e in range(E)])
    p2, s2 = _stack([pack_int4(w2[e]) for e in range(E)])
    ref4 = experts_aligned_w4a16(xb, idx, w, p13, s13, p2, s2, 32, block)
    got4 = moe_experts_w4a16_triton(xb, idx, w, p13, s13, p2, s2, 32, tiles=tiles)
    assert got4.dtype == torch.bfloat16
    torch.testing.assert_close(got4, ref4, **_tol(ref4))
    assert ref4.float().abs().max() > 0.1
    # the shared experts' rows added in the reduction: as `routed + shared` rounds, bit for bit
    shared = torch.randn(T, H, generator=g).to(torch.bfloat16)
    assert torch.equal(moe_experts_w4a16_triton(xb, idx, w, p13, s13, p2, s2, 32, tiles=tiles,
                                                add=shared), got4 + shared)

    fb = (32, 32)  # blocks that cut the gate, the up rows and both matrices' edges
    q13, r13 = _stack([quantize_fp8_block(w13[e], fb) for e in range(E)])
    q2, r2 = _stack([quantize_fp8_block(w2[e], fb) for e in range(E)])
    ref8 = experts_aligned_fp8(xb, idx, w, q13, r13, q2, r2, fb, block)
    got8 = moe_experts_fp8_triton(xb, idx, w, q13, r13, q2, r2, fb, tiles=tiles)
    torch.testing.assert_close(got8, ref8, **_tol(ref8))


@needs_triton
def test_dense_swizzled_grid_writes_every_tile_once() -> None:
    """The dense launch on the GROUP_M-swizzled flat grid (7 row tiles in groups of 3, 3
    column tiles): every output tile written, each equal to the matmul."""
    g = torch.Generator().manual_seed(3)
    a, wt = torch.randn(100, 40, generator=g), torch.randn(1, 48, 40, generator=g)
    out = torch.full((100, 48), float("nan"))
    dequant_gemm(a, wt, out, tiles=(16, 16, 16), group_m=3)
    torch.testing.assert_close(out, a @ wt[0].T)


def _launches(T: int) -> list:
    x = torch.empty(T, 64, dtype=torch.bfloat16, device="meta")
    idx = torch.empty(T, 2, dtype=torch.int64, device="meta")
    w = torch.empty(T, 2, dtype=torch.float32, device="meta")
    w13 = torch.empty(4, 64, 64, dtype=torch.bfloat16, device="meta")
    w2 = torch.empty(4, 64, 32, dtype=torch.bfloat16, device="meta")
    with kernels.recording() as rec:
        moe_experts_triton(x, idx, w, w13, w2)
    return rec.launches


@needs_triton
def test_default_launch_takes_the_table_by_tokens() -> None:
    """Without a block, the launcher takes `expert_tiles(T)`: a step's 16-row blocks on the
    2-D grid, a chunk's 64-row blocks on the swizzled flat grid with 8 warps and 3 stages;
    the first GEMM fused (gated), the second plain, then the weighted sum over the slots."""
    for T, tiles in ((8, STEP), (2048, expert_tiles(2048))):
        launches = _launches(T)
        assert [la.kernel.__name__ for la in launches] == [
            "_dequant_gemm_kernel", "_dequant_gemm_kernel", "_slot_sum_kernel"]
        got = [kernels.config_of(la) for la in launches[:2]]
        assert [c["GATED"] for c in got] == [True, False]
        for c in got:
            assert (c["BLOCK_M"], c["GROUP_M"], c["num_warps"], c["num_stages"]) == (
                tiles.block_m, tiles.group_m, tiles.num_warps, tiles.num_stages)


@pytest.mark.skipif(not _has_ptxas(), reason="triton's NVIDIA backend (ptxas) is missing")
def test_audit_prefill_experts_use_wgmma_without_spills(tmp_path: Path) -> None:
    """`python -m graphs.kernels --only "prefill experts"` at K2.5's tp-8 shapes: both expert
    GEMMs of a 4,096-token chunk compile for sm_90a to wgmma, spill nothing and fit the
    227 KB of shared memory, and so does the weighted sum over the slots (no MMA); the JSON
    rows carry the documented fields."""
    out = tmp_path / "k.json"
    assert kernels.main(["--tp", "8", "--arch", "sm_90a", "--only", "prefill experts",
                         "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["name"] for r in rows] == ["_dequant_gemm_kernel"] * 2 + ["_slot_sum_kernel"]
    (total,) = rows[2:]
    assert total["mma"] == "none" and total["spills"] == 0 and total["config"]["K"] == 8
    rows = rows[:2]
    assert {r["config"]["GATED"] for r in rows} == {True, False}
    for r in rows:
        assert {"name", "use", "config", "mma", "registers", "spills", "shared_bytes"} <= set(r)
        assert r["name"] == "_dequant_gemm_kernel" and r["use"] == "prefill experts"
        assert r["config"]["WEIGHT"] == "int4" and r["config"]["BLOCK_M"] == 64
        assert r["mma"] == "wgmma" and r["spills"] == 0, r
        assert 0 < r["registers"] <= 255 and 0 < r["shared_bytes"] <= 227 * 1024
