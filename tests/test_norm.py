"""RMSNorm as one kernel (`kimi::rms_norm`, `ops.norm_triton`), alone and with the residual add
before it (`kimi::add_rms_norm`): the Triton kernel against its torch twins (`ops.norm`,
transformers' rounding) under Triton's interpreter (CPU tensors take it whatever
`TRITON_INTERPRET` says: `ops.triton_util`), the ops' dispatch and fake kernels, what the planner
and the rehearsal charge for them, and their sm_90a compile.

The kernel sums the mean square in another order than torch, so a value may differ from the
twin's by its last bit: every value within one unit in the last place, nearly all equal."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.models.layers import RMSNorm
from ops.norm import add_rms_norm, rms_norm

try:
    from graphs import kernels
    from ops.norm_triton import add_rms_norm_triton, rms_norm_triton
except ImportError:  # triton is the optional `gpu` extra
    kernels = None

needs_triton = pytest.mark.skipif(kernels is None, reason="needs triton")


def _within_an_ulp(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    ulp = torch.finfo(want.dtype).eps * want.float().abs().clamp_min(
        torch.finfo(want.dtype).tiny)
    diff = (got.float() - want.float()).abs()
    assert (diff <= ulp + 1e-30).all(), diff.max()
    assert (diff == 0).float().mean() > 0.99


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H", [64, 100, 1536])
def test_kernel_equals_twin(dtype, H):
    """Rows of several widths (a power of two, a masked tail, Kimi's query projection) in both
    16-bit dtypes, three leading dims flattened."""
    g = torch.Generator().manual_seed(H)
    x = (torch.randn(2, 5, H, generator=g) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
    _within_an_ulp(rms_norm_triton(x, w, 1e-6), rms_norm(x, w, 1e-6))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_add_kernel_equals_twin(dtype):
    """With the residual add: the sum bit for bit (one rounding, as torch's add), its norm
    within an ulp; a masked tail width; shapes and dtypes that do not fit are named."""
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(3, 4, 100, generator=g) * 3).to(dtype)
    d = torch.randn(3, 4, 100, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(100, generator=g)).to(dtype)
    s, y = add_rms_norm_triton(x, d, w, 1e-6)
    s0, y0 = add_rms_norm(x, d, w, 1e-6)
    assert torch.equal(s, s0) and torch.equal(s0, x + d)
    _within_an_ulp(y, y0)
    _within_an_ulp(y, rms_norm(x + d, w, 1e-6))
    with pytest.raises(ValueError, match="delta"):
        add_rms_norm_triton(x, d[..., :50], w, 1e-6)


@needs_triton
def test_kernel_takes_strided_rows_and_no_rows():
    """A view whose rows are strided (the latent half of a projection's output) and an empty
    batch."""
    x = torch.randn(6, 2 * 96).to(torch.bfloat16)
    w = torch.rand(96).to(torch.bfloat16)
    _within_an_ulp(rms_norm_triton(x[:, :96], w, 1e-5), rms_norm(x[:, :96], w, 1e-5))
    assert rms_norm_triton(x[:0, :96], w, 1e-5).shape == (0, 96)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(x[:, :96], w.float(), 1e-5)


class Ops(TorchDispatchMode):
    """The names of the ops dispatched inside (`tests/test_rope.py` uses it too)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func._overloadpacket))
        return func(*args, **(kwargs or {}))


def test_module_takes_the_op_off_the_cpu_and_the_twin_on_it():
    """`RMSNorm` on 16-bit rows: the twin's ops on the CPU (bit for bit), one `kimi::rms_norm`
    elsewhere (the meta device's, which the planner costs); fp32 keeps torch's fused norm."""
    norm = RMSNorm(32, 1e-6)
    norm.weight.data = torch.rand(32)
    x = torch.randn(3, 32)
    bf = RMSNorm(32, 1e-6).to(torch.bfloat16)
    bf.weight.data = norm.weight.data.to(torch.bfloat16)
    assert torch.equal(bf(x.to(torch.bfloat16)), rms_norm(x.to(torch.bfloat16), bf.weight, 1e-6))
    with Ops() as cpu:
        bf(x.to(torch.bfloat16))
    assert "kimi.rms_norm" not in cpu.names and "aten.pow" in cpu.names
    meta = RMSNorm(32, 1e-6).to(device="meta", dtype=torch.bfloat16)
    x_meta = torch.empty(3, 32, dtype=torch.bfloat16, device="meta")
    with Ops() as on_meta:
        y = meta(x_meta)
    assert on_meta.names == ["kimi.rms_norm"] and y.shape == (3, 32) and y.dtype == torch.bfloat16
    with Ops() as fp32:
        norm(x)
    assert fp32.names == ["aten.rms_norm"] or "kimi.rms_norm" not in fp32.names
    # with the residual add: the twin on the CPU (its sum exact), one op on meta
    d = torch.randn(3, 32).to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    s, y = bf.add(xb, d)
    assert torch.equal(s, xb + d) and torch.equal(y, bf(xb + d))
    assert bf.add(xb, None)[0] is xb
    with Ops() as on_meta:
        s, y = meta.add(x_meta, x_meta)
    assert on_meta.names == ["kimi.add_rms_norm"] and s.shape == y.shape == (3, 32)
    s32, y32 = norm.add(x, x)
    assert torch.equal(s32, x + x) and torch.equal(y32, norm(x + x))


@needs_triton
def test_planner_and_rehearsal_charge_one_pass_and_one_launch():
    """The cost model charges the op its row read and written once (and the weight), the
    rehearsal one kernel."""
    from graphs.plan import CostMode
    from graphs.rehearse import kimi_launches

    x = torch.empty(4096, 7168, dtype=torch.bfloat16, device="meta")
    w = torch.empty(7168, dtype=torch.bfloat16, device="meta")
    cost = CostMode(0)
    with cost:
        torch.ops.kimi.rms_norm(x, w, 1e-6)
    (name, unit), = cost.ops
    assert (name, unit) == ("kimi.rms_norm", "bf16")
    assert cost.bytes == 2 * 4096 * 7168 * 2 + 7168 * 2
    assert kimi_launches(torch.ops.kimi.rms_norm.default, (x, w, 1e-6)) == 1
    # with the add: two rows read, two written, one launch
    cost = CostMode(0)
    with cost:
        torch.ops.kimi.add_rms_norm(x, x, w, 1e-6)
    assert [*cost.ops] == [("kimi.add_rms_norm", "bf16")]
    assert cost.bytes == 4 * 4096 * 7168 * 2 + 7168 * 2
    assert kimi_launches(torch.ops.kimi.add_rms_norm.default, (x, x, w, 1e-6)) == 1


def _has_ptxas() -> bool:
    try:
        return kernels is not None and Path(kernels.ptxas_path(90)).is_file()
    except (ImportError, RuntimeError):  # no NVIDIA backend in this triton
        return False


@pytest.mark.skipif(not _has_ptxas(), reason="triton's NVIDIA backend (ptxas) is missing")
def test_audit_norms_compile_for_sm90_without_spills():
    """`graphs.kernels --only norm` at K2.5's widths (hidden 7,168, query 1,536, latent 512,
    the drafter's heads 128), and the hidden states' with the residual add: one configuration
    each, no spills, no MMA. `--only rope`: the queries' and the key's rotary tails, likewise."""
    from engine.config import DraftConfig, ModelConfig

    root = Path(__file__).resolve().parent.parent / "configs"
    cfg = ModelConfig.from_dir(root / "kimi-k2.5-text")
    rows = kernels.audit(cfg, DraftConfig.from_dir(root / "kimi-k2.5-dflash"), 8, only="norm")
    assert sorted((r["width"], r["config"]["ADD"]) for r in rows) == [
        (128, False), (512, False), (1536, False), (7168, False), (7168, True)]
    for r in rows:
        assert r["name"] == "_rms_norm_kernel" and r["mma"] == "none" and r["spills"] == 0, r
        assert r["config"]["BLOCK"] >= r["width"]
    rows = kernels.audit(cfg, None, 8, only="rope")
    assert sorted((r["heads"], r["nope"]) for r in rows) == [(1, 0), (8, 128)]
    for r in rows:
        assert r["name"] == "_rope_tail_kernel" and r["mma"] == "none" and r["spills"] == 0, r
