"""The GPU path, checked on the CPU: which flashinfer MLA backend plans the prefix pass (the rules
of flashinfer 0.7.4, read from its source), `FlashInferMLAPrefix` against a fake flashinfer
(keyword plan/run, host-only metadata), and NVML's lookup by PCI bus id against a fake pynvml
(bench/gpu_check.sh has tests/test_gpu_check.py)."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from engine.attention import FlashInferBackend, TorchBackend
from graphs import telemetry
from ops.attention_gpu import (
    FA_MAX_WORK_ITEMS,
    FlashInferMLAPrefix,
    MLADevice,
    MLAUnsupportedError,
    auto_order,
    fa_shared_bytes,
    fa_work_items_bound,
    mla_backend,
    mla_backend_rejections,
    mla_unsupported_reason,
    mla_workspace_bytes,
)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
H200 = MLADevice((9, 0), "13.0", 132, 233472, 232448)
B200 = MLADevice((10, 0), "13.0", 148, 233472, 232448)

# ---- which backend (flashinfer 0.7.4's rules) ----------------------------------------------------


@pytest.mark.parametrize(("rank", "rope", "dtype", "sm", "want"), [
    (64, 16, FP32, 90, None),  # the bundled model, fp32: widths and dtype fail everywhere
    (64, 16, BF16, 90, None),  # the bundled model in bf16: widths still fail
    (64, 16, BF16, 100, None),
    (512, 64, BF16, 90, "fa3"),  # Kimi on Hopper
    (512, 64, FP16, (9, 0), "fa3"),
    (512, 64, BF16, 100, "fa2"),  # Blackwell: trtllm-gen/cute-dsl cannot take our contract
    (512, 64, BF16, 103, "fa2"),
    (512, 64, BF16, 80, "fa2"),
    (512, 64, BF16, 86, "fa2"),  # 100 KB shared memory: fa2's 1-stage, 16-row KV tile fits
    (512, 64, BF16, 120, "fa2"),
    (512, 64, FP32, 90, None),  # fp32 Kimi: no backend takes fp32 queries
    (512, 64, FP32, 100, None),
    (512, 64, BF16, 75, None),  # Turing: fa2 needs SM80
    (384, 64, BF16, 90, "fa2"),  # % 128 but not a fa3 width
    (128, 0, BF16, 90, "fa3"),  # rope 0 is a multiple of 64
    (512, 32, BF16, 90, None),
    (1024, 64, BF16, 90, None),  # fa3 width list; fa2 shared memory (288 KB > 227 KB)
])
def test_mla_backend_follows_flashinfer(rank, rope, dtype, sm, want):
    assert mla_backend(rank, rope, dtype, sm) == want
    reason = mla_unsupported_reason(rank, rope, dtype, sm)
    assert (reason is None) == (want is not None)


def test_auto_never_picks_a_backend_whose_constraints_fail():
    """Over a grid of widths, dtypes and GPUs: the pick passes every rule, every candidate tried
    before it fails one, and a named backend is strict (itself or nothing)."""
    for sm in (75, 80, 86, 89, 90, 100, 103, 107, 110, 120, 121, H200, B200):
        for rank in (64, 128, 256, 384, 512, 1024):
            for rope in (0, 16, 32, 64, 128):
                for dtype in (FP32, FP16, BF16, torch.float8_e4m3fn):
                    got = mla_backend_rejections(rank, rope, dtype, sm, num_heads=64,
                                                 num_queries=17, batch_size=32)
                    pick = mla_backend(rank, rope, dtype, sm, num_heads=64, num_queries=17,
                                       batch_size=32)
                    names = list(got)
                    if pick is None:
                        assert all(got.values())
                        continue
                    assert pick in ("fa2", "fa3") and got[pick] == []
                    assert all(got[n] for n in names[:names.index(pick)])
                    for name in names:
                        strict = mla_backend(rank, rope, dtype, sm, backend=name)
                        assert strict == (name if not got[name] else None)


def test_rejections_name_the_failed_constraints():
    rej = mla_backend_rejections(64, 16, FP32, 90)
    assert list(rej)[:2] == ["fa3", "fa2"]  # SM90: fa3 first, then fa2 (flashinfer's order)
    fa2 = " ".join(rej["fa2"])
    assert "fp16/bf16" in fa2 and "% 128" in fa2 and "64/16" in fa2
    assert any("(128, 256, 512)" in r for r in rej["fa3"])
    assert any("SM100" in r for r in rej["trtllm-gen"])
    assert any("SM12x" in r for r in rej["xqa"])
    reason = mla_unsupported_reason(64, 16, FP32, 90)
    assert reason is not None and "kv_lora_rank 64, rope 16" in reason and "fa3:" in reason
    # SM90 with a CUDA older than 12.3 is not "sm90a": flashinfer falls back to fa2
    old = MLADevice((9, 0), "12.2")
    assert mla_backend(512, 64, BF16, old) == "fa2"
    assert any("CUDA >= 12.3" in r for r in mla_backend_rejections(512, 64, BF16, old)["fa3"])


def test_auto_order_is_flashinfers():
    assert auto_order(MLADevice((9, 0)))[:2] == ("fa3", "fa2")
    assert auto_order(MLADevice((8, 0)))[0] == "fa2"
    assert auto_order(MLADevice((12, 0)))[:3] == ("fa2", "xqa", "cutile")
    for sm in ((9, 0), (10, 0), (12, 0), (7, 5)):
        order = auto_order(MLADevice(sm))
        assert len(order) == len(set(order)) == 9


def test_shared_memory_and_work_items():
    assert fa_shared_bytes("fa2", 512, 64, 233472) == 221728  # 2 stages of 64 rows
    assert fa_shared_bytes("fa3", 512, 64, 233472) == 222048
    assert fa_shared_bytes("fa2", 512, 64, 102400) == 92704  # 1 stage of 16 rows
    assert fa_shared_bytes("fa2", 512, 64, 65536) == -1
    assert mla_backend(512, 64, BF16, MLADevice((8, 9), None, None, 65536, 65536)) is None
    # 64 heads x 64 queries -> 32 tiles of 128 per request; + 66 clusters on 132 SMs
    assert fa_work_items_bound(256, 64, 64, 132) == 256 * 32 + 66
    assert fa_work_items_bound(1, 1, 16, 132) == 1 + 132  # 16 packed rows: cluster 1
    big = dict(num_heads=64, num_queries=64, batch_size=512)
    assert fa_work_items_bound(512, 64, 64, 132) > FA_MAX_WORK_ITEMS
    assert mla_backend(512, 64, BF16, H200, **big) is None
    assert "work items" in mla_unsupported_reason(512, 64, BF16, H200, **big)
    assert mla_backend(512, 64, BF16, H200, **{**big, "batch_size": 256}) == "fa3"
    assert mla_backend(512, 64, BF16, 90, **big) == "fa3"  # no SM count: not checked


def test_workspace_is_sized_from_the_plan_not_128_mib():
    exact = 2 * 132 * 64 * (2 * 512 + 4)  # scheduler.cuh: partial_o (bf16) + partial_lse (fp32)
    ws = mla_workspace_bytes(512, 132)
    assert exact <= ws < exact + (1 << 20) and ws % (1 << 20) == 0
    assert 16 << 20 < ws <= 17 << 20  # about 17 MB, not 128 MiB
    assert mla_backend(512, 64, BF16, H200, workspace_bytes=ws) == "fa3"
    assert mla_backend(512, 64, BF16, H200, workspace_bytes=exact - 1) is None
    assert mla_workspace_bytes(512, 148) > ws  # B200 has more SMs


# ---- FlashInferMLAPrefix against a fake flashinfer ----------------------------------------------


class _FakeWrapper:
    made: list[_FakeWrapper] = []

    def __init__(self, *args, **kwargs):
        self.init_args, self.init = args, kwargs
        self.plans: list[tuple[tuple, dict]] = []
        self.runs: list[tuple[tuple, dict]] = []
        _FakeWrapper.made.append(self)

    def plan(self, *args, **kwargs):
        self.plans.append((args, kwargs))

    def run(self, *args, **kwargs):
        self.runs.append((args, kwargs))
        qn, _ = kwargs["query"]
        return torch.ones_like(qn), torch.full(qn.shape[:2], 2.0)


class _Metadata(SimpleNamespace):
    @classmethod
    def csr(cls, qo_indptr, kv_indptr, kv_indices, kv_len_arr):
        return cls(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
                   kv_len_arr=kv_len_arr)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    mla = types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper = _FakeWrapper
    mla.MLAPlanMetadata = _Metadata
    fi = types.ModuleType("flashinfer")
    fi.__version__ = "0.7.4"
    fi.mla = mla
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)
    _FakeWrapper.made = []
    return _FakeWrapper


def _prefix(bs=3, Q=5, W=4, ps=16, H=8, R=512, P=64, dtype=BF16, facts=H200, **kw):
    return FlashInferMLAPrefix(bs, Q, W, ps, H, R, P, 192 ** -0.5, dtype, device="cpu",
                               device_facts=facts, **kw)


def test_prefix_kernel_picks_the_backend_and_sizes_the_workspace(fake_flashinfer):
    fi = _prefix()
    (w,) = fake_flashinfer.made
    assert fi.backend == "fa3" and w.init["backend"] == "fa3" and w.init["use_cuda_graph"]
    assert w.init_args == () and w.init["float_workspace_buffer"] is fi.workspace
    assert fi.workspace.numel() == mla_workspace_bytes(512, 132)
    assert _prefix(facts=B200).backend == "fa2"
    shared = torch.empty(mla_workspace_bytes(512, 132), dtype=torch.uint8)
    assert _prefix(workspace=shared).workspace is shared


@pytest.mark.parametrize(("R", "P", "dtype"), [(64, 16, FP32), (64, 16, BF16), (512, 64, FP32)])
def test_prefix_kernel_refuses_before_building_anything(fake_flashinfer, R, P, dtype):
    with pytest.raises(MLAUnsupportedError, match="no flashinfer MLA backend"):
        _prefix(R=R, P=P, dtype=dtype)
    assert fake_flashinfer.made == []
    with pytest.raises(MLAUnsupportedError, match="fa3:"):  # a named backend stays strict
        _prefix(facts=B200, backend="fa3")


def test_plan_hands_flashinfer_host_int32_metadata_by_keyword(fake_flashinfer):
    fi = _prefix()
    pt = torch.tensor([[7, 8, 9, 1], [0, 0, 0, 0], [3, 4, 5, 6]], dtype=torch.int64)
    ctx = torch.tensor([20, 0, 64], dtype=torch.int64)  # row 1: padding on the dummy page
    FlashInferBackend({(3, 5): fi}, TorchBackend()).plan(pt, ctx, 5)  # the engine's planning
    ((args, kw),) = fi.wrapper.plans
    assert args == ()  # 0.7.4 deprecates positional plan() arguments
    md = kw.pop("metadata")
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr"):
        t = getattr(md, name)
        assert t.device.type == "cpu" and t.dtype == torch.int32 and t.is_contiguous(), name
    assert md.qo_indptr.tolist() == [0, 5, 10, 15]
    assert md.kv_len_arr.tolist() == [20, 1, 64]
    assert md.kv_indptr.tolist() == [0, 2, 3, 7]
    assert md.kv_indices.tolist() == [7, 8, 0, 3, 4, 5, 6]
    assert kw == dict(num_heads=8, head_dim_ckv=512, head_dim_kpe=64, page_size=16,
                      causal=False, sm_scale=192 ** -0.5, q_data_type=BF16, kv_data_type=BF16,
                      query_layout="split", kv_cache_layout="split", lse_mode="basee")
    assert type(kw["sm_scale"]) is float
    with pytest.raises(ValueError, match="host copies"):  # a device tensor would sync
        fi.plan(pt.to("meta"), ctx)
    with pytest.raises(ValueError, match="pages"):
        fi.plan(pt, torch.tensor([20, 0, 65]))


def test_run_passes_structural_inputs_and_natural_log_lse(fake_flashinfer):
    bs, Q, H, R, P, ps = 3, 5, 8, 512, 64, 16
    fi = _prefix(bs=bs, Q=Q, H=H, R=R, P=P, ps=ps)
    kv = torch.randn(10 * ps, R + P)
    q_lat, q_pe = torch.randn(bs, Q, H, R), torch.randn(bs, Q, H, P)
    o, lse = fi(q_lat, q_pe, kv, torch.tensor([4, 0, 9]))
    ((args, kw),) = fi.wrapper.runs
    assert args == () and kw["return_lse"] and kw["return_lse_base_on_e"]
    qn, qp = kw["query"]
    ckv, kpe = kw["kv_cache"]
    assert qn.shape == (bs * Q, H, R) and qp.shape == (bs * Q, H, P) and qn.dtype == BF16
    assert ckv.shape == (10, ps, R) and kpe.shape == (10, ps, P)
    assert ckv.data_ptr() == kv.data_ptr()  # views of the cache, no copy
    assert o.shape == (bs, Q, H, R) and o.dtype == torch.float32
    assert (o[1] == 0).all() and (o[0] == 1).all()
    assert torch.isneginf(lse[1]).all() and (lse[[0, 2]] == 2.0).all()  # no base-2 rescale


# ---- NVML by PCI bus id --------------------------------------------------------------------------


class _NVMLError(Exception):
    pass


def _fake_pynvml(*, init_error=None, pci_error=None, with_pci=True):
    calls = []
    m = types.ModuleType("pynvml")

    def init():
        if init_error:
            raise init_error

    def by_index(i):
        calls.append(("index", i))
        return f"handle-index-{i}"

    def by_pci(bus):
        calls.append(("pci", bus))
        if pci_error:
            raise pci_error
        return f"handle-{bus}"

    m.nvmlInit, m.nvmlShutdown = init, lambda: calls.append(("shutdown",))
    m.nvmlDeviceGetHandleByIndex = by_index
    if with_pci:  # nvidia-ml-py's name; it calls nvmlDeviceGetHandleByPciBusId_v2
        m.nvmlDeviceGetHandleByPciBusId = by_pci
    return m, calls


def _props(monkeypatch, **pci):
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(name="H200", major=9, minor=0, **pci))


def test_nvml_finds_the_device_by_pci_bus_id(monkeypatch):
    nvml, calls = _fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    _props(monkeypatch, pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0)
    tel = telemetry.Telemetry(1)
    assert tel.available and tel.handle == "handle-0000:3b:00.0"
    assert calls == [("pci", "0000:3b:00.0")] and tel.lookup == "PCI bus id 0000:3b:00.0"


@pytest.mark.parametrize("case", ["no pci in torch", "not found", "no cuda", "old binding"])
def test_nvml_falls_back_to_the_index_with_a_note(monkeypatch, case):
    nvml, calls = _fake_pynvml(pci_error=_NVMLError("Not Found") if case == "not found" else None,
                               with_pci=case != "old binding")
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    if case == "no pci in torch":
        _props(monkeypatch)
    elif case == "no cuda":
        def no_cuda(i):
            raise AssertionError("Torch not compiled with CUDA enabled")
        monkeypatch.setattr(torch.cuda, "get_device_properties", no_cuda)
    else:
        _props(monkeypatch, pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0)
    tel = telemetry.Telemetry(2)
    assert tel.available and tel.handle == "handle-index-2" and calls[-1] == ("index", 2)
    assert tel.lookup.startswith("NVML index 2 (") and "order devices differently" in tel.lookup
    assert {"no pci in torch": "no PCI bus id", "not found": "Not Found",
            "no cuda": "not compiled", "old binding": "no nvmlDeviceGetHandleByPciBusId"}[
        case] in tel.lookup


def test_nvml_without_a_driver_reports_no_telemetry(monkeypatch):
    nvml, _ = _fake_pynvml(init_error=_NVMLError("Driver Not Loaded"))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    tel = telemetry.Telemetry(0)
    assert not tel.available and "no GPU telemetry" in tel.reason
    assert tel.static() == {"telemetry": tel.reason}
