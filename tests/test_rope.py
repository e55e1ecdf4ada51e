"""The rotary tail as one kernel (`kimi::rope_tail`, `ops.rope_triton`): the Triton kernel against
its torch twin (`ops.rope.rope_tail`, the engine's rotation before it) under Triton's
interpreter, the op's dispatch in the model and fake kernel, and what the planner charges."""

from __future__ import annotations

import pytest
import torch

from ops.rope import apply_rope_interleaved, rope_tail

try:
    from ops.rope_triton import rope_tail_triton
except ImportError:  # triton is the optional `gpu` extra
    rope_tail_triton = None

needs_triton = pytest.mark.skipif(rope_tail_triton is None, reason="needs triton")


def _angles(*lead: int, half: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(*lead, half, generator=g) * 50
    return a.cos() * 1.1, a.sin() * 1.1


def test_twin_is_the_rotation_of_the_tail():
    """`rope_tail` keeps the first `nope` channels and rotates the rest as before."""
    x = torch.randn(2, 3, 4, 12)
    cos, sin = _angles(2, 3, half=4, seed=0)
    out = rope_tail(x, cos, sin, 4)
    assert torch.equal(out[..., :4], x[..., :4])
    assert torch.equal(out[..., 4:], apply_rope_interleaved(x[..., 4:], cos, sin))
    assert torch.equal(rope_tail(x, *_angles(2, 3, half=6, seed=1), 0),
                       apply_rope_interleaved(x, *_angles(2, 3, half=6, seed=1)))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,nope,dim", [(8, 128, 192), (3, 0, 64), (20, 16, 24)])
def test_kernel_equals_twin(dtype, heads, nope, dim):
    """K2.5's query heads of a rank and its key head, and a shape with masked heads (20 over
    blocks of 16) and tails: bit for bit under the interpreter."""
    g = torch.Generator().manual_seed(heads)
    x = (torch.randn(2, 5, heads, dim, generator=g) * 3).to(dtype)
    cos, sin = _angles(2, 5, half=(dim - nope) // 2, seed=heads)
    assert torch.equal(rope_tail_triton(x, cos, sin, nope), rope_tail(x, cos, sin, nope))


@needs_triton
def test_kernel_takes_the_key_view_and_names_bad_shapes():
    """The key's rotary part is a strided view of the latent projection's rows; no tokens
    is fine; a cos of the wrong width or an odd rotary width is named."""
    kv = torch.randn(3, 7, 24).to(torch.bfloat16)
    view = kv[..., None, 16:]
    cos, sin = _angles(3, 7, half=4, seed=2)
    assert torch.equal(rope_tail_triton(view, cos, sin, 0), rope_tail(view, cos, sin, 0))
    assert rope_tail_triton(view[:, :0], cos[:, :0], sin[:, :0], 0).shape == (3, 0, 1, 8)
    with pytest.raises(ValueError, match="cos"):
        rope_tail_triton(view, cos[..., :3], sin[..., :3], 0)
    with pytest.raises(ValueError, match="even"):
        rope_tail_triton(kv[..., None, 15:], cos, sin, 0)


def test_model_takes_the_op_off_the_cpu_and_the_twin_on_it():
    """The MLA's queries and key: the twin's ops on the CPU; on the meta device (what the
    planner costs) one `kimi::rope_tail` each, charged its rows once and the angles."""
    from engine.models.kimi import _rope_tail
    from graphs.plan import CostMode
    from tests.test_norm import Ops

    x = torch.randn(2, 3, 4, 12).to(torch.bfloat16)
    cos, sin = _angles(2, 3, half=4, seed=3)
    with Ops() as cpu:
        out = _rope_tail(x, cos, sin, 4)
    assert "kimi.rope_tail" not in cpu.names and torch.equal(out, rope_tail(x, cos, sin, 4))
    xm = torch.empty(4096, 8, 192, dtype=torch.bfloat16, device="meta")
    cm = torch.empty(4096, 32, device="meta")
    cost = CostMode(0)
    with Ops() as meta:
        out = _rope_tail(xm, cm, cm, 128)
    assert meta.names == ["kimi.rope_tail"] and out.shape == xm.shape
    assert out.dtype == torch.bfloat16
    with cost:
        _rope_tail(xm, cm, cm, 128)
    assert [*cost.ops] == [("kimi.rope_tail", "bf16")]
    assert cost.bytes == 2 * 4096 * 8 * 192 * 2 + 2 * 4096 * 32 * 4
