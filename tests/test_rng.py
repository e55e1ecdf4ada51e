"""Counter-based coins (ops.rng): reproducible, uniform, independent streams, graph-safe."""

from __future__ import annotations

import torch
from scipy import stats

from ops.rng import counter_uniforms
from tests.fakeguard import run_on_fake


def test_same_seed_and_counter_same_coins_whatever_the_batch():
    a = counter_uniforms(torch.tensor([5, 9]), torch.tensor([3, 0]), 16)
    b = counter_uniforms(torch.tensor([1, 5, 2]), torch.tensor([0, 3, 8]), 16)
    assert torch.equal(a[0], b[1])
    assert a.dtype == torch.float32 and a.shape == (2, 16)


def test_streams_differ_and_look_uniform():
    seeds = torch.arange(2000)
    u = counter_uniforms(seeds, torch.zeros_like(seeds), 50)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert stats.kstest(u.flatten().numpy(), "uniform").pvalue > 1e-4
    nxt = counter_uniforms(seeds, torch.ones_like(seeds), 50)
    assert not torch.equal(u, nxt)
    # neighbouring seeds and counters are not correlated
    assert abs(stats.pearsonr(u[:-1, 0].numpy(), u[1:, 0].numpy())[0]) < 0.1
    assert abs(stats.pearsonr(u[:, 0].numpy(), nxt[:, 0].numpy())[0]) < 0.1


def test_counter_uniforms_run_on_fake_tensors():
    out = run_on_fake(counter_uniforms, torch.tensor([1, 2]), torch.tensor([0, 0]), 9)
    assert tuple(out.shape) == (2, 9)


def test_gpu_twins_import_lazily():
    import ops.attention_gpu as ag
    import ops.sampling_gpu  # noqa: F401

    if not torch.cuda.is_available():
        assert not ag.flashinfer_available()
