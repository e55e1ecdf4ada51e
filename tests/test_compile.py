"""The compiled step (`--compile on`, the CPU's graph, `engine.cpu`): `torch.compile` of the whole
step with no graph break, one graph per (batch size, step shape) whatever the page table's width,
the eager step's tokens, and `auto` settled per use.

NOTE: compiling is what these tests pay for, so each graph is compiled once in the module: the
steps by the `turns` fixture (two graphs, one of them by inductor), the prefill by its own
test; every other test replaces the compile with a recorder."""

from __future__ import annotations

import importlib
import os
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from engine.config import EngineConfig, SamplingParams
from engine.cpu import INDEXED_MAX_PAIRS, ONE_THREAD_ROWS
from engine.llm import compile_auto, compiles
from engine.runner import PrefillInputs, StepInputs
from engine.spec import PADDING, StepShape
from tests.graph_helpers import (
    BLOCK,
    fresh_copies,
    load_models,
    make_pool,
    prefilled,
    run_steps,
    runner_for,
)
from tools.make_draft import make_draft
from tools.make_tiny import make_tiny

PROMPTS = [[5, 9, 300, 41, 7, 8, 2], [17] * 13, [600, 3, 90]]


def _graphs() -> int:
    """Graphs dynamo has compiled in this process (imported here: collecting this module in the
    other test worker should not import dynamo)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]
SAMPLED = [SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=11),
           SamplingParams(temperature=1.2, seed=12),
           SamplingParams(max_new_tokens=32)]  # a greedy row inside a sampling batch
SHAPE = StepShape("tree", 6, BLOCK, False)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A one-layer MoE target and its drafter: every op kind of a layer (MLA, the router, the
    experts, and the MLP a dense layer runs, as the shared expert), in a smaller graph than the
    usual dense-then-MoE pair's (this module takes a fifth less CPU, cold)."""
    root = tmp_path_factory.mktemp("compile")
    target = make_tiny(root / "tiny", dtype="fp32", seed=5, layers=1, first_dense=0)
    return load_models(target, make_draft(target, root / "tiny-dflash", layers=1,
                                          block_size=BLOCK, seed=6))


@pytest.fixture(scope="module")
def turns(models):
    """Two batches taking turns for four rounds, on an eager runner and on a compiled one: two
    greedy rows, and three sampling rows (one of them greedy) padded to four. The compiled
    runner compiles two graphs (a greedy step at two rows, a sampled one at four) in the first
    round; later steps of a known (size, shape) run only the guards that tell its graphs
    apart (`CompiledCPUSteps.run`).

    NOTE: inductor compiles the sampled graph; the greedy one, whose ops the sampled graph
    holds too (its greedy row takes the same argmax and walk; only the sampled build's coupling
    and draws are more), is traced whole by dynamo and AOT autograd as inductor's input is,
    then run by torch's own kernels (`aot_eager`): each inductor compile costs a CPU about 40
    seconds."""
    import inspect

    from engine.cpu import _compiled_step
    from engine.spec import spec_step

    inductor = _compiled_step()
    traced = torch.compile(inspect.unwrap(spec_step), fullgraph=True, backend="aot_eager")

    def step(models, pool, buf, shape, **kw):
        return (inductor if shape.sample else traced)(models, pool, buf, shape, **kw)

    prompts = PROMPTS[:2] + PROMPTS
    reqs = prefilled(models, make_pool(models, 128), SHAPE, prompts,
                     [SamplingParams()] * 2 + SAMPLED, steps=4)
    groups = [reqs[:2], reqs[2:]]

    def play(runner, after_first_round=None):
        got, rest = [], [fresh_copies(g) for g in groups]
        for i in range(4):
            for g in rest:
                rec = run_steps(runner, g, 1)  # advances g's requests
                got.append((rec.emitted, rec.accepted))
            if i == 0 and after_first_round is not None:
                after_first_round()
        return got

    eager = play(runner_for(models, make_pool(models, 128), SHAPE, [2, 4]))
    runner = runner_for(models, make_pool(models, 128), SHAPE, [2, 4], compile=True)
    before, graphs = _graphs(), []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("engine.cpu._compiled_step", lambda: step)
        got = play(runner, lambda: graphs.append(_graphs()))
    return SimpleNamespace(eager=eager, got=got, runner=runner, before=before,
                           after_first_round=graphs[0], step=step)


def test_compiled_steps_keep_the_eager_tokens(turns):
    """Greedy and sampled batches, at two sizes, emit and accept on the compiled runner what
    they do on the eager one, step after step."""
    assert turns.got == turns.eager
    assert any(a > 0 for _, accepted in turns.got for step in accepted for a in step)


def test_one_graph_per_step_shape_whatever_the_width(turns, monkeypatch):
    """One graph per (size, shape), compiled at its first step and never again; running it
    over a wider page table (every row padding) reuses it."""
    runner = turns.runner
    built = runner.compiled.built
    assert {(size, s.sample) for size, s in built} == {(2, False), (4, True)}
    assert turns.after_first_round == turns.before + 2 == _graphs()
    (size, shape), = [(size, s) for size, s in built if size == 2]
    buf = runner.buffers[2].fit(shape)
    for k, v in PADDING.items():
        buf.inputs()[k][:] = v
    monkeypatch.setattr("engine.cpu._compiled_step", lambda: turns.step)
    runner.compiled.run(buf, shape, runner.max_pages)
    assert _graphs() == turns.before + 2, \
        "a new width compiled a second graph"


def test_a_lone_prompt_prefills_compiled_as_it_does_eagerly(models):
    """A compiled runner prefills a lone prompt through one compiled forward whatever its length
    (a one-token prompt is padded to two), writing the eager prefill's cache rows and drawing
    its first token; prompts prefilled together stay eager."""
    eager = runner_for(models, make_pool(models), SHAPE, [4])
    runner = runner_for(models, make_pool(models), SHAPE, [4], compile=True)
    assert eager.compiled is None
    before = _graphs()
    for p, params in zip([[5], *PROMPTS], [SamplingParams(), *SAMPLED]):
        assert runner.compiled.prefills([p]) and not runner.compiled.prefills([p, p])
        inp = PrefillInputs(p, [1, 2, 3, 4], params, coin=0.3)
        assert runner.prefill([inp]) == eager.prefill([inp])
        for got, want in ((runner.pool.target, eager.pool.target),
                          (runner.pool.draft, eager.pool.draft)):
            assert (got - want).abs().max().item() < 1e-4
    assert _graphs() == before + 1  # one graph for every length
    # its expert pass reads the chosen experts in place up to INDEXED_MAX_PAIRS pairs: a longer
    # prompt prefills eagerly rather than compile a second graph
    longest = INDEXED_MAX_PAIRS // models.target.cfg.num_experts_per_tok
    assert runner.compiled.prefills([[7] * longest])
    assert not runner.compiled.prefills([[7] * (longest + 1)])


def test_warm_up_covers_the_common_batches(models, monkeypatch):
    """`capture` compiles, per size, exactly the shapes that all-greedy batches, greedy rows
    beside untruncated samplers, and all-untruncated batches load (a sampled budget apart)."""
    budgets = {False: {1: 6, 2: 4, 4: 6}, True: {1: 3, 2: 2, 4: 0}}
    runner = runner_for(models, make_pool(models), SHAPE, [1, 2, 4], compile=True,
                        budgets=budgets)
    warmed: list[tuple[int, StepShape]] = []
    monkeypatch.setattr(runner.compiled, "build",
                        lambda buf, s: warmed.append((buf.anchor.shape[0], s)))
    prefills: list[list[list[int]]] = []
    monkeypatch.setattr("engine.cpu.prefill",
                        lambda models, pool, ctxs, *rest, **kw: prefills.append(ctxs))
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


def test_a_failed_compile_names_what_to_do(models, monkeypatch):
    from engine.runner import CaptureError

    runner = runner_for(models, make_pool(models), StepShape("ar", 0, BLOCK, False), [1],
                        compile=True)

    def broken(buf, shape):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(runner.compiled, "build", broken)
    with pytest.raises(CaptureError, match="compiling the ar step at batch size 1 failed: "
                                           "RuntimeError: no compiler.*--compile off"):
        runner.capture(progress=False)


def test_small_compiled_steps_run_on_one_thread(models, monkeypatch):
    """A compiled step over at most `ONE_THREAD_ROWS` token rows (batch size x tree nodes)
    compiles and runs on one torch thread, a larger one on every thread the runner has, a prefill
    too; each gives the caller back its own count."""
    small = ONE_THREAD_ROWS
    # one row drafts 7 nodes and samples plainly; two draft 14; 2 x small rows decode plainly
    budgets = {False: {1: 6, 2: 6, 2 * small: 0}, True: {1: 0, 2: 0, 2 * small: 0}}
    assert 7 <= small < 14
    runner = runner_for(models, make_pool(models), SHAPE, [1, 2, 2 * small], compile=True,
                        threads=3, budgets=budgets)
    seen: list[tuple[object, int]] = []
    monkeypatch.setattr("engine.cpu._compiled_step", lambda: lambda models, pool, buf, s, moe: (
        seen.append((buf.anchor.shape[0] * s.num_nodes, torch.get_num_threads()))))

    def fake_prefill(models, pool, ctxs, *rest, **kw):
        seen.append(("prefill", torch.get_num_threads()))
        return [None] * len(ctxs)

    monkeypatch.setattr("engine.cpu.prefill", fake_prefill)
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


@pytest.mark.parametrize("cli", ["engine.serve", "engine.generate"])
def test_one_compiled_path_and_its_switch(cli, capsys):
    """The user CLIs have one switch for the compiled step (`--compile`), whose help says what
    `auto` does for a server, and no flags choosing how its kernels are made."""
    main = importlib.import_module(cli).main
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--compile {auto,on,off}" in out
    assert "off for serve" in " ".join(out.split())
    assert "--compile-wrapper" not in out and "--compile-gemm" not in out


def test_an_interrupted_compiles_empty_library_is_removed(tmp_path, monkeypatch):
    """A compile killed while it linked leaves an empty `.so` that inductor would load and fail
    on at every later start: setting up the cache removes it, and keeps the real ones and a
    fresh empty one (a link under way elsewhere)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from engine.cpu import keep_inductor_cache, user_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # restored afterwards
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    root = user_cache_dir() / "inductor" / "gf"
    root.mkdir(parents=True)
    (root / "broken.main.so").touch()
    hour_ago = time.time() - 3600
    os.utime(root / "broken.main.so", (hour_ago, hour_ago))
    (root / "linking.main.so").touch()  # another process may be linking it right now
    (root / "good.main.so").write_bytes(b"\x7fELF" + bytes(60))
    keep_inductor_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "kimi-spec" / "inductor")
    assert sorted(p.name for p in root.iterdir()) == ["good.main.so", "linking.main.so"]
