"""`python -m graphs.profile` on a tiny model (CPU: the eager step, no graphs)."""

from __future__ import annotations

import json

import torch

from engine.config import SamplingParams
from engine.kv_cache import pages_needed
from engine.policy import load_budgets
from engine.scheduler import lagging
from engine.spec import StepShape
from graphs import profile
from tests.graph_helpers import (
    BLOCK,
    PAGE,
    load_models,
    make_pool,
    prefilled,
    runner_for,
    write_pair,
)


def _profile(tmp_path, *args: str) -> int:
    """`graphs.profile` on a tiny pair; the thread count it sets is restored afterwards."""
    target, draft = write_pair(tmp_path)
    threads = torch.get_num_threads()
    try:
        return profile.main(["--model", str(target), "--draft", str(draft), "--no-progress",
                             *args])
    finally:
        torch.set_num_threads(threads)


def test_profile_main_writes_json_and_table(tmp_path, capsys):
    target, draft = write_pair(tmp_path)  # the pair _profile runs on
    out = tmp_path / "prof.json"
    rc = _profile(tmp_path, "--batch-sizes", "1,3", "--budget", "6", "--steps", "2",
                  "--warmup", "1", "--prompt-len", "9", "--output", str(out))
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["model"] == str(target) and res["draft"] == str(draft)
    assert [r["batch_size"] for r in res["results"]] == [1, 3]
    for r in res["results"]:
        assert r["budget"] == 6 and r["nodes"] == 7
        assert r["eager_ms"] > 0 and r["tokens_per_s"] > 0
        assert 1.0 <= r["tokens_per_step"] <= 4.0  # block 4: at most 3 drafts + the bonus
        assert set(r["phase_ms"]) >= {"draft", "build", "verify", "decide", "commit"}
        if not torch.cuda.is_available():
            assert r["replay_ms"] is None and r["capture_s"] is None
    printed = capsys.readouterr()
    assert "eager ms" in printed.out and "verify ms" in printed.out
    if not torch.cuda.is_available():
        assert res["attention"] == "torch"  # auto's choice on the CPU
        assert "(torch attention, torch.float32, eager step)" in printed.out
        assert res["graphs"] is False and "need CUDA" in res["note"]
        assert "no GPU telemetry" in printed.out
        assert "no GPU telemetry" in res["gpu"]["telemetry"]


def test_profile_tune_writes_the_budget_policy(tmp_path, capsys):
    policy = tmp_path / "budgets.toml"
    rc = _profile(tmp_path, "--batch-sizes", "1,2", "--budget", "4", "--steps", "1",
                  "--warmup", "1", "--prompt-len", "5", "--tune", "--tune-budgets", "0,5",
                  "--tune-prompts", "4", "--tune-tokens", "7",
                  "--policy-out", str(policy), "--output", str(tmp_path / "p.json"))
    assert rc == 0
    budgets = load_budgets(policy)
    assert set(budgets) == {False, True}
    for table in budgets.values():
        assert set(table) == {1, 2} and set(table.values()) <= {0, 5}
    res = json.loads((tmp_path / "p.json").read_text())
    assert {(t["sample"], t["batch_size"], t["budget"]) for t in res["tune"]} == {
        (s, bs, b) for s in (False, True) for bs in (1, 2) for b in (0, 5)}
    for t in res["tune"]:
        # every budget decodes the same 7 new tokens of each of the 4 prompts (two rows: of
        # three batches' 6, as every size runs at least three batches), no more
        assert t["tokens"] == (4 if t["batch_size"] == 1 else 6) * 7
        assert t["accept"] == 1.0 if t["budget"] == 0 else 1.0 <= t["accept"] <= 4.0
    assert "measured" in policy.read_text()
    # it said beforehand how many runs it makes (greedy and sampled x 2 budgets x 4 + 3
    # batches), about how long they take, and where the table goes
    err = capsys.readouterr().err
    assert "tuning: 28 runs" in err and " about " in err and str(policy) in err, err


def test_a_tune_writes_beside_its_output_by_default(tmp_path):
    """Not over the table the engine ships (a tracked file): beside --output, under its
    name, unless --policy-out says where."""
    a = profile.build_parser().parse_args(["--tune", "--output", str(tmp_path / "p.json")])
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert profile.policy_out(a, cpu, False) == tmp_path / "budgets-cpu.toml"
    assert profile.policy_out(a, cpu, True) == tmp_path / "budgets-cpu-compiled.toml"
    assert profile.policy_out(a, cuda, True) == tmp_path / "budgets-cuda.toml"
    a.policy_out = "configs/budgets-cpu.toml"
    assert str(profile.policy_out(a, cpu, False)) == "configs/budgets-cpu.toml"


def test_a_tune_step_keeps_sampled_rows_drafting(tmp_path):
    """The tune applies each step as the scheduler does: a drafting step leaves the drafter's
    cache fed, so sampled rows are never taken for lagging ones (whose batches decode plainly)
    and every step of a budget's run drafts at that budget."""
    models = load_models(*write_pair(tmp_path))
    shape = StepShape("tree", 5, BLOCK, False)
    hot = [SamplingParams(temperature=0.7, seed=s) for s in (1, 2)]
    reqs = prefilled(models, make_pool(models), shape, [[5, 9, 300], [17] * 6], hot, steps=3)
    runner = runner_for(models, make_pool(models), shape, [2],
                        budgets={False: {2: 5}, True: {2: 5}})
    held = {r.rid: list(r.pages) for r in reqs}
    for _ in range(3):
        assert runner.step_shape(2, hot, lagging(reqs)) == StepShape("tree", 5, BLOCK, True)
        profile._step(runner, reqs, torch.device("cpu"), held)
    assert not lagging(reqs)


def test_a_tune_step_sees_the_pages_a_served_row_would_hold(tmp_path):
    """A tune's request holds every page its run may use, but each step sees only those the
    scheduler would have given it by then (its cache plus the step's span): the context a step
    gathers grows with the text, as in a served batch, instead of being the run's widest."""
    models = load_models(*write_pair(tmp_path))
    shape = StepShape("tree", 5, BLOCK, False)
    greedy = [SamplingParams(), SamplingParams()]
    reqs = prefilled(models, make_pool(models), shape, [[5, 9, 300], [17] * 6], greedy, steps=6)
    runner = runner_for(models, make_pool(models), shape, [2])
    held = {r.rid: list(r.pages) for r in reqs}
    for _ in range(3):
        need = [pages_needed(r.cache_len + shape.max_emit, PAGE) for r in reqs]
        assert all(n < len(held[r.rid]) for n, r in zip(need, reqs))
        profile._step(runner, reqs, torch.device("cpu"), held)
        assert [r.pages for r in reqs] == [held[r.rid][:n] for n, r in zip(need, reqs)]


def test_profile_errors_name_the_missing_thing(tmp_path, capsys):
    assert profile.main(["--model", str(tmp_path / "nope"), "--output",
                         str(tmp_path / "x.json")]) == 2
    assert "config.json missing" in capsys.readouterr().err
    target, _ = write_pair(tmp_path)
    assert profile.main(["--model", str(target), "--output", str(tmp_path / "x.json")]) == 2
    assert "needs a drafter" in capsys.readouterr().err


def test_profile_attends_as_the_engine_chooses(tmp_path, capsys):
    """`--attention` picks the backend the profiled models carry, by the engine's own choice
    (`engine.attention.select_backend`): the paged kernels' twins for triton on the CPU, torch
    for auto; the results name it; flashinfer, which cannot run here, is refused with the
    reason."""
    from engine.config import EngineConfig, parse_cli

    target, draft = write_pair(tmp_path)
    base = ["--model", str(target), "--draft", str(draft), "--no-progress", "--batch-sizes",
            "1,2", "--steps", "1", "--prompt-len", "5"]
    for want, name in (("triton", "paged"), ("auto", "torch"), ("torch", "torch")):
        a, cfg = parse_cli(profile.build_parser(), [*base, "--attention", want], EngineConfig)
        bench = profile.Bench(a, cfg, torch.device("cpu"), torch.float32)
        assert bench.models.attention.name == name
    rc = _profile(tmp_path, "--batch-sizes", "2", "--budget", "3", "--steps", "1", "--warmup",
                  "0", "--prompt-len", "5", "--attention", "triton", "--output",
                  str(tmp_path / "p.json"))
    res = json.loads((tmp_path / "p.json").read_text())
    assert rc == 0 and res["results"] and res["attention"] == "paged"
    assert "(paged attention," in capsys.readouterr().out
    assert _profile(tmp_path, "--attention", "flashinfer", "--output",
                    str(tmp_path / "x.json")) == 2
    assert "--attention flashinfer cannot run here" in capsys.readouterr().err
