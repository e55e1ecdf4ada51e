"""The compiled step (`--compile on`, the CPU's graph): `torch.compile` of the whole step with no
graph break, one graph per (batch size, step shape) whatever the page table's width, the eager
step's tokens, and `auto` settled per use."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import replace

import pytest
import torch
from torch._dynamo.utils import counters

from engine.config import CompileKernels, EngineConfig, SamplingParams
from engine.llm import compile_auto, compiles
from engine.runner import ONE_THREAD_ROWS, PrefillInputs, StepInputs
from engine.spec import StepShape
from ops.moe import INDEXED_MAX_PAIRS
from tests.graph_helpers import (
    BLOCK,
    fresh_copies,
    load_models,
    make_pool,
    prefilled,
    run_steps,
    runner_for,
    write_pair,
)

PROMPTS = [[5, 9, 300, 41, 7, 8, 2], [17] * 13, [600, 3, 90]]
SAMPLED = [SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=11),
           SamplingParams(temperature=1.2, seed=12),
           SamplingParams(max_new_tokens=32)]  # a greedy row inside a sampling batch


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return load_models(*write_pair(tmp_path_factory.mktemp("compile")))


@contextlib.contextmanager
def _uncached():
    import torch._functorch.config as aot
    import torch._inductor.config as inductor

    with inductor.patch(fx_graph_cache=False), aot.patch(enable_autograd_cache=False):
        yield


@pytest.mark.parametrize("params, kernels", [
    ([SamplingParams()] * 3, CompileKernels()), (SAMPLED, CompileKernels()),
    ([SamplingParams()] * 3, CompileKernels("cpp")),
    (SAMPLED, CompileKernels("python", "cpp"))],
    ids=["greedy", "sampled", "greedy-cpp", "sampled-cppgemm"])
def test_compiled_step_keeps_the_eager_tokens(models, params, kernels):
    """Three rows padded to four: the compiled runner (its kernels called from inductor's
    Python or from C++, its GEMMs the matmul library's or inductor's C++ template's) emits and
    accepts what the eager one does, step after step, and compiles one graph for the shape; a
    wider page table reuses it."""
    shape = StepShape("tree", 6, BLOCK, False)
    base = make_pool(models)
    reqs = prefilled(models, base, shape, PROMPTS, params, steps=3)
    eager = run_steps(runner_for(models, make_pool(models), shape, [4]), fresh_copies(reqs), 3,
                      pad=False)
    runner = runner_for(models, make_pool(models), shape, [4], compile=True, kernels=kernels)
    before = counters["stats"]["unique_graphs"]
    counters["inductor"].clear()
    # C++ GEMMs compile cold (no cache may stand in for the compile), so it shows they are made
    with _uncached() if kernels.gemm == "cpp" else contextlib.nullcontext():
        got = run_steps(runner, fresh_copies(reqs), 3)
    if kernels.gemm == "cpp":
        assert counters["inductor"]["cpp_templated_kernel_counter"] > 0
    assert got.emitted == eager.emitted and got.accepted == eager.accepted
    assert len(runner.compiled) == 1 and counters["stats"]["unique_graphs"] == before + 1
    (size, compiled_shape), = runner.compiled
    assert size == 4 and compiled_shape.sample == any(not p.greedy for p in params)
    buf = runner.buffers[4].fit(compiled_shape)
    runner._run_compiled(buf, compiled_shape, runner.max_pages)  # every row padding
    assert counters["stats"]["unique_graphs"] == before + 1, "a new width compiled a second graph"


@pytest.mark.parametrize("kernels, named", [(("java", "aten"), "compile wrapper 'java'"),
                                            (("cpp", "blas"), "compile gemm 'blas'")])
def test_unknown_compile_kernels_are_named(models, kernels, named):
    with pytest.raises(ValueError, match=named):
        runner_for(models, make_pool(models), StepShape("ar", 0, BLOCK, False), [1],
                   compile=True, kernels=CompileKernels(*kernels))


def test_known_steps_still_find_their_own_graph(models):
    """A known (size, shape) runs only the guards that tell graphs apart: batches of two sizes
    and both sampling modes, taking turns on one runner, still emit what the eager step emits,
    and no step after the first round compiles."""
    shape = StepShape("tree", 6, BLOCK, False)
    greedy = [SamplingParams()] * 3
    prompts = PROMPTS + PROMPTS + PROMPTS[:2]
    reqs = prefilled(models, make_pool(models, 128), shape, prompts,
                     greedy + SAMPLED + greedy[:2], steps=4)
    groups = [reqs[:3], reqs[3:6], reqs[6:]]  # four rows greedy and sampled, two greedy

    def turns(runner, after_first_round=None):
        got, rest = [], [fresh_copies(g) for g in groups]
        for i in range(4):
            for g in rest:
                rec = run_steps(runner, g, 1)  # advances g's requests
                got.append((rec.emitted, rec.accepted))
            if i == 0 and after_first_round is not None:
                after_first_round()
        return got

    eager = turns(runner_for(models, make_pool(models, 128), shape, [2, 4]))
    runner = runner_for(models, make_pool(models, 128), shape, [2, 4], compile=True)
    graphs = []
    got = turns(runner, lambda: graphs.append(counters["stats"]["unique_graphs"]))
    assert got == eager
    assert len(runner.compiled) == 3 and counters["stats"]["unique_graphs"] == graphs[0]


def test_a_lone_prompt_prefills_compiled_as_it_does_eagerly(models):
    """A compiled runner prefills a lone prompt through one compiled forward whatever its length
    (a one-token prompt is padded to two), writing the eager prefill's cache rows and drawing
    its first token; prompts prefilled together stay eager."""
    shape = StepShape("tree", 6, BLOCK, False)
    eager = runner_for(models, make_pool(models), shape, [4])
    runner = runner_for(models, make_pool(models), shape, [4], compile=True)
    before = counters["stats"]["unique_graphs"]
    for p, params in zip([[5], *PROMPTS], [SamplingParams(), *SAMPLED]):
        assert runner.compiles_prefill([p]) and not runner.compiles_prefill([p, p])
        assert not eager.compiles_prefill([p])
        inp = PrefillInputs(p, [1, 2, 3, 4], params, coin=0.3)
        assert runner.prefill([inp]) == eager.prefill([inp])
        for got, want in ((runner.pool.target, eager.pool.target),
                          (runner.pool.draft, eager.pool.draft)):
            assert (got - want).abs().max().item() < 1e-4
    # one graph for every length (none, if another test compiled it first)
    assert counters["stats"]["unique_graphs"] <= before + 1
    # its expert pass reads the chosen experts in place up to INDEXED_MAX_PAIRS pairs: a longer
    # prompt prefills eagerly rather than compile a second graph
    longest = INDEXED_MAX_PAIRS // models.target.cfg.num_experts_per_tok
    assert runner.compiles_prefill([[7] * longest])
    assert not runner.compiles_prefill([[7] * (longest + 1)])


def test_warm_up_covers_the_common_batches(models, monkeypatch):
    """`capture` compiles, per size, exactly the shapes that all-greedy batches, greedy rows
    beside untruncated samplers, and all-untruncated batches load (a sampled budget apart)."""
    shape = StepShape("tree", 6, BLOCK, False)
    budgets = {False: {1: 6, 2: 4, 4: 6}, True: {1: 3, 2: 2, 4: 0}}
    runner = runner_for(models, make_pool(models), shape, [1, 2, 4], compile=True,
                        budgets=budgets)
    warmed: list[tuple[int, StepShape]] = []
    monkeypatch.setattr(runner, "_run_compiled",
                        lambda buf, s, width: warmed.append((buf.anchor.shape[0], s)))
    prefills: list[list[list[int]]] = []
    monkeypatch.setattr("engine.runner.prefill",
                        lambda models, pool, ctxs, *rest: prefills.append(ctxs))
    runner.capture(progress=False)
    assert len(warmed) == len(set(warmed))
    assert prefills == [[[0, 0]]], "a lone prompt's prefill is compiled with the steps"
    greedy, hot = SamplingParams(), SamplingParams(temperature=0.7)
    loaded = set()
    for b in (1, 2, 3, 4):
        for hot_rows in range(b + 1):
            params = [hot] * hot_rows + [greedy] * (b - hot_rows)
            inp = StepInputs(anchor=[1] * b, cache_len=[4] * b, pages=[[1, 2]] * b,
                             params=params, coins=[[0.0] * runner.coins_per_row(b)] * b)
            buf, shape_, _ = runner.load(inp)
            loaded.add((buf.anchor.shape[0], shape_))
    assert set(warmed) == loaded
    # a server also warms up the plain steps of sampled batches whose drafter lags (one row:
    # its sampled budget is 3, so the lagging step is another shape); offline they wait
    lagging = StepInputs(anchor=[1], cache_len=[4], pages=[[1, 2]], params=[hot],
                         coins=[[0.0] * runner.coins_per_row(1)], lagging=True)
    buf, plain, _ = runner.load(lagging)
    assert plain.budget == 0 and (1, plain) not in warmed
    warmed.clear()
    runner.capture(progress=False, lagging=True)
    assert (1, plain) in warmed and set(warmed) > loaded


def test_small_compiled_steps_run_on_one_thread(models, monkeypatch):
    """A compiled step over at most `ONE_THREAD_ROWS` token rows (batch size x tree nodes)
    compiles and runs on one torch thread, a larger one on every thread the runner has, a prefill
    too; each gives the caller back its own count. An eager runner keeps its threads."""
    shape, small = StepShape("tree", 6, BLOCK, False), ONE_THREAD_ROWS
    # one row drafts 7 nodes and samples plainly; two draft 14; 2 x small rows decode plainly
    budgets = {False: {1: 6, 2: 6, 2 * small: 0}, True: {1: 0, 2: 0, 2 * small: 0}}
    assert 7 <= small < 14
    runner = runner_for(models, make_pool(models), shape, [1, 2, 2 * small], compile=True,
                        threads=3, budgets=budgets)
    seen: list[tuple[object, int]] = []
    monkeypatch.setattr("engine.runner._compiled_step", lambda _: lambda models, pool, buf, s: (
        seen.append((buf.anchor.shape[0] * s.num_nodes, torch.get_num_threads()))))

    def fake_prefill(models, pool, ctxs, *rest):
        seen.append(("prefill", torch.get_num_threads()))
        return [None] * len(ctxs)

    monkeypatch.setattr("engine.runner.prefill", fake_prefill)
    mine = torch.get_num_threads()
    runner.capture(progress=False)
    assert set(seen) == {(7, 1), (1, 1), (14, 3), (2, 1), (2 * small, 3), ("prefill", 3)}
    assert torch.get_num_threads() == mine
    seen.clear()
    greedy, hot = SamplingParams(), SamplingParams(temperature=0.7)
    for b, p in ((1, greedy), (1, hot), (2, greedy), (small + 1, hot)):
        inp = StepInputs(anchor=[1] * b, cache_len=[4] * b, pages=[[1, 2]] * b, params=[p] * b,
                         coins=[[0.0] * runner.coins_per_row(b)] * b)
        runner.run_loaded(*runner.load(inp))
    runner.prefill([PrefillInputs([5, 9], [1], None)])
    assert seen == [(7, 1), (1, 1), (14, 3), (2 * small, 3), ("prefill", 3)]
    assert torch.get_num_threads() == mine
    eager = runner_for(models, make_pool(models), shape, [1], threads=3)
    assert eager.step_threads(1, StepShape("ar", 0, BLOCK, False)) == 3


def test_compile_auto_is_settled_per_use(monkeypatch):
    cpu = EngineConfig(device="cpu")
    assert compile_auto(cpu, True).compile == "on"
    assert compile_auto(cpu, False).compile == "off"
    assert compile_auto(replace(cpu, tp=2), True).compile == "off"
    assert compile_auto(replace(cpu, compile="off"), True).compile == "off"
    assert compile_auto(replace(cpu, compile="on"), False).compile == "on"
    if not torch.cuda.is_available():
        assert compile_auto(EngineConfig(), True).compile == "on"  # auto device: the CPU
    monkeypatch.setenv("CXX", "no-such-compiler")  # inductor could not build its kernels
    assert compile_auto(cpu, True).compile == "off"


def test_compile_on_is_refused_where_it_cannot_run():
    on, cpu = EngineConfig(device="cpu", compile="on"), torch.device("cpu")
    assert compiles(on, cpu) and not compiles(replace(on, compile="off"), cpu)
    assert not compiles(replace(on, compile="auto"), cpu)  # settled by the CLIs, not here
    for cfg, device in ((replace(on, tp=2), cpu), (on, torch.device("cuda"))):
        with pytest.raises(ValueError, match="single process; CUDA captures graphs"):
            compiles(cfg, device)


def test_an_interrupted_compiles_empty_library_is_removed(tmp_path, monkeypatch):
    """A compile killed while it linked leaves an empty `.so` that inductor would load and fail
    on at every later start: setting up the cache removes it, and keeps the real ones and a
    fresh empty one (a link under way elsewhere)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from engine.runner import _keep_inductor_cache, user_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # restored afterwards
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    root = user_cache_dir() / "inductor" / "gf"
    root.mkdir(parents=True)
    (root / "broken.main.so").touch()
    hour_ago = time.time() - 3600
    os.utime(root / "broken.main.so", (hour_ago, hour_ago))
    (root / "linking.main.so").touch()  # another process may be linking it right now
    (root / "good.main.so").write_bytes(b"\x7fELF" + bytes(60))
    _keep_inductor_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "kimi-spec" / "inductor")
    assert sorted(p.name for p in root.iterdir()) == ["good.main.so", "linking.main.so"]
