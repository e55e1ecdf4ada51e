"""GPU checks (skipped without CUDA) on a tiny fp32 pair, with the attention backend the engine
picks there (`--attention auto`: the paged Triton kernels): graph replay equals the eager step
for every captured size in every mode, no host sync inside the captured region, and the
flashinfer twins equal the torch functions. The path that ships (bf16, INT4 experts, Kimi's
attention widths) is tests/test_shipping_path.py's."""

from __future__ import annotations

import pytest
import torch

from engine.scheduler import step_inputs
from engine.spec import StepShape, slot_of
from ops.attention_gpu import flashinfer_unavailable
from tests.graph_helpers import (
    BLOCK,
    PAGE,
    clone_pool,
    fresh_copies,
    load_models,
    make_pool,
    mixed_params,
    prefilled,
    random_prompts,
    replay_against_eager,
    request_slots,
    runner_for,
    step,
    write_pair,
)

pytestmark = pytest.mark.cuda
SIZES = [1, 2, 4, 8]
ULPS = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return load_models(*write_pair(tmp_path_factory.mktemp("graphs_cuda")), device="cuda")


def _need_flashinfer() -> None:
    why = flashinfer_unavailable()
    if why is not None:
        pytest.skip(f"{why}; flashinfer-python is not carried to the GPU check (a 101 MB wheel "
                    f"plus about 55 MB of dependencies)")


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sample"])
@pytest.mark.parametrize("mode", ["tree", "chain", "ar"])
def test_replay_equals_eager_for_every_size(models, mode, sample):
    """Every real batch size from 1 to the largest captured one (so every padded size too):
    the replayed graph and the eager step over the same loaded buffers emit the same tokens
    and write the same cache rows (sampling: the same coins, loaded once)."""
    shape = StepShape(mode, 6, BLOCK, False)
    pool = make_pool(models, num_pages=1 + 8 * 24, device="cuda")
    runner = runner_for(models, pool, shape, SIZES, attention="auto")
    assert runner.use_graphs
    runner.capture(progress=False)
    assert set(runner.graphs) == {(bs, s) for bs in SIZES for s in runner.shapes_of(bs)}
    for b in range(1, max(SIZES) + 1):
        reqs = prefilled(models, pool, shape, random_prompts(b), mixed_params(b, sample))
        (emit, accept, after), (emit_ref, accept_ref, ref) = replay_against_eager(runner, reqs)
        assert torch.equal(emit, emit_ref) and torch.equal(accept, accept_ref), (mode, b)
        real = request_slots(reqs, PAGE).cuda()
        torch.testing.assert_close(after.target[:, real], ref.target[:, real], **ULPS)
        torch.testing.assert_close(after.draft[:, real], ref.draft[:, real], **ULPS)
        pool.target.zero_()  # the next batch size prefills onto the same pages
        pool.draft.zero_()


def test_replay_has_no_host_sync(models):
    shape = StepShape("tree", 6, BLOCK, False)
    pool = make_pool(models, num_pages=1 + 4 * 24, device="cuda")
    runner = runner_for(models, pool, shape, [1, 4], attention="auto")
    runner.capture(progress=False)
    reqs = prefilled(models, pool, shape, random_prompts(3), mixed_params(3, True))
    buf, shp, _ = runner.load(step_inputs(reqs, runner.coins_per_row(len(reqs))))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            runner.graphs[(4, shp)].replay()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert (buf.accept_len[:3] >= 0).all()


def test_runner_step_on_graphs_matches_eager_runner(models):
    """The runner's public step: graphs (full page-table width) against the eager runner
    (trimmed width), greedy, over several steps."""
    shape = StepShape("tree", 6, BLOCK, False)
    pool = make_pool(models, num_pages=1 + 4 * 24, device="cuda")
    reqs = prefilled(models, pool, shape, random_prompts(3), mixed_params(3, False), steps=4)
    base = clone_pool(pool)
    outs = []
    for use_graphs in (False, True):
        pool.target.copy_(base.target)
        pool.draft.copy_(base.draft)
        runner = runner_for(models, pool, shape, [1, 2, 4], attention="auto",
                            use_graphs=use_graphs)
        runner.capture(progress=False)
        rs = fresh_copies(reqs)
        steps = []
        for _ in range(4):
            emitted, _ = step(runner, rs, apply=True)
            steps.append(emitted)
        outs.append(steps)
    assert outs[0] == outs[1]


# ---- flashinfer twins -------------------------------------------------------------------------


MLA_SCALE = 192 ** -0.5


def _planned_prefix(bs=5, Q=7, H=16, R=512, P=64, ps=16, num_pages=64, dtype=torch.bfloat16):
    """A flashinfer MLA prefix kernel planned over a random paged cache (row 2 is padding on the
    dummy page), its inputs, and the slots its torch twin reads."""
    _need_flashinfer()
    from ops.attention_gpu import FlashInferMLAPrefix

    g = torch.Generator(device="cuda").manual_seed(0)
    kv = torch.randn(num_pages * ps, R + P, device="cuda", generator=g).to(dtype)
    q_lat = (torch.randn(bs, Q, H, R, device="cuda", generator=g) * 0.05).to(dtype)
    q_pe = (torch.randn(bs, Q, H, P, device="cuda", generator=g) * 0.05).to(dtype)
    ctx = torch.tensor([1, 40, 0, 17, 100][:bs], device="cuda")  # row 2: padding
    W = 8
    perm = torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(1)) + 1
    pt = perm[: bs * W].view(bs, W).cuda()
    pt[2] = 0  # the dummy page
    fi = FlashInferMLAPrefix(bs, Q, W, ps, H, R, P, MLA_SCALE, dtype)
    fi.plan(pt.cpu(), ctx.cpu())
    slots = slot_of(pt, torch.arange(W * ps, device="cuda")[None].expand(bs, -1), ps)
    return fi, q_lat, q_pe, kv, ctx, pt, slots, R


def test_flashinfer_prefix_equals_torch_twin():
    from ops.attention import prefix_attention

    fi, q_lat, q_pe, kv, ctx, _, slots, R = _planned_prefix()
    o, lse = fi(q_lat, q_pe, kv, ctx)
    o_ref, lse_ref = prefix_attention(q_lat, q_pe, kv, slots, ctx, R, MLA_SCALE)
    torch.testing.assert_close(o, o_ref, rtol=2e-2, atol=2e-2)
    live = ctx > 0
    torch.testing.assert_close(lse[live], lse_ref[live], rtol=1e-2, atol=1e-2)
    assert torch.isneginf(lse[~live]).all() and (o[~live] == 0).all()


def test_flashinfer_prefix_replans_under_a_graph():
    from ops.attention import prefix_attention

    fi, q_lat, q_pe, kv, ctx, pt, slots, R = _planned_prefix()
    fi(q_lat, q_pe, kv, ctx)  # eager once first: JIT load, function attributes
    ctx_buf = ctx.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fi(q_lat, q_pe, kv, ctx_buf)
    for lens in ([5, 3, 0, 100, 1], [128, 64, 0, 2, 77]):
        new = torch.tensor(lens, device="cuda")
        ctx_buf.copy_(new)
        fi.plan(pt.cpu(), new.cpu())  # host side, outside the graph
        g.replay()
        o_ref, _ = prefix_attention(q_lat, q_pe, kv, slots, new, R, MLA_SCALE)
        torch.testing.assert_close(out[0], o_ref, rtol=2e-2, atol=2e-2)


def test_flashinfer_merge_equals_torch_twin():
    _need_flashinfer()
    from ops.attention import merge_states
    from ops.attention_gpu import merge_states_flashinfer

    g = torch.Generator(device="cuda").manual_seed(2)
    o1, o2 = (torch.randn(3, 5, 8, 64, device="cuda", generator=g).to(torch.bfloat16)
              for _ in range(2))
    l1, l2 = (torch.randn(3, 5, 8, device="cuda", generator=g) * 3 for _ in range(2))
    l1[0] = float("-inf")  # an empty prefix (padding row)
    ref = merge_states(o1.float(), l1, o2.float(), l2)
    got = merge_states_flashinfer(o1, l1, o2, l2).float()
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)


def test_flashinfer_target_probs_equal_torch_twin():
    _need_flashinfer()
    from ops.sampling import target_probs
    from ops.sampling_gpu import target_probs_flashinfer

    g = torch.Generator(device="cuda").manual_seed(3)
    logits = torch.randn(4, 6, 1000, device="cuda", generator=g) * 3
    t = torch.tensor([0.7, 1.0, 1.3, 1.0], device="cuda")
    k = torch.tensor([0, 50, 5, 1], device="cuda")
    p = torch.tensor([0.9, 1.0, 0.8, 1.0], device="cuda")
    ref = target_probs(logits, t, k, p)
    got = target_probs_flashinfer(logits, t, k, p)
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-4)


def test_flashinfer_draws_are_graph_safe():
    _need_flashinfer()
    from ops.sampling_gpu import DeviceSeed, sample_flashinfer

    probs = torch.full((4, 32), 1 / 32, device="cuda")
    rng = DeviceSeed(7)
    sample_flashinfer(probs, rng)  # eager once before capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = sample_flashinfer(probs, rng)
    draws = []
    for _ in range(50):
        g.replay()
        draws.append(out.clone())
    draws = torch.stack(draws)
    assert len({tuple(d.tolist()) for d in draws}) > 40, "each replay draws new numbers"
    assert int(draws.min()) >= 0 and int(draws.max()) < 32
