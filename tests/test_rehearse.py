"""`python -m graphs.plan --rehearse` on the bundled pair's configs (the engine's own prefill and
captured steps on the meta device), and `graphs.rehearse.DeviceMode`'s counts on single ops."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from graphs import plan
from graphs.rehearse import DeviceMode, RehearsalError

MODELS = Path(__file__).resolve().parent.parent / "models"
MINI = ["--model", str(MODELS / "kimi-mini"), "--draft", str(MODELS / "kimi-mini-dflash")]
PHASE_KEYS = {"name", "kind", "batch_size", "prompt_len", "chunks", "peak_bytes",
              "activation_bytes", "host_syncs", "launches"}


def _run(tmp_path: Path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "rehearsal.json"
    rc = plan.main([*MINI, *args, "--json", str(out)])
    return rc, json.loads(out.read_text())


def test_rehearsal_prefills_in_chunks_and_steps_without_syncs(tmp_path, capsys):
    rc, r = _run(tmp_path, "--rehearse", "--prompt-lens", "400,700", "--prefill-chunk", "128",
                 "--batch-sizes", "2", "--max-batch-size", "2", "--gpu-memory", "8GB")
    assert rc == 0 and r["fits"] is True
    assert isinstance(r["kv_pages"], int) and r["kv_tokens"] == (r["kv_pages"] - 1) * 16 > 0
    for p in r["phases"]:
        assert PHASE_KEYS <= set(p) and p["kind"] in ("prefill", "step")
        assert p["activation_bytes"] > 0 and p["launches"] > 0
        assert p["peak_bytes"] <= r["gpu_memory_bytes"]
    steps = [p for p in r["phases"] if p["kind"] == "step"]
    # the captured steps: no host sync inside, every sampling variant at each size
    assert all(p["host_syncs"] == 0 for p in steps)
    assert {(p["batch_size"], p["name"]) for p in steps} >= {
        (2, "step greedy"), (2, "step sampled/lagging plain"), (2, "step mixed sort")}
    pre = {p["prompt_len"]: p for p in r["phases"] if p["kind"] == "prefill"}
    assert pre[400]["chunks"] == 4 and pre[700]["chunks"] == 6
    # the chunk and one prefix chunk set a prefill's activations: the cached prefix is gathered
    # and up-projected in chunks of at most `ops.prefill.PREFIX_CHUNK_BYTES` (at this model's
    # widths, 416 bytes a key: the whole prefix here), so the longer prompt's last chunk holds
    # at most its 300 more prefix keys' rows more
    grew = pre[700]["activation_bytes"] - pre[400]["activation_bytes"]
    assert 0 <= grew <= 300 * (4 * (16 + 16) + 64 + 16) * 2 * 1.1, grew
    assert pre[700]["launches"] > pre[400]["launches"]
    # no host sync but the first token's read: a chunk's ids, pages and positions reach the
    # device through pinned memory without blocking (`engine.spec.staged`)
    assert pre[400]["readbacks"] == 1 and pre[400]["host_syncs"] == 0
    assert not pre[400]["sync_ops"]
    out = capsys.readouterr().out
    assert "prefill 700" in out and "fits               yes" in out
    # the same weights as the memory table's
    rc, m = _run(tmp_path, "--prefill-chunk", "128", "--max-batch-size", "2")
    assert rc == 0 and m["weight_bytes_per_rank"] == r["weight_bytes"] > 0


def test_rehearsal_fails_when_memory_is_short(tmp_path, capsys):
    """Without room for one context the engine's own error names the knobs; with the pool
    forced (`--kv-pages`) a phase that needs more than the GPU holds fails it."""
    rc, r = _run(tmp_path, "--rehearse", "--prompt-lens", "100", "--prefill-chunk", "64",
                 "--batch-sizes", "1", "--max-batch-size", "1", "--gpu-memory", "2GB")
    assert rc == 1 and r["fits"] is False and r["phases"] == []
    err = capsys.readouterr().err
    assert "--max-model-len" in err and "--tp" in err and "--gpu-memory-utilization" in err
    rc, r = _run(tmp_path, "--rehearse", "--prompt-lens", "100,3000", "--prefill-chunk", "64",
                 "--batch-sizes", "1", "--max-batch-size", "1", "--gpu-memory", "1.08GB",
                 "--kv-pages", "100")
    assert rc == 1 and r["fits"] is False and r["kv_pages"] == 100
    assert any(p["peak_bytes"] > r["gpu_memory_bytes"] for p in r["phases"])
    # the scheduler refuses a prompt the pool cannot hold, as it would in the engine
    assert [p["prompt_len"] for p in r["phases"] if p["kind"] == "prefill"] == [100]
    assert len(r["rejected"]) == 1 and "3,000-token prompt" in r["rejected"][0]
    assert "fits               no" in capsys.readouterr().out


def _meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_device_mode_counts_storage_while_any_view_holds_it():
    mode = DeviceMode()
    x = _meta(1000)
    with mode.phase() as t:
        a = x + 1  # 4000 bytes
        v = a.view(10, 100)
        del a
        b = v * 2  # the view keeps a's storage alive: 8000 live
        del v, b
        c = x.sum()
    assert t.activation_bytes == 8000 and mode.live == 4
    assert t.launches == 3 and t.host_syncs == 0  # add, mul, sum; no view or allocation
    del c
    assert mode.live == 0


def test_device_mode_answers_host_syncs_with_stand_ins():
    mode = DeviceMode()
    x, ids = _meta(6, 4), _meta(12, dtype=torch.int64)
    with mode.phase() as t:
        assert x.sum().item() == 0.0
        assert int(ids[0]) == 0 and bool(ids.sum()) is False
        assert x[x[:, 0] > 0].shape == (6, 4)  # every mask element true: the upper bound
        assert x.nonzero().shape == (24, 2)
        assert x.cpu().device.type == "cpu"
        # counts spread evenly over the bins: routing that reaches every expert
        assert torch.bincount(ids, minlength=5).tolist() == [3, 3, 2, 2, 2]
        assert ids.repeat_interleave(ids).shape == (12,)
    assert t.syncs == {"_local_scalar_dense": 3, "index": 1, "nonzero": 1, "_to_copy": 2,
                       "bincount": 1, "repeat_interleave": 1}


def test_device_mode_refuses_what_a_cuda_kernel_refuses():
    with DeviceMode().phase(), pytest.raises(RehearsalError, match="host tensor"):
        _meta(4, 4) @ torch.ones(4, 2)


def test_device_mode_cache_gives_what_the_kernels_give():
    mode = DeviceMode()
    x = _meta(8, 3)
    with mode.phase():
        first = (x.t() @ x, torch.topk(x, 2), x.add_(1))
        again = (x.t() @ x, torch.topk(x, 2), x.add_(1))
    assert len(mode.cache) == 3
    assert first[0].shape == again[0].shape == (3, 3)
    assert [v.shape for v in again[1]] == [(8, 2), (8, 2)]
    assert again[1][1].dtype == torch.int64 and again[2] is x


def test_a_frozen_phase_leaves_the_heap_as_it_found_it():
    """`frozen_heap` freezes what is alive on entry (after collecting the garbage there is)
    and unfreezes it after; a heap a caller froze (the server's after start-up, this test
    session's after collection) stays frozen, and so does what joined it inside."""
    import gc

    from engine.heap import freeze_heap, frozen_heap

    was = gc.get_freeze_count()
    gc.unfreeze()
    try:
        with frozen_heap():
            inside = gc.get_freeze_count()
            assert inside > 0
        assert gc.get_freeze_count() == 0
        freeze_heap()
        outer = gc.get_freeze_count()
        alive = [[] for _ in range(1000)]  # noqa: F841 (alive on entry below)
        with frozen_heap():
            assert gc.get_freeze_count() >= outer + 1000
        assert gc.get_freeze_count() >= outer + 1000
    finally:
        freeze_heap()
        assert gc.get_freeze_count() >= was
