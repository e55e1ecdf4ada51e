"""`python -m bench.spec` end to end on a tiny random pair: every run appears once per round,
greedy outputs of every mode equal ar's, and the JSON and plot are written; and its
perfect-drafter ceiling; `python -m bench.job` on a two-line job; the order of the interleaved
runs; the interval of a ratio; and a server cell's paired ratio."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest

from bench import job, serve, spec
from bench.common import cpu_name, environment, interleave, ratio_interval, write_report
from graphs.measure import round_order


def test_bench_spec_random_pair(tmp_path: Path) -> None:
    spec.main(["--random", "--budgets", "2", "4", "--prompts", "2", "--max-new-tokens", "6",
               "--rounds", "2", "--no-transformers", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "spec.json").read_text())
    names = [r["name"] for r in data["runs"]]
    assert names == ["ar", "chain", "tree-2", "tree-4", "tree-16 T=0.7", "policy", "ar T=0.7",
                     "policy T=0.7"]
    runs = {r["name"]: r for r in data["runs"]}
    for r in data["runs"]:
        assert len(r["tokens_per_s_rounds"]) == 2
        assert r["tokens_per_s"] in r["tokens_per_s_rounds"]
        assert r["tokens"] == 2 * 6
        if r["temperature"] == 0:
            assert r["same_as_ar"] == 2
    # sampled runs are measured against sampled ar
    hot = runs["policy T=0.7"]
    assert hot["speedup_vs_ar"] == pytest.approx(hot["tokens_per_s"] /
                                                 runs["ar T=0.7"]["tokens_per_s"])
    assert data["summary"]["policy_vs_ar T=0.7"] == hot["speedup_vs_ar"]
    lo, hi = hot["speedup_vs_ar_90"]
    assert data["summary"]["policy_vs_ar_90 T=0.7"] == [lo, hi] and lo <= hi
    assert (tmp_path / "spec.png").stat().st_size > 0


def test_bench_spec_policy_only(tmp_path: Path) -> None:
    spec.main(["--random", "--policy-only", "--batch", "2", "--prompts", "3",
               "--max-new-tokens", "4", "--rounds", "1", "--no-transformers", "--out",
               str(tmp_path)])
    data = json.loads((tmp_path / "spec.json").read_text())
    assert [r["name"] for r in data["runs"]] == ["ar", "policy", "ar T=0.7", "policy T=0.7"]
    assert set(data["summary"]) == {"policy_vs_ar", "policy_vs_ar T=0.7"}


def test_ratio_interval_brackets_the_ratio_of_medians() -> None:
    """The bootstrap interval of a paired ratio: exact when every round agrees, around the ratio
    of medians when rounds scatter, wider with fewer rounds, and the same on every call."""
    base = [100.0, 90.0, 110.0, 95.0, 105.0, 80.0, 120.0]
    assert ratio_interval(base, base) == (1.0, 1.0)
    assert ratio_interval(base, [2 * x for x in base]) == pytest.approx((2.0, 2.0))
    g = random.Random(1)
    a = [100 * g.uniform(0.8, 1.2) for _ in range(41)]
    b = [x * g.uniform(0.9, 1.1) for x in a]
    lo, hi = ratio_interval(a, b)
    assert lo < statistics.median(b) / statistics.median(a) < hi
    lo5, hi5 = ratio_interval(a[:5], b[:5])
    assert hi5 - lo5 > hi - lo
    assert ratio_interval(a, b) == (lo, hi)
    with pytest.raises(ValueError, match="paired rounds"):
        ratio_interval(a, b[:-1])


def test_perfect_ceiling_bounds(tmp_path: Path) -> None:
    """The perfect-drafter ceiling: 1 at budget 0, at most 1 + budget, growing with the budget,
    and nearly 1 + budget when the target is almost deterministic (a cold temperature)."""
    pytest.importorskip("transformers")
    from tools.make_tiny import make_tiny

    model = make_tiny(tmp_path / "t", dtype="fp32", layers=2, hidden=128)
    prompts, outputs = [[5, 6, 7], [9, 10]], [[11, 12, 13, 14], [15, 16, 17]]
    cap = {b: spec.perfect_ceiling(model, prompts, outputs, b, 1.0, positions=4)
           for b in (0, 2, 6)}
    assert cap[0] == 1.0 and 1.0 < cap[2] < cap[6] <= 7.0
    cold = spec.perfect_ceiling(model, prompts, outputs, 6, 1e-4, positions=4)
    assert cold == pytest.approx(7.0, abs=0.05)


def test_round_order_rotates_every_run_through_every_place() -> None:
    runs = ["ar", "policy", "ar T=0.7", "policy T=0.7"]
    rounds = [round_order(runs, i) for i in range(len(runs))]
    assert all(sorted(r) == sorted(runs) for r in rounds)
    for place in range(len(runs)):
        assert sorted(r[place] for r in rounds) == sorted(runs)
    # no run goes first right after going last (its caches still warm)
    assert all(a[-1] != b[0] for a, b in zip(rounds, rounds[1:] + rounds[:1]))


def test_a_server_cell_pairs_each_round() -> None:
    # round 2 is a slow spell for both servers; the default's median is round 3's and AR's
    # round 1's, so their ratio pairs runs of two different rounds
    rounds = lambda *r: [{"tokens_per_s": x, "tokens": 64, "seconds": 64 / x} for x in r]
    row = serve.cell_row(0.7, 4, rounds(100, 50, 90), rounds(90, 45, 100))
    assert row["ratio"] == pytest.approx(1.0)
    assert row["round_ratios"] == pytest.approx([10 / 9, 10 / 9, 0.9])
    assert row["round_median"] == pytest.approx(10 / 9)
    assert (row["temperature"], row["clients"]) == (0.7, 4)
    with pytest.raises(ValueError):  # every round runs both servers
        serve.cell_row(0, 1, rounds(100, 50), rounds(100))


def test_a_server_cell_takes_turns_of_requests_per_client() -> None:
    cuts = lambda *a: [(r.start, r.stop) for r in serve.turns(*a)]
    assert cuts(32, 1, 4) == [(i, i + 4) for i in range(0, 32, 4)]
    assert cuts(32, 4, 4) == [(0, 16), (16, 32)]
    assert cuts(32, 16, 4) == [(0, 32)]  # a turn larger than the cell: the cell whole
    assert cuts(10, 1, 4) == [(0, 4), (4, 8), (8, 10)]  # the last turn takes what is left
    assert cuts(32, 4, 0) == [(0, 32)]  # 0: one turn


def test_the_environment_names_the_cpu_part() -> None:
    """Two parts a cloud calls alike are told apart by family, model and stepping."""
    info = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\n"
            "model name\t: AMD EPYC\nstepping\t: 1\n\nprocessor\t: 1\nmodel name\t: other\n")
    assert cpu_name(info) == "AMD EPYC (family 25, model 1, stepping 1)"
    assert cpu_name("model name : Some CPU\n") == "Some CPU"
    env = environment("cpu")
    assert env["cpu"] and env["cpus"] >= 1



def test_a_report_holds_command_commit_machine_date_and_table(tmp_path: Path) -> None:
    """`--report`'s writer: the command line, the commit, the machine, the UTC date and the
    printed table verbatim, in `<kind>.md`; the run's JSON and PNG copied beside it and linked;
    a second run of the kind overwrites the first."""
    import re

    rows = "  run  tok/s\n-----  -----\n   ar  100.0\n tree  150.0"
    data = tmp_path / "runs" / "spec.json"
    data.parent.mkdir()
    data.write_text("{}\n")
    reports = tmp_path / "reports"
    path = write_report("spec", "bench.spec", [rows, "policy_vs_ar 1.50"],
                        argv=["--prompts", "2", "--out", "a b"], files=[data], reports=reports)
    assert path == reports / "spec.md"
    text = path.read_text()
    assert "- Command: `python -m bench.spec --prompts 2 --out 'a b'`" in text
    assert re.search(r"^- Commit: `([0-9a-f]{4,}(\+dirty)?|unknown)`$", text, re.M)
    machine = re.search(r"^- Machine: (.+)$", text, re.M)
    assert machine and environment("cpu")["cpu"] in machine[1] and "torch " in machine[1]
    assert re.search(r"^- Date: \d{4}-\d\d-\d\d \d\d:\d\d UTC$", text, re.M)
    assert f"```\n{rows}\npolicy_vs_ar 1.50\n```" in text
    assert (reports / "spec.json").read_text() == "{}\n" and "[spec.json](spec.json)" in text
    write_report("spec", "bench.spec", "other", argv=[], reports=reports)
    assert "other" in path.read_text() and "tree  150.0" not in path.read_text()

def test_bench_job_pairs_the_cli_with_ar(tmp_path: Path) -> None:
    """Two fresh `engine.generate` processes a pair, each mode's printed tokens/s read back, and
    greedy lines the same in both modes."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):\\n"}\n{"prompt": "import os\\n"}\n')
    job.main(["--pairs", "1", "--prompts", str(prompts), "--out", str(tmp_path),
              "--max-new-tokens", "5"])
    data = json.loads((tmp_path / "job.json").read_text())
    assert data["flags"] == ["--max-new-tokens", "5"]
    assert sorted(r["mode"] for r in data["runs"]) == ["ar", "default"]
    s = data["summary"]
    assert s["same_as_ar"] == s["runs"] == 2
    assert s["steps"]["ar"] == 2 * 4  # the first token comes from the prefill
    assert s["ratio"] == pytest.approx(s["tokens_per_s"]["default"] / s["tokens_per_s"]["ar"])
    assert s["pair_median"] == pytest.approx(s["ratio"])  # one pair: its ratio is both
    for r in data["runs"]:
        lines = (tmp_path / "job" / f"{r['mode']}-0.jsonl").read_text().splitlines()
        assert [len(json.loads(x)["token_ids"]) for x in lines] == [5, 5]
    assert (tmp_path / "job.png").stat().st_size > 0
    with pytest.raises(SystemExit):  # the benchmark names each run's output itself
        job.main(["--output", "x.jsonl"])
    with pytest.raises(ValueError, match="no summary line"):
        job.parse_summary("error: something else\n")


def test_interleave_takes_turns_and_returns_each_result() -> None:
    log: list[str] = []

    def run(name: str, steps: int, tokens: int):
        for k in range(steps):
            log.append(f"{name}{k}")
            yield tokens
        return name * 2

    # turns of at least 2 tokens: one step of a's (2 tokens a step), two of b's (1)
    assert interleave([run("a", 3, 2), run("b", 5, 1)], 2) == ["aa", "bb"]
    assert log == ["a0", "b0", "b1", "a1", "b2", "b3", "a2", "b4"]
    log.clear()
    assert interleave([run("a", 3, 2), run("b", 2, 1)], 0) == ["aa", "bb"]  # each whole
    assert log == ["a0", "a1", "a2", "b0", "b1"]
    with pytest.raises(ValueError, match="grain"):
        interleave([run("a", 1, 1)], -1)


def test_stepwise_generation_leaves_out_its_suspended_time(tmp_path: Path, monkeypatch) -> None:
    """`generate_stepwise` yields each step's new tokens, gives `generate`'s outputs, and its
    stats count only the time it ran: a clock that jumps by 100 s while it is suspended leaves
    its seconds under 100."""
    import time

    from engine import LLM, SamplingParams
    from tools.make_tiny import make_tiny

    llm = LLM(make_tiny(tmp_path / "t", dtype="fp32", layers=2, hidden=128), mode="ar",
              progress=False)
    prompts, params = [[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=5, ignore_eos=True)
    ref = [o.token_ids for o in llm.generate(prompts, params)]
    now = [0.0]

    def clock() -> float:
        now[0] += 1e-3
        return now[0]

    monkeypatch.setattr(time, "perf_counter", clock)
    steps, suspensions, added = llm.generate_stepwise(prompts, params), 0, 0
    while True:
        try:
            added += next(steps)
        except StopIteration as done:
            outs = done.value
            break
        suspensions += 1
        now[0] += 100.0
    assert [o.token_ids for o in outs] == ref
    assert added == sum(map(len, ref))  # each step yields the tokens it added
    assert suspensions >= 4 and now[0] > 100 * suspensions  # one token a step after the first
    assert 0 < llm.stats["seconds"] < 100


def test_bench_soak_passes_a_short_mix(tmp_path: Path, capsys) -> None:
    """`bench.soak` against the bundled pair: one request of each kind (good, bad, leaving, slow)
    gets its expected status, and the server ends with every page back, no 500 and no ERROR."""
    from bench import soak

    soak.main(["--requests", str(len(soak.KINDS)), "--concurrency", "4", "--max-tokens", "4",
               "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "result: PASS" in out and "unexpected" not in out
    assert "server log: 0 ERROR or Traceback lines" in out


def test_bench_host_times_the_real_scheduler_around_a_noop_step(tmp_path: Path) -> None:
    """`python -m bench.host` at two sizes: a row per (batch, context, stop strings), its host
    time per step and per token, with the no-op step's tokens applied to every row."""
    from bench import host

    out = tmp_path / "host.json"
    assert host.main(["--batch-sizes", "1,2", "--contexts", "40", "--steps", "2", "--rounds",
                      "1", "--json", str(out), "--out", str(tmp_path)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch_size"], r["stop_strings"]) for r in rows] == [(1, 0), (1, 2), (2, 0),
                                                                    (2, 2)]
    for r in rows:
        assert r["context"] == 40 and r["host_us_per_step"] > 0
        assert r["host_us_per_token"] == pytest.approx(
            r["host_us_per_step"] / (4 * r["batch_size"]))
    sched, reqs = host.setup(host.LLM(progress=False, kv_pages=2, compile="off"), 2, 40, 4, True)
    sched.step()
    assert all(len(r.output_ids) == 1 + 4 and r.cache_len == 44 for r in reqs)


def test_bench_host_streaming_pairs_each_round(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    """`--streaming`: each round runs streamed and whole back to back (their order alternating)
    on one server given `--server-args`, and the ratios are the medians of each round's."""
    from bench import host

    started: list[list[str]] = []

    class FakeServer:
        url = "http://fake"

        def __init__(self, name: str, args: list[str], log: Path):
            started.append(args)

        def wait_healthy(self, timeout: float) -> None:
            pass

        def stop(self) -> None:
            pass

    calls: list[bool] = []
    # per round: (whole step ms, streamed step ms); the machine drifts from round to round
    steps = iter([10.0, 40.0, 44.0, 20.0, 21.0, 80.0, 80.0])  # warm-up, then rounds 1-3

    def load(url: str, clients: int, tokens: int, stream: bool) -> dict[str, float]:
        calls.append(stream)
        ms = next(steps)
        return {"step_ms": ms, "tokens_per_s": 1000 / ms}

    monkeypatch.setattr("bench.serve.Server", FakeServer)
    monkeypatch.setattr(host, "serve_load", load)
    st = host.streaming(4, 8, 3, tmp_path, ["--reserve-cpus", "0"])
    assert started[0][-2:] == ["--reserve-cpus", "0"]
    assert calls == [False, False, True, True, False, False, True]
    # rounds: (whole 40, streamed 44), (whole 21, streamed 20), (whole 80, streamed 80)
    assert st["step_ratio"] == pytest.approx(1.0)
    assert st["throughput_ratio"] == pytest.approx(1.0)
    assert st["step_ms_streamed"] == 44.0 and st["step_ms_not_streamed"] == 40.0
