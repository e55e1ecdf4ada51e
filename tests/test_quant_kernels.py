"""The FP8 block-scaled linear: torch twin, Triton kernel (interpreted on CPU tensors, compiled
on CUDA when present) and the `kimi::fp8_linear` custom op.

Tolerances: the Triton kernel against the twin at `rtol = 1e-5`, `atol = 1e-5 * max|ref|` for
fp32 activations (IEEE fp32 dots; only the summation order differs, and the test weights mix
blocks 30x apart, so single outputs cancel below the `assert_close` defaults' absolute floor),
and `rtol = 1e-2` with `atol = 1e-2 * max|ref|` for bf16 / fp16 (the weight tile is rounded to
x's dtype bit for bit as the twin's dequantized weight; the output may differ in its last bit).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

import ops.custom_ops  # (registers torch.ops.kimi.*)
from ops.quant import dequant_fp8_block, fp8_linear_bytes, fp8_linear_torch, quantize_fp8_block

try:
    from ops.quant_triton import fp8_linear_triton
except ImportError:  # triton is the optional `gpu` extra
    fp8_linear_triton = None

needs_triton = pytest.mark.skipif(fp8_linear_triton is None, reason="needs triton")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
ops.custom_ops.register_flop_formulas()
ROOT = Path(__file__).resolve().parents[1]


def _weight(N: int, K: int, block: tuple[int, int], g: torch.Generator):
    w = torch.randn(N, K, generator=g) / K**0.5
    w[:, : min(K, block[1])] *= 30.0  # blocks with their own scales
    return quantize_fp8_block(w, block)


def _tol(ref: torch.Tensor) -> dict[str, float]:
    rel = 1e-5 if ref.dtype == torch.float32 else 1e-2
    return {"rtol": rel, "atol": rel * max(ref.float().abs().max().item(), 1e-6)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_torch_is_x_times_dequantized_weight(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    w8, s = _weight(130, 257, (128, 128), g)
    x = torch.randn(2, 3, 257, generator=g).to(dtype)
    got = fp8_linear_torch(x, w8, s)
    assert got.shape == (2, 3, 130) and got.dtype == dtype
    assert torch.equal(got, x @ dequant_fp8_block(w8, s, dtype=dtype).T)
    want = x.double() @ dequant_fp8_block(w8, s, dtype=torch.float64).T
    torch.testing.assert_close(got.double(), want, **_tol(got))


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("M", "N", "K", "block"), [
    (1, 64, 128, (128, 128)),  # decode row, one block
    (3, 130, 257, (128, 128)),  # partial blocks on both axes
    (33, 96, 200, (64, 32)),  # several row tiles, small blocks
])
def test_triton_fp8_linear_matches_twin(device: str, dtype: torch.dtype, M: int, N: int, K: int,
                                        block: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(M + N)
    w8, s = _weight(N, K, block, g)
    x = torch.randn(M, K, generator=g).to(dtype)
    x[0] = 0.0
    ref = fp8_linear_torch(x, w8, s, block)
    got = fp8_linear_triton(x.to(device), w8.to(device), s.to(device), block).cpu()
    assert got.shape == (M, N) and got.dtype == dtype
    torch.testing.assert_close(got, ref, **_tol(ref))
    assert torch.equal(got[0], torch.zeros(N, dtype=dtype))


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_triton_fp8_linear_layouts(device: str) -> None:
    """Leading dims, a strided `x`, the weight's bytes as uint8, and no rows at all."""
    g = torch.Generator().manual_seed(3)
    w8, s = _weight(80, 256, (128, 128), g)
    w8, s = w8.to(device), s.to(device)
    x = torch.randn(2, 3, 512, generator=g).to(device)[..., ::2]  # [2, 3, 256], stride 2
    got = fp8_linear_triton(x, w8, s)
    assert got.shape == (2, 3, 80)
    ref = fp8_linear_torch(x.cpu(), w8.cpu(), s.cpu())
    torch.testing.assert_close(got.cpu(), ref, **_tol(ref))
    assert torch.equal(fp8_linear_triton(x, w8.view(torch.uint8), s), got)
    assert fp8_linear_triton(x[:, :0], w8, s).shape == (2, 0, 80)
    with pytest.raises(ValueError, match="scale_inv"):
        fp8_linear_triton(x, w8, s[:, :1])


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_triton_fp8_linear_real_size_slice(device: str) -> None:
    """Kimi's hidden 7168 as K, a 256-row slice of a projection, four bf16 rows."""
    g = torch.Generator().manual_seed(4)
    w8, s = _weight(256, 7168, (128, 128), g)
    x = torch.randn(4, 7168, generator=g).to(torch.bfloat16)
    x[2] = 0.0
    ref = fp8_linear_torch(x, w8, s)
    tiles = {"block_k": 256} if device == "cpu" else {}
    got = fp8_linear_triton(x.to(device), w8.to(device), s.to(device), **tiles).cpu()
    torch.testing.assert_close(got, ref, **_tol(ref))
    assert torch.equal(got[2], torch.zeros(256, dtype=torch.bfloat16))


def test_fp8_linear_op_cpu_fake_meta_and_flops() -> None:
    g = torch.Generator().manual_seed(5)
    w8, s = _weight(130, 257, (128, 128), g)
    x = torch.randn(3, 257, generator=g)
    assert torch.equal(torch.ops.kimi.fp8_linear(x, w8, s), fp8_linear_torch(x, w8, s))
    # NOTE: opcheck's test_schema multiplies every input tensor, which CPU float8 lacks.
    torch.library.opcheck(torch.ops.kimi.fp8_linear.default, (x, w8, s, 128, 128),
                          test_utils=("test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))
    with FakeTensorMode():
        fx = torch.randn(2, 5, 257, dtype=torch.bfloat16)
        fw = torch.empty(130, 257, dtype=torch.float8_e4m3fn)
        y = torch.ops.kimi.fp8_linear(fx, fw, torch.ones(2, 3))
        assert y.shape == (2, 5, 130) and y.dtype == torch.bfloat16
        with pytest.raises(RuntimeError, match="scale_inv"):
            torch.ops.kimi.fp8_linear(fx, fw, torch.ones(2, 2))
        assert fp8_linear_torch(fx, fw, torch.ones(2, 3)).shape == (2, 5, 130)
    # Kimi's q_a_proj (1536 x 7168) for 8 x 4 rows on the meta device.
    xm = torch.empty(8, 4, 7168, dtype=torch.bfloat16, device="meta")
    wm = torch.empty(1536, 7168, dtype=torch.float8_e4m3fn, device="meta")
    sm = torch.empty(12, 56, device="meta")
    with FlopCounterMode(display=False) as fc:
        y = torch.ops.kimi.fp8_linear(xm, wm, sm)
    assert y.device.type == "meta" and y.shape == (8, 4, 1536)
    assert fc.get_total_flops() == 2 * 32 * 1536 * 7168
    assert fp8_linear_bytes(32, 1536, 7168) == 1536 * 7168 + 4 * 12 * 56 + 32 * (7168 + 1536) * 2


@needs_triton
def test_interpreter_choice_ignores_triton_interpret() -> None:
    """CPU tensors run interpreted whatever `TRITON_INTERPRET` said when triton and these
    modules were imported: run both kernels in a fresh process with the opposite setting."""
    code = textwrap.dedent("""
        import torch
        from ops.moe import experts_aligned
        from ops.moe_triton import moe_experts_triton
        from ops.quant import fp8_linear_torch, quantize_fp8_block
        from ops.quant_triton import fp8_linear_triton
        w8, s = quantize_fp8_block(torch.randn(64, 128))
        x = torch.randn(3, 128)
        torch.testing.assert_close(fp8_linear_triton(x, w8, s), fp8_linear_torch(x, w8, s))
        idx, w = torch.tensor([[0, 1], [1, 1]]), torch.rand(2, 2)
        w13, w2 = torch.randn(2, 64, 128) / 11, torch.randn(2, 128, 32) / 6
        torch.testing.assert_close(moe_experts_triton(x[:2], idx, w, w13, w2),
                                   experts_aligned(x[:2], idx, w, w13, w2))
        print("ok")
    """)
    env = dict(os.environ)
    if env.get("TRITON_INTERPRET", "0") not in ("", "0"):
        env.pop("TRITON_INTERPRET")
    else:
        env["TRITON_INTERPRET"] = "1"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")
