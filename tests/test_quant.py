from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from engine.models.layers import ExpertBank
from ops.moe import experts_aligned_w4a16
from ops.quant import dequant_fp8_block, dequant_int4, pack_int4, quantize_fp8_block


def _pack_reference(q: torch.Tensor) -> torch.Tensor:
    """Pack q [out, in] (in % 8 == 0, values in [-8, 7]) with plain Python integers: eight
    nibbles per word, lowest first, each q + 8, read back as a two's-complement int32."""
    rows = []
    for row in q.tolist():
        words = []
        for k in range(0, len(row), 8):
            v = 0
            for i, x in enumerate(row[k : k + 8]):
                v |= (x + 8) << (4 * i)
            words.append(v - (1 << 32) if v >= 1 << 31 else v)
        rows.append(words)
    return torch.tensor(rows, dtype=torch.int32)


def _scale_cols(scale: torch.Tensor, group: int, cols: int) -> torch.Tensor:
    return scale.float()[:, torch.arange(cols) // group]


def test_dequant_int4_matches_independent_packing() -> None:
    g = torch.Generator().manual_seed(0)
    out_f, in_f = 6, 72  # 9 words per row; 3 groups, the last one partial
    q = torch.randint(-8, 8, (out_f, in_f), generator=g)
    q[:, 7::8] = torch.randint(0, 8, (out_f, in_f // 8), generator=g)  # top nibble >= 8
    q[0, :8] = -8  # all-zero codes
    q[1, :8] = 7  # all-ones word: -1 as int32
    packed = _pack_reference(q)
    assert (packed < 0).sum() > out_f  # the sign-bit path is really exercised
    assert packed[1, 0].item() == -1
    scale = (torch.rand(out_f, 3, generator=g) + 0.1).to(torch.bfloat16)
    got = dequant_int4(packed, scale, (out_f, in_f), group_size=32)
    want = q.float() * _scale_cols(scale, 32, in_f)
    assert got.dtype == torch.float32 and got.shape == (out_f, in_f)
    assert torch.equal(got, want)
    # weight_shape as stored in checkpoints (an int32 tensor) and an output dtype.
    got16 = dequant_int4(packed, scale, torch.tensor([out_f, in_f], dtype=torch.int32),
                         dtype=torch.bfloat16)
    assert got16.dtype == torch.bfloat16 and torch.equal(got16, want.to(torch.bfloat16))


def test_pack_int4_exact_on_grid() -> None:
    g = torch.Generator().manual_seed(1)
    out_f, in_f = 5, 64
    q = torch.randint(-7, 8, (out_f, in_f), generator=g)
    q[:, ::32] = 7 * torch.where(torch.rand(out_f, 2, generator=g) < 0.5, -1, 1)  # max|q| = 7
    s = (torch.rand(out_f, 2, generator=g) + 0.01).to(torch.bfloat16)
    w = q.float() * _scale_cols(s, 32, in_f)
    packed, scale, shape = pack_int4(w, group_size=32)
    assert packed.dtype == torch.int32 and packed.shape == (out_f, in_f // 8)
    assert scale.dtype == torch.bfloat16 and torch.equal(scale, s)
    assert shape.tolist() == [out_f, in_f] and shape.dtype == torch.int32
    assert torch.equal(packed, _pack_reference(q))
    assert torch.equal(dequant_int4(packed, scale, shape), w)


def test_pack_int4_close_for_random_weights() -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(7, 96, generator=g)
    w[3] = 0.0  # an all-zero row must not divide by zero
    packed, scale, shape = pack_int4(w, group_size=32)
    back = dequant_int4(packed, scale, shape)
    step = _scale_cols(scale, 32, 96)
    assert torch.all((back - w).abs() <= 0.5 * step * 1.001 + 1e-7)
    assert torch.equal(back[3], torch.zeros(96))
    # Groups really are per 32 input columns: the scale is each group's max|w| / 7.
    amax = w.view(7, 3, 32).abs().amax(-1)
    torch.testing.assert_close(scale.float(), torch.where(amax > 0, amax / 7, 1.0),
                               rtol=2**-8, atol=0)


def _fp8_reference(w: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    out = torch.empty(w.shape, dtype=torch.float32)
    b0, b1 = block
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1].float()
            out[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1] = blk * s[i, j]
    return out


@pytest.mark.parametrize(("shape", "block"), [((130, 257), (128, 128)), ((37, 70), (16, 32)),
                                              ((128, 256), (128, 128))])
def test_dequant_fp8_block_matches_loop(shape: tuple[int, int], block: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(shape, generator=g) * 50).to(torch.float8_e4m3fn)
    s = torch.rand(-(-shape[0] // block[0]), -(-shape[1] // block[1]), generator=g) + 0.01
    got = dequant_fp8_block(w, s, block)
    assert torch.equal(got, _fp8_reference(w, s, block))
    assert dequant_fp8_block(w, s, block, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_dequant_fp8_block_rejects_wrong_scale_shape() -> None:
    w = torch.zeros(130, 10).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"\(1, 1\).*\(2, 1\)"):
        dequant_fp8_block(w, torch.ones(1, 1))


def test_quantize_fp8_block_roundtrip() -> None:
    g = torch.Generator().manual_seed(4)
    w = torch.randn(140, 200, generator=g)
    w[128:, :128] *= 1000.0  # blocks need their own scales
    w[:128, 128:] = 0.0
    w8, scale_inv = quantize_fp8_block(w, (128, 128))
    assert w8.dtype == torch.float8_e4m3fn and scale_inv.dtype == torch.float32
    assert scale_inv.shape == (2, 2) and scale_inv[0, 1] == 1.0
    back = dequant_fp8_block(w8, scale_inv, (128, 128))
    step = _fp8_reference(torch.ones(140, 200), scale_inv, (128, 128))
    # e4m3 keeps 3 mantissa bits (relative error <= 1/16); near zero, subnormal spacing 2^-9.
    assert torch.all((back - w).abs() <= w.abs() / 16 + step * 2**-9)
    assert back[128:, :128].abs().max() == w[128:, :128].abs().max()  # amax maps to 448 exactly


class _HostData(TorchDispatchMode):
    """Under `FakeTensorMode`, records each op that takes a real (not fake) tensor: data built
    on the host (`torch.tensor` of a Python list), which a GPU run copies in on every call."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = [*args, *kwargs.values()]
        if any(isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) for t in leaves):
            self.ops.append(str(func))
        return func(*args, **kwargs)


def test_host_data_detector_sees_a_host_built_constant() -> None:
    with FakeTensorMode(), _HostData() as host:
        x = torch.zeros(4, dtype=torch.int32)
        _ = x >> torch.tensor((0, 4, 8, 12), dtype=torch.int32)
    assert host.ops


@pytest.mark.parametrize("tokens", [1, 999, 8192])
def test_aligned_int4_expert_pass_needs_nothing_from_the_host(tokens: int) -> None:
    """The aligned expert pass over an INT4 bank (the step's, and prefill's off the CPU) at any
    token count (a prefill chunk of 8192, odd sizes): on fake tensors, which refuse host syncs
    and data-dependent shapes, through the bank (`kimi::moe_experts_w4a16`), its torch twin
    and the per-expert dequantization, with no constant built on the host."""
    E, H, inter, k = 8, 64, 32, 4
    with FakeTensorMode(), _HostData() as host:
        bank = ExpertBank(E, H, inter, fmt="int4")
        x = torch.randn(tokens, H, dtype=torch.bfloat16)
        idx, w = torch.randint(0, E, (tokens, k)), torch.rand(tokens, k)
        y = bank(x, idx, w, mode="aligned")
        twin = experts_aligned_w4a16(x, idx, w, bank.w13_packed, bank.w13_scale,
                                     bank.w2_packed, bank.w2_scale, bank.group)
        w13, w2 = bank.weights(idx[0], torch.bfloat16)
        whole = dequant_int4(bank.w2_packed[0], bank.w2_scale[0], (H, inter))
    assert y.shape == twin.shape == (tokens, H) and y.dtype == twin.dtype == torch.bfloat16
    assert w13.shape == (k, 2 * inter, H) and w2.shape == (k, H, inter)
    assert whole.shape == (H, inter) and whole.dtype == torch.float32
    assert host.ops == []
