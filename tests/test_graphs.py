"""The step runner on the CPU: graph safety of the whole step (fake tensors), padded execution on
the dummy page, per-size budgets, and capture errors."""

from __future__ import annotations

import random

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

import engine.spec as spec
from engine.attention import PagedBackend, TorchBackend
from engine.config import SamplingParams
from engine.kv_cache import DUMMY_PAGE
from engine.policy import PolicyError, budgets_for_sizes, load_budgets, write_budgets
from engine.runner import CaptureError, default_capture_sizes
from engine.scheduler import step_inputs
from engine.spec import StepBuffers, StepShape, spec_step
from tests.fakeguard import run_on_fake
from tests.graph_helpers import (
    BLOCK,
    PAGE,
    changed_slots,
    clone_pool,
    fresh_copies,
    load_models,
    make_pool,
    prefilled,
    request_slots,
    run_steps,
    runner_for,
    step,
    write_pair,
)
from tests.spec_helpers import use_oracle

SHAPES = [("tree", 6), ("chain", 1), ("ar", 1)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return load_models(*write_pair(tmp_path_factory.mktemp("graphs")))


def _fake_inputs(models, shape: StepShape, bs: int = 3, width: int = 4):
    pool = make_pool(models, num_pages=16)
    buf = StepBuffers.allocate(bs, width, shape, models.target, "cpu")
    buf.cache_len.fill_(5)
    buf.page_table[:, :2] = torch.arange(1, 2 * bs + 1).view(bs, 2)
    return pool, buf


# ---- graph safety -------------------------------------------------------------------------------


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sample"])
@pytest.mark.parametrize("mode,budget", SHAPES, ids=[m for m, _ in SHAPES])
def test_whole_step_runs_on_fake_tensors(models, mode, budget, sample):
    """Drafter, build, target verify (dense MoE), decide, commit: no host sync and no
    data-dependent shape anywhere in the step, model forwards included."""
    shape = StepShape(mode, budget, BLOCK, sample)
    pool, buf = _fake_inputs(models, shape)
    run_on_fake(spec_step, models, pool, buf, shape)


@pytest.mark.parametrize("bad", ["item", "mask_index"])
def test_fake_run_catches_a_host_sync_in_the_step(models, monkeypatch, bad):
    decide = spec.decide

    def syncing_decide(logits, tree, buf, shape, rows=None):
        if bad == "item":
            _ = logits[0, 0, 0].item()  # a host sync: would break capture
        else:
            _ = logits[tree.valid]  # boolean-mask indexing: a data-dependent shape
        return decide(logits, tree, buf, shape, rows)

    monkeypatch.setattr(spec, "decide", syncing_decide)
    shape = StepShape("tree", 6, BLOCK, False)
    pool, buf = _fake_inputs(models, shape)
    with pytest.raises((DataDependentOutputException, DynamicOutputShapeException)):
        run_on_fake(spec_step, models, pool, buf, shape)


# ---- padded execution ---------------------------------------------------------------------------

ULPS = dict(rtol=1e-5, atol=1e-5)
PROMPTS = [[5, 9, 300, 41, 7, 8, 2], [17] * 13, [600, 3, 90]]


def _params(sample: bool) -> list[SamplingParams]:
    if not sample:
        return [SamplingParams(max_new_tokens=32)] * 3
    return [SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=11),
            SamplingParams(temperature=1.2, seed=12),
            SamplingParams(max_new_tokens=32)]  # a greedy row inside a sampling batch


@pytest.mark.parametrize("mode,drafter", [("tree", "random"), ("tree", "oracle"),
                                          ("chain", "oracle"), ("ar", None)])
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sample"])
def test_padding_rows_change_nothing_but_the_dummy_page(models, monkeypatch, mode, drafter,
                                                        sample):
    if drafter == "oracle":
        # deterministic and row-local: it agrees with the target's greedy chain
        use_oracle(monkeypatch, noise=0.0, demote=0.0, gap=12.0)
    shape = StepShape(mode, 6, BLOCK, sample)
    base = make_pool(models)
    reqs = prefilled(models, base, shape, PROMPTS, _params(sample))
    ref_pool = clone_pool(base)
    ref = run_steps(runner_for(models, ref_pool, shape, [3]), fresh_copies(reqs), 2, pad=False)
    real = request_slots(reqs, PAGE)
    assert ref.emitted[0][0], "the step emits at least the bonus token"
    if drafter == "oracle" and not sample:
        assert min(ref.accepted[0]) == BLOCK - 1, "the oracle's drafts are all accepted"
    for size in (4, 8, 16):
        pool = clone_pool(base)
        runner = runner_for(models, pool, shape, [size])
        assert runner.padded_size(3) == size
        got = run_steps(runner, fresh_copies(reqs), 2, pad=True)
        assert got.emitted == ref.emitted, size
        assert got.accepted == ref.accepted, size
        # the real requests' caches: equal to the unpadded run's (to a few fp32 ulps: a CPU
        # GEMM's reduction order depends on the row count, so bits may differ with the batch)
        torch.testing.assert_close(pool.target[:, real], ref_pool.target[:, real], **ULPS)
        torch.testing.assert_close(pool.draft[:, real], ref_pool.draft[:, real], **ULPS)
        # every other slot that changed is on the dummy page
        outside = changed_slots(base, pool) - set(real.tolist())
        assert all(s // PAGE == DUMMY_PAGE for s in outside), sorted(outside)[:8]
        assert outside, "padding rows commit their rows somewhere: on the dummy page"
        # padding rows stayed padding rows
        buf = runner.buffers[size]
        assert (buf.page_table[3:] == DUMMY_PAGE).all() and (buf.cache_len[3:] == 0).all()


def test_eager_runner_uses_static_buffers(models):
    shape = StepShape("tree", 6, BLOCK, False)
    pool = make_pool(models)
    runner = runner_for(models, pool, shape, [2, 4])
    ptrs = {bs: b.emit.data_ptr() for bs, b in runner.buffers.items()}
    reqs = prefilled(models, pool, shape, PROMPTS, _params(False))
    run_steps(runner, reqs, 1)
    assert {bs: b.emit.data_ptr() for bs, b in runner.buffers.items()} == ptrs
    assert runner.graphs == {} and not runner.use_graphs


def test_eager_step_gathers_only_the_pages_its_rows_hold(models):
    shape = StepShape("tree", 6, BLOCK, False)
    pool = make_pool(models)
    runner = runner_for(models, pool, shape, [4])
    reqs = prefilled(models, pool, shape, PROMPTS, _params(False))
    inp = step_inputs(reqs, runner.coins_per_row(len(reqs)))
    _, _, width = runner.load(inp)
    # the longest row's pages, not the table's full width nor a rounded-up width
    assert width == max(map(len, inp.pages)) < min(8, runner.max_pages), (width, inp.pages)


# ---- capture sizes, budgets, capture errors --------------------------------------------------


def test_default_capture_sizes():
    assert default_capture_sizes(1) == [1]
    assert default_capture_sizes(8) == [1, 2, 4, 8]
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_capture_sizes(96) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96]


def test_capture_failure_names_the_knobs(models, monkeypatch):
    shape = StepShape("tree", 6, BLOCK, False)
    runner = runner_for(models, make_pool(models), shape, [1, 2, 4])
    runner.use_graphs = True  # as on a GPU; the capture itself is stubbed below
    seen = []

    def capture_one(bs, shape, mem_pool):
        seen.append(bs)
        if bs == 4:
            raise RuntimeError("CUDA out of memory")
        return object()

    monkeypatch.setattr(runner, "_new_pool", lambda: None)
    monkeypatch.setattr(runner, "_capture_one", capture_one)
    with pytest.raises(CaptureError) as e:
        runner.capture(progress=False)
    msg = str(e.value)
    assert seen == [4], "the largest size is captured first"
    for knob in ("batch size 4", "--max-batch-size", "budgets 6/6", "--budget", "KV",
                 "out of memory"):
        assert knob in msg, (knob, msg)


def test_capture_order_and_stats_with_a_stub(models, monkeypatch):
    runner = runner_for(models, make_pool(models), StepShape("ar", 1, BLOCK, False), [1, 2, 4])
    runner.use_graphs = True
    order = []
    monkeypatch.setattr(runner, "_new_pool", lambda: "pool")
    monkeypatch.setattr(runner, "_capture_one", lambda bs, s, p: order.append((bs, s, p)))
    runner.capture(progress=False)
    # ar: the mixed and sampled kinds share one shape, captured in each sampling variant
    # (plain, bounded, sort): four graphs per size
    assert [(bs, s.sample, s.topk_rows, s.sort_rows) for bs, s, _ in order] == [
        (bs, *kind) for bs in (4, 2, 1)
        for kind in ((False, None, None), (True, 0, 0), (True, bs, 0), (True, bs, bs))]
    assert {p for *_, p in order} == {"pool"}, "one shared memory pool"
    assert set(runner.capture_stats) == {(bs, s) for bs, s, _ in order}


def test_graphs_need_cuda(models):
    with pytest.raises(ValueError, match="CUDA"):
        runner_for(models, make_pool(models), StepShape("ar", 1, BLOCK, False), [1],
                   use_graphs=True)


def test_budget_policy_roundtrip_and_spread(tmp_path):
    policy = {False: {1: 32, 8: 16, 32: 4}, True: {1: 8, 8: 0}}
    p = write_budgets(tmp_path / "b.toml", policy,
                      measured=[dict(sample=False, batch_size=1, budget=32, accept=2.5,
                                     step_ms=3.0, tokens_per_s=800.0)], note="test")
    assert load_budgets(p) == policy
    (tmp_path / "greedy.toml").write_text("[greedy]\n1 = 5\n4 = 0\n")
    assert load_budgets(tmp_path / "greedy.toml") == {False: {1: 5, 4: 0}, True: {1: 5, 4: 0}}
    assert budgets_for_sizes({2: 20, 8: 10}, [1, 2, 4, 8, 16]) == {1: 20, 2: 20, 4: 20, 8: 10,
                                                                   16: 10}
    for text, match in [("[greedy]\n4 = -1\n", "4 = -1"), ("[greedy]\nx = 1\n", "'x'"),
                        ("x = 1\n", "unknown tables"), ("[sampled]\n1 = 2\n", r"\[greedy\]"),
                        ("[greedy\n", "not valid TOML")]:
        (tmp_path / "bad.toml").write_text(text)
        with pytest.raises(PolicyError, match=match):
            load_budgets(tmp_path / "bad.toml")
    with pytest.raises(PolicyError, match="not found"):
        load_budgets(tmp_path / "none.toml")


def test_runner_with_budget_policy(models):
    shape = StepShape("tree", 6, BLOCK, False)
    pool = make_pool(models)
    runner = runner_for(models, pool, shape, [1, 2, 4],
                        budgets={False: {1: 12, 4: 3}, True: {1: 5, 4: 0}})
    assert runner.budgets == {(1, False): 12, (2, False): 12, (4, False): 3,
                              (1, True): 5, (2, True): 5, (4, True): 0}
    # one set of buffers per size, as wide as its widest shape
    assert runner.buffers[1].tree_kv.shape[2] == 13 and runner.buffers[4].tree_kv.shape[2] == 4
    # a coin per position a step may fill: at most L + 1 = 4, at size 4 (budget 3) too
    assert runner.buffers[1].coins.shape[1] == 4 and runner.buffers[4].coins.shape[1] == 4
    assert runner.shape.max_emit == max(s.max_emit for s in runner.shapes.values())
    # sampled rows among greedy ones keep the greedy budget up to half the batch; more than
    # half, the sampled one
    greedy, hot = SamplingParams(), SamplingParams(temperature=0.8)
    assert [runner.kind(ps) for ps in ([greedy] * 3, [hot] + [greedy] * 3, [hot, greedy],
                                       [hot, hot, greedy])] == [
        "greedy", "mixed", "mixed", "sampled"]
    # a sampled batch with a lagging drafter cache decodes plainly; a mixed one still drafts
    assert runner.kind([hot, hot, greedy], lagging=True) == "lagging"
    assert runner.kind([hot, greedy], lagging=True) == "mixed"
    assert runner.shapes[(1, "lagging")] == StepShape("tree", 0, BLOCK, True)
    assert runner.shapes[(4, "mixed")] == StepShape("tree", 3, BLOCK, True)
    assert runner.coins_per_row(3) == 4  # what the widest sampling tree at size 4 may emit
    for sample in (False, True):
        reqs = prefilled(models, pool, shape, PROMPTS, _params(sample))
        emitted, accepted = step(runner, reqs, pad=False)  # size 4: budget 3, or 0 sampled
        assert len(emitted) == 3 and all(len(e) == a + 1 for e, a in zip(emitted, accepted))
        if sample:
            assert accepted == [0, 0, 0]
    # no policy: one budget everywhere (the default behaviour)
    plain = runner_for(models, pool, shape, [1, 2, 4])
    assert set(plain.budgets.values()) == {6}
    # chain and ar ignore budgets
    assert set(runner_for(models, pool, StepShape("chain", 1, BLOCK, False), [1, 2],
                          budgets={False: {1: 9}, True: {1: 9}}).budgets.values()) == {1}


def test_budget_zero_is_plain_decoding_and_the_drafter_catches_up(models):
    """A tree of budget 0 emits exactly what `ar` emits, one token a step, and writes what `ar`
    writes (the drafter's cache is left behind); `catch_up` then writes the drafter's context
    rows of the tokens it missed, as a prefill of the whole sequence would, and nothing else."""
    base = make_pool(models)
    reqs = prefilled(models, base, StepShape("tree", 6, BLOCK, False), PROMPTS, _params(False),
                     steps=4)
    runs = {}
    for mode in ("tree", "ar"):
        pool, done = clone_pool(base), fresh_copies(reqs)
        rec = run_steps(runner_for(models, pool, StepShape(mode, 0, BLOCK, False), [3]), done, 4,
                        pad=False)
        runs[mode] = (pool, done, rec)
    (pool0, done, zero), (pool_ar, _, ar) = runs["tree"], runs["ar"]
    assert zero.emitted == ar.emitted and {a for acc in zero.accepted for a in acc} == {0}
    real = request_slots(reqs, PAGE)
    torch.testing.assert_close(pool0.target[:, real], pool_ar.target[:, real], **ULPS)
    torch.testing.assert_close(pool0.draft, pool_ar.draft, rtol=0, atol=0)
    target_before = pool0.target.clone()
    for r in done:
        ref = make_pool(models)
        spec.prefill(models, ref, [r.prompt_ids + r.output_ids[:-1]], [r.pages])
        slots = request_slots([r], PAGE)[:r.cache_len]
        missed = slots[len(r.prompt_ids):]
        assert missed.numel() == 4
        assert not torch.allclose(pool0.draft[:, missed], ref.draft[:, missed])
        seq = r.prompt_ids + r.output_ids
        spec.catch_up(models, pool0, seq[len(r.prompt_ids):r.cache_len], len(r.prompt_ids),
                      r.pages, chunk=3)  # two chunks
        torch.testing.assert_close(pool0.draft[:, slots], ref.draft[:, slots], **ULPS)
    torch.testing.assert_close(pool0.target, target_before, rtol=0, atol=0)


def test_a_request_drafts_again_after_plain_decoding(tmp_path, monkeypatch):
    """Two requests decode as a pair at budget 0; the longer one then runs alone at a budget,
    its first drafting step bringing the drafter the tokens the pair committed: one catch-up,
    over exactly that span, and tokens equal to AR's."""
    from engine import LLM

    target, draft = write_pair(tmp_path)
    policy = tmp_path / "budgets.toml"
    write_budgets(policy, {False: {1: 4, 2: 0}})
    prompts = [[5, 6, 7], list(range(20, 45))]
    params = [SamplingParams(max_new_tokens=5, ignore_eos=True),
              SamplingParams(max_new_tokens=14, ignore_eos=True)]
    ar = LLM(target, mode="ar", max_batch_size=2, progress=False).generate(prompts, params)
    llm = LLM(target, draft, mode="tree", max_batch_size=2, budget_policy=str(policy),
              progress=False)
    lags: list[tuple[int, int]] = []
    real = spec.catch_up

    def spy(models, pool, tokens, start, pages, **kw):
        lags.append((start, len(tokens)))
        real(models, pool, tokens, start, pages, **kw)

    monkeypatch.setattr("engine.runner.catch_up", spy)
    tree = llm.generate(prompts, params)
    assert [o.token_ids for o in tree] == [o.token_ids for o in ar]
    # the pair took 4 plain steps after the prefill's first token: the second request's
    # drafter missed positions 25 .. 28, once
    assert lags == [(len(prompts[1]), 4)]
    assert tree[1].accept_lengths[:4] == [1, 1, 1, 1] and len(tree[1].accept_lengths) > 4


def test_a_sampled_request_that_decoded_plainly_stays_plain(tmp_path, monkeypatch):
    """The same pair, sampled, with a sampled budget alone: the longer request, left alone with
    a lagging drafter cache, keeps decoding plainly (no catch-up, one token a step), while a
    lone sampled request whose drafter kept up drafts."""
    from engine import LLM

    target, draft = write_pair(tmp_path)
    policy = tmp_path / "budgets.toml"
    write_budgets(policy, {False: {1: 4, 2: 0}, True: {1: 4, 2: 0}})
    prompts = [[5, 6, 7], list(range(20, 45))]
    params = [SamplingParams(temperature=0.8, seed=1, max_new_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=2, max_new_tokens=14, ignore_eos=True)]
    llm = LLM(target, draft, mode="tree", max_batch_size=2, budget_policy=str(policy),
              progress=False)
    assert llm.runner.step_shape(1, params[1:], lagging=True).budget == 0
    assert llm.runner.step_shape(1, params[1:]).budget == 4
    monkeypatch.setattr("engine.runner.catch_up", lambda *a, **k: pytest.fail("caught up"))
    budgets: list[int] = []
    real = llm.runner.step_shape

    def spy(b, ps, lagging=False):
        budgets.append(real(b, ps, lagging).budget)
        return real(b, ps, lagging)

    monkeypatch.setattr(llm.runner, "step_shape", spy)
    pair = llm.generate(prompts, params)
    assert len(pair[1].token_ids) == 14 and len(pair[1].accept_lengths) == 13
    assert budgets and set(budgets) == {0}
    budgets.clear()
    alone = llm.generate(prompts[1:], params[1:])
    assert set(budgets) == {4}  # alone from the start, its drafter kept up: it drafts
    # plainly in a pair or drafting alone, its seed gives the same tokens
    assert alone[0].token_ids == pair[1].token_ids


def test_best_budgets_keep_plain_decoding_unless_a_tree_wins_by_the_margin():
    from engine.policy import MARGIN, best_budgets

    def row(sample, bs, budget, tps):
        return {"sample": sample, "batch_size": bs, "budget": budget, "tokens_per_s": tps}

    rows = [row(False, 1, 0, 100.0), row(False, 1, 8, 250.0), row(False, 1, 16, 240.0),
            row(False, 8, 0, 1000.0), row(False, 8, 4, 1000.0 * (1 + MARGIN) - 1),
            row(True, 1, 0, 100.0), row(True, 1, 2, 100.0 * (1 + MARGIN) + 1),
            row(True, 8, 2, 50.0), row(True, 8, 4, 60.0)]  # no budget 0 measured: the best
    assert best_budgets(rows) == {False: {1: 8, 8: 0}, True: {1: 2, 8: 4}}
    assert best_budgets(rows, margin=0.0) == {False: {1: 8, 8: 4}, True: {1: 2, 8: 4}}


@pytest.mark.parametrize("device,compiled,step", [
    ("cpu", False, "eager step"), ("cpu", True, "compiled step"), ("cuda", False, None)])
def test_shipped_budget_policy_reads(device, compiled, step):
    from engine.policy import default_policy, policy_path

    # the CPU's tables measured (eager, compiled), CUDA's estimated by graphs.plan --tune
    path = default_policy(device, compiled)
    assert path == policy_path(device, compiled) and path.is_file()
    policy = load_budgets(path)
    assert policy[False] and policy[True]
    assert all(b >= 0 for t in policy.values() for b in t.values())
    if step:  # a CPU table was measured on the execution path its name says
        assert step in path.read_text()


def test_one_policy_per_device_and_execution_path(tmp_path, monkeypatch):
    import engine.policy as policy
    from engine.policy import default_policy, policy_path

    monkeypatch.setattr(policy, "CONFIGS", tmp_path)
    assert default_policy("cpu", True) is None and default_policy("cpu") is None
    eager = write_budgets(policy_path("cpu"), {False: {1: 4}})
    assert eager == tmp_path / "budgets-cpu.toml" and default_policy("cpu") == eager
    assert default_policy("cpu", True) is None  # the eager table is not the compiled step's
    compiled = write_budgets(policy_path("cpu", True), {False: {1: 8}})
    assert compiled == tmp_path / "budgets-cpu-compiled.toml"
    assert default_policy("cpu", True) == compiled and default_policy("cpu") == eager
    assert default_policy("cuda") is None
    assert policy_path("cuda").name == "budgets-cuda.toml"


def test_planner_runs_outside_the_step_with_the_loaded_host_inputs(models, monkeypatch):
    shape = StepShape("tree", 6, BLOCK, False)
    pool = make_pool(models)
    calls = []

    class Planning(TorchBackend):
        plans = True

        def plan(self, page_table, cache_len, num_queries):
            calls.append((page_table.device.type, page_table[:, 0].tolist(),
                          cache_len.tolist(), num_queries))

    monkeypatch.setattr(models, "attention", Planning())
    runner = runner_for(models, pool, shape, [4])
    reqs = prefilled(models, pool, shape, PROMPTS, _params(False))
    step(runner, reqs)
    assert calls == [("cpu", [r.pages[0] for r in reqs] + [DUMMY_PAGE],
                      [r.cache_len for r in reqs] + [0], 7)]


def test_llm_budget_policy_keeps_greedy_output(tmp_path, monkeypatch):
    """An engine built with a per-size budget table captures each size at its own budget and
    still emits exactly the AR tokens, alone and batched."""
    from engine import LLM

    target, draft = write_pair(tmp_path)
    policy = tmp_path / "budgets.toml"
    write_budgets(policy, {False: {1: 3, 2: 0}, True: {1: 0, 2: 2}})
    prompts = [[5, 6, 7], list(range(20, 45)), [9] * 11]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ar = LLM(target, mode="ar", max_batch_size=2, progress=False).generate(prompts, params)
    use_oracle(monkeypatch)
    llm = LLM(target, draft, mode="tree", max_batch_size=2, budget_policy=str(policy),
              progress=False)
    assert llm.runner.budgets == {(1, False): 3, (2, False): 0, (1, True): 0, (2, True): 2}
    assert [llm.runner.shapes[(bs, "greedy")].num_nodes for bs in (1, 2)] == [4, 1]
    # the third request runs alone (budget 3) after two in a pair (budget 0)
    tree = llm.generate(prompts, params)
    assert [o.token_ids for o in tree] == [o.token_ids for o in ar]
    assert llm.stats["mean_accept_len"] > 1.2


# ---- live work at fixed shapes: paged attention, experts over aligned blocks ------------------


@pytest.mark.parametrize("moe", ["dense", "aligned"])
@pytest.mark.parametrize("attention", ["torch", "paged"])
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sample"])
def test_step_with_paged_attention_and_aligned_experts_runs_on_fake_tensors(
        models, monkeypatch, attention, moe, sample):
    """The paged attention ops (target prefix, drafter context) and the expert bank over
    aligned blocks keep the step free of host syncs and data-dependent shapes."""
    monkeypatch.setattr(models, "attention",
                        {"torch": TorchBackend, "paged": PagedBackend}[attention]())
    shape = StepShape("tree", 6, BLOCK, sample)
    pool, buf = _fake_inputs(models, shape)
    run_on_fake(spec_step, models, pool, buf, shape, moe=moe)


def test_paged_attention_and_aligned_experts_keep_greedy_output(tmp_path, monkeypatch):
    """Reading the caches in place and running only the chosen experts at fixed shapes give the
    tokens the gathered, dense step gives."""
    from engine import LLM
    from engine.spec import sparse_pass

    target, draft = write_pair(tmp_path)
    prompts = [[5, 6, 7], list(range(20, 45)), [9] * 11]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    ref = LLM(target, draft, mode="tree", budget=5, max_batch_size=2, progress=False,
              attention="torch").generate(prompts, params)
    llm = LLM(target, draft, mode="tree", budget=5, max_batch_size=2, progress=False,
              attention="triton")
    # as in a captured step: experts over aligned blocks (prefills: each token's own experts)
    llm.runner.expert_pass, llm.runner.eager_pass = (lambda n: "aligned"), sparse_pass
    assert llm.models.attention.name == "paged"
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]


@pytest.mark.parametrize("quant", ["int4", "fp8"])
def test_step_with_quantized_weights_runs_on_fake_tensors(tmp_path, monkeypatch, quant):
    """INT4 expert banks (kimi::moe_experts_w4a16 over aligned blocks) and FP8 linears and
    banks (kimi::fp8_linear, per-call dequantization) keep the step graph-safe."""
    from tools.make_draft import make_draft
    from tools.make_tiny import make_tiny

    t = make_tiny(tmp_path / "t", dtype="fp32", int4_experts=quant == "int4",
                  fp8=quant == "fp8", moe_intermediate_size=128)
    d = make_draft(t, tmp_path / "d", layers=1, block_size=BLOCK)
    models = load_models(t, d)
    bank = models.target.model.layers[1].mlp.experts
    assert bank.fmt == quant
    monkeypatch.setattr(models, "attention", PagedBackend())
    for sample in (False, True):
        shape = StepShape("tree", 6, BLOCK, sample)
        pool, buf = _fake_inputs(models, shape)
        run_on_fake(spec_step, models, pool, buf, shape)


def test_page_tables_are_staged_incrementally(models):
    """Rows keep their staged pages across steps by table id: a row that grew gets only its new
    pages, rows that shifted move in one gather, a new or re-admitted id is written whole, and
    after every step the staged table is exactly the one written from scratch."""
    from engine.runner import StepInputs

    runner = runner_for(models, make_pool(models), StepShape("ar", 1, BLOCK, False), [4])

    def stage(rows: list[tuple[int, list[int]]], ids: bool = True) -> None:
        b = len(rows)
        inp = StepInputs([1] * b, [0] * b, [p for _, p in rows], [SamplingParams()] * b,
                         [[0.0] * runner.coins_per_row(b)] * b,
                         tables=[t for t, _ in rows] if ids else [])
        runner.load(inp)
        want = torch.full_like(runner.staging[4]["page_table"], DUMMY_PAGE)
        for i, (_, pages) in enumerate(rows):
            want[i, :len(pages)] = torch.tensor(pages)
        assert torch.equal(runner.staging[4]["page_table"], want), rows

    a, b, c = [1, 2], [3], [4, 5, 6]
    stage([(10, a), (11, b), (12, c)])
    a.append(7)
    stage([(10, a), (12, c), (13, [8])])  # b left: c shifts up, a grew, a new row
    stage([(12, c), (10, a)])  # swapped
    stage([(10, a), (14, [9])])  # c's pages given back; its next ones are another table
    stage([(10, [11, 12]), (14, [9])])  # an id whose list shrank is written whole
    # random steps: rows leave, come, shift and grow; now and then a step without table ids
    g = random.Random(0)
    rows: list[tuple[int, list[int]]] = []
    for t in range(100, 400):
        rows = [r for r in rows if g.random() < 0.9]
        if g.random() < 0.2:
            g.shuffle(rows)
        for _, pages in rows:
            grow = min(g.choice([0, 0, 1, 3]), runner.max_pages - len(pages))
            pages += [g.randrange(1, 50) for _ in range(grow)]
        if len(rows) < 4 and g.random() < 0.5:
            rows.append((t, [g.randrange(1, 50) for _ in range(g.randrange(1, 5))]))
        if rows:
            stage(rows, ids=g.random() < 0.95)
