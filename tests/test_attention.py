"""Attention backends (`engine.attention`): the registry, what `select_backend` picks and
refuses on the CPU, and what each backend hands the step."""

from __future__ import annotations

import typing
from types import SimpleNamespace

import pytest
import torch

from engine.attention import (
    BACKENDS,
    AttentionBackend,
    FlashInferBackend,
    PagedBackend,
    TorchBackend,
    options,
    select_backend,
)
from engine.config import EngineConfig
from engine.models.dflash import PagedContext
from ops.paged import table_slots
from tests.graph_helpers import PAGE, load_models, make_pool, write_pair

STEPS = [(1, 7), (2, 7), (2, 1)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return load_models(*write_pair(tmp_path_factory.mktemp("attention")))


def _select(models, want: str) -> AttentionBackend:
    return select_backend(want, models.target, make_pool(models), STEPS, max_pages=8)


def test_the_registry_lists_every_backend_in_auto_order():
    assert [b.name for b in BACKENDS] == ["flashinfer", "paged", "torch"]
    assert [b.option for b in BACKENDS] == ["flashinfer", "triton", "torch"]
    assert all(issubclass(b, AttentionBackend) for b in BACKENDS)
    # the engine's --attention choices are the registry's
    hints = typing.get_type_hints(EngineConfig)
    assert typing.get_args(hints["attention"]) == options()


def test_select_backend_on_the_cpu(models):
    assert type(_select(models, "auto")) is TorchBackend
    assert type(_select(models, "torch")) is TorchBackend
    assert type(_select(models, "triton")) is PagedBackend  # the kernels' torch twins
    with pytest.raises(ValueError, match="--attention flashinfer cannot run here: flashinfer "
                                         "needs CUDA"):
        _select(models, "flashinfer")
    with pytest.raises(ValueError, match="must be one of"):
        _select(models, "sdpa")


def test_auto_takes_the_first_backend_whose_constraints_hold(models, monkeypatch):
    """On CUDA with Triton (simulated): flashinfer's constraints fail, the paged kernels win."""
    monkeypatch.setattr(FlashInferBackend, "unavailable", classmethod(lambda cls, s: "no"))
    monkeypatch.setattr(PagedBackend, "auto", classmethod(lambda cls, s: True))
    assert type(_select(models, "auto")) is PagedBackend


def test_flashinfer_refuses_a_model_no_mla_backend_plans(models, monkeypatch):
    """On CUDA with flashinfer (faked: an H200's facts), the tiny model's widths and float32
    fail every flashinfer MLA backend: asked for, it is refused with the reason; `auto`
    goes on to the Triton kernels (or torch without Triton)."""
    import ops.attention_gpu as gpu
    from ops.custom_ops import triton_available

    monkeypatch.setattr(gpu, "flashinfer_unavailable", lambda: None)
    monkeypatch.setattr(gpu.MLADevice, "of", classmethod(
        lambda cls, dev: cls((9, 0), "13.0", 132, 233472, 232448)))
    cache = SimpleNamespace(device=torch.device("cuda"), dtype=torch.float32)
    pool = SimpleNamespace(target=cache, page_size=PAGE)
    with pytest.raises(ValueError, match="--attention flashinfer cannot run here: no flashinfer "
                                         "MLA backend .* fa3: needs fp16/bf16"):
        select_backend("flashinfer", models.target, pool, STEPS, 8)
    auto = select_backend("auto", models.target, pool, STEPS, 8)
    assert auto.name == ("paged" if triton_available() else "torch")


def test_each_backend_hands_the_step_its_context(models):
    pool = make_pool(models)
    table = torch.tensor([[3, 4, 0], [5, 0, 0]])
    ctx = torch.tensor([6, 2])
    torch_b, paged_b = TorchBackend(), PagedBackend()
    assert (torch_b.name, paged_b.name, FlashInferBackend({}, torch_b).name) == (
        "torch", "paged", "flashinfer")
    slots = torch_b.slots(table, PAGE)
    assert torch.equal(slots, table_slots(table, PAGE))
    assert torch_b.prefix(table, 7, PAGE, 0.1) is None
    kv, valid = torch_b.draft_context(pool.draft, table, ctx, PAGE, slots)
    assert kv.shape == (pool.draft.shape[0], 2, 3 * PAGE, pool.draft.shape[-1])
    assert valid.sum(1).tolist() == [6, 2]
    assert paged_b.slots(table, PAGE) is None
    assert callable(paged_b.prefix(table, 7, PAGE, 0.1))
    paged_ctx, valid = paged_b.draft_context(pool.draft, table, ctx, PAGE, None)
    assert isinstance(paged_ctx, PagedContext) and valid is None
    assert paged_ctx.attend is torch.ops.kimi.draft_context_attention


def test_flashinfer_plans_and_takes_its_planned_steps_only():
    """A planned (batch size, tree nodes) gets flashinfer's kernel, planned from the host
    copies before the step; any other step (and the drafter) takes the fallback."""
    planned = []

    class Kernel:
        def plan(self, page_table, cache_len):
            planned.append((page_table.shape[0], cache_len.tolist()))

    k = Kernel()
    fi = FlashInferBackend({(2, 7): k}, PagedBackend())
    assert fi.plans and not TorchBackend.plans and not PagedBackend.plans
    table, ctx = torch.zeros(2, 3, dtype=torch.int64), torch.tensor([4, 0])
    fi.plan(table, ctx, 7)
    fi.plan(table, ctx, 3)  # nothing planned for 3 nodes: nothing to do
    assert planned == [(2, [4, 0])]
    assert fi.prefix(table, 7, PAGE, 0.1) is k
    assert fi.prefix(table, 3, PAGE, 0.1) is not None  # the paged op
    assert fi.slots(table, PAGE) is None
    assert FlashInferBackend({}, TorchBackend()).prefix(table, 7, PAGE, 0.1) is None
