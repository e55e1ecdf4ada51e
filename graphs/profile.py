"""Profile the captured spec step per batch size.

    python -m graphs.profile [--model DIR --draft DIR] [--batch-sizes 1,2,4,8] [--budget 16]
        [--mode tree|chain|ar] [--steps N] [--prompt-len T] [--temperature T] [--device cuda]
        [--output runs/profile/profile.json] [--tune --tune-budgets 0,2,4,8,16,32
        --tune-temperature 0.7 --policy-out configs/budgets-cpu.toml] [--tp N under torchrun]

For each batch size: capture time, graph memory, replay latency against the eager latency of the
same step, time per phase (eager, synchronized at phase edges), tokens per step, and GPU
telemetry from NVML. Each batch runs real requests (prefilled prompts of at most `--prompt-len`
tokens: held-out corpus text when the model has a tokenizer, else random ids) through the
runner, attention read by the backend `--attention` names (`auto` by default), chosen by
`engine.attention.select_backend` as the engine chooses it and named in the output; the eager
and the replayed runs start from the same state and must emit the same tokens. Without CUDA it
profiles the eager step on the CPU and says so; with `--compile on` the compiled step stands in
for the graph there (its first step's time, compile included, as the capture time).

Under `torchrun --nproc-per-node N ... --tp N` every rank runs the same steps and the table
adds the all-reduce share of the eager step.

`--tune` measures accepted length and step time per (greedy/sampled, batch size, budget), budget
0 (plain decoding through the same step) included, and writes the budget policy
(`engine.policy`) that maximizes tokens per second at each batch size, greedy and sampled (at
`--tune-temperature`), to `--policy-out`: by default beside `--output`, named as the table the
engine reads for that device and execution path (`engine.policy.policy_path`), which a tune
never overwrites unless told to (copy the file there, or give that path, to ship it): with
`--compile on`, the compiled CPU step's (`configs/budgets-cpu-compiled.toml`; its compiled steps
over a few token rows run on one thread, as the engine's do: `engine.cpu.ONE_THREAD_ROWS`).
Before it starts, a tune says how many runs it makes and about how long they take at the step
times the profile just measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from engine.attention import select_backend
from engine.config import (
    DEFAULT_BUDGET,
    EngineConfig,
    SamplingParams,
    add_cli_args,
    int_list,
    parse_cli,
)
from engine.cpu import ONE_THREAD_ROWS
from engine.dist import Group
from engine.kv_cache import pages_needed
from engine.llm import compiles, load_models, model_pair, resolve_device
from engine.policy import policy_path, write_tuned
from engine.request import Request
from engine.runner import CaptureError, PhaseTimer, StepGraphRunner
from engine.scheduler import Scheduler, next_shape, run_step
from engine.spec import StepShape
from graphs.measure import round_order
from graphs.telemetry import Telemetry

PHASES = ("draft", "build", "verify", "decide", "commit")
# A tune runs each batch size over at least this many batches: one batch of 16 rows is 16 prompts,
# too few to choose by: a near-tie over 16 prompts can be another prompt mix's loss.
TUNE_BATCHES = 3


def tune_prompts(a: argparse.Namespace, bs: int) -> int:
    """How many prompts a tune runs at batch size `bs`."""
    return max(a.tune_prompts, TUNE_BATCHES * bs)


NO_GRAPHS = "CUDA graphs need CUDA: this profiles the eager step (no capture, no replay)"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m graphs.profile",
                                 description=__doc__.split("\n")[0])
    # NOTE: the engine's own flags, less those this command sets itself per batch size.
    add_cli_args(ap, EngineConfig, exclude=("budget_policy", "max_batch_size", "max_model_len",
                                            "kv_pages", "capture_sizes"))
    ap.add_argument("--batch-sizes", type=int_list(1), default=[1, 2, 4, 8],
                    help="comma-separated batch sizes, each captured and profiled")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per batch size and path")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before timing")
    ap.add_argument("--prompt-len", type=int, default=32, help="prefilled tokens per request")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy graphs")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU intra-op threads (default on cpu: 1; the step's ops are small and "
                         "extra threads mostly spin)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default="runs/profile/profile.json", help="JSON results")
    ap.add_argument("--tune", action="store_true", help="measure every (greedy/sampled, batch "
                    "size, budget) and write the budget policy")
    ap.add_argument("--tune-budgets", type=int_list(0), default=[0, 2, 4, 8, 16, 32],
                    help="budgets --tune tries (0: plain decoding through the same step)")
    ap.add_argument("--tune-temperature", type=float, default=0.7,
                    help="the temperature of the sampled table's measurements")
    ap.add_argument("--tune-prompts", type=int, default=16,
                    help="prompts each --tune measurement runs (in batches of its size, at "
                         f"least {TUNE_BATCHES} batches)")
    ap.add_argument("--tune-tokens", type=int, default=64,
                    help="new tokens each --tune prompt decodes (every budget over the same "
                         "text; bench.spec and bench.serve decode 64)")
    ap.add_argument("--policy-out", default=None, help="where --tune writes the budget tables "
                    "(default: beside --output, named as the engine's table for the device, "
                    "configs/budgets-<device>[-compiled on the CPU].toml, which it leaves as it "
                    "is: give that path to replace it)")
    ap.add_argument("--no-progress", action="store_true")
    return ap


# ---- setup ----------------------------------------------------------------------------------


class Bench:
    """Models, one pool for the largest batch, and request factories."""

    def __init__(self, a: argparse.Namespace, cfg: EngineConfig, device: torch.device,
                 dtype: torch.dtype, tp: Group | None = None):
        self.model_dir, self.draft_dir = model_pair(cfg.model, cfg.draft)
        self.device, self.dtype = device, dtype
        # NOTE: under tensor parallelism every rank runs this same script (same prompts, same
        # steps), so the ranks' collectives line up without a leader.
        self.models, _ = load_models(cfg, device, dtype, tp, progress=not a.no_progress)
        target, drafter = self.models.target, self.models.drafter
        self.a = a
        self.block = drafter.c.block_size if drafter else 2
        self.budget = DEFAULT_BUDGET if a.budget is None else a.budget
        budgets = a.tune_budgets if a.tune else []
        top = StepShape(a.mode, max([self.budget, *budgets]), self.block, False)
        self.span = top.max_emit
        # every request holds its prompt plus every step a profile may run, warm-ups included
        self.tokens = a.prompt_len + max((a.warmup + a.steps + 2) * self.span,
                                         a.tune_tokens + 2 * self.span if a.tune else 0)
        self.max_pages = pages_needed(self.tokens, a.page_size)
        self.held: dict[int, list[int]] = {}  # request id -> every page it may use (`_step`)
        c = target.cfg
        if self.tokens > c.max_position_embeddings:
            raise ValueError(f"--prompt-len {a.prompt_len} plus the steps run exceeds the "
                             f"model's {c.max_position_embeddings} positions")
        self.pool = self.models.kv_pool(a.page_size, 1 + max(a.batch_sizes) * self.max_pages,
                                        dtype, device)
        # NOTE: attention as the engine chooses it (`--attention`), for every (batch size, tree
        # nodes) a runner here may step: each budget, and plain decoding (lagging rows).
        nodes = {self.shape(b).num_nodes for b in {self.budget, 0, *budgets}}
        self.models.attention = select_backend(
            cfg.attention, target, self.pool, [(bs, n) for bs in a.batch_sizes for n in nodes],
            self.max_pages)
        n = max(a.batch_sizes) if not a.tune else max(tune_prompts(a, b) for b in a.batch_sizes)
        from engine.tokenizer import Tokenizer

        tok = Tokenizer.of_model(self.model_dir)
        if tok is not None:
            from engine.held_out import held_out_prompts

            self.prompts = [tok.encode(t)[-a.prompt_len:] for t in held_out_prompts(n, a.seed)]
        else:
            g = torch.Generator().manual_seed(a.seed)
            self.prompts = torch.randint(0, c.vocab_size, (n, a.prompt_len), generator=g).tolist()

    def shape(self, budget: int) -> StepShape:
        return StepShape(self.a.mode, budget, self.block, False)

    def runner(self, sizes: list[int], budget: int, use_graphs: bool = False
               ) -> StepGraphRunner:
        """A runner for `sizes` at one budget; `use_graphs`: captured on CUDA, compiled on the
        CPU."""
        budgets = {s: dict.fromkeys(sizes, budget) for s in (False, True)}
        cuda = self.device.type == "cuda"
        return StepGraphRunner(self.models, self.pool, self.shape(self.budget),
                               max_batch_size=max(sizes), max_pages=self.max_pages,
                               capture_sizes=sizes, use_graphs=use_graphs and cuda,
                               budgets=budgets, compile=use_graphs and not cuda)

    def requests(self, bs: int, runner: StepGraphRunner, temperature: float, first: int = 0
                 ) -> list[Request]:
        """`bs` prefilled requests (prompts `first ..`) on fresh pages (the pool is reused batch
        after batch), each holding every page its run may use in `held`."""
        a = self.a
        # a fresh scheduler (and allocator) per batch: the pool is reused batch after batch
        sch = Scheduler(runner, num_pages=self.pool.num_pages, page_size=self.pool.page_size,
                        vocab_size=self.models.target.cfg.vocab_size, max_batch_size=bs,
                        max_model_len=self.tokens + self.span)
        reqs = []
        for i in range(first, first + bs):
            r = Request(i, list(self.prompts[i % len(self.prompts)]), SamplingParams(
                temperature=temperature, seed=a.seed + i, max_new_tokens=1 << 20))
            r.output_ids += sch.prefill([r])[0]
            sch._grow(r, self.tokens)
            self.held[r.rid] = list(r.pages)
            reqs.append(r)
        return reqs


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _snapshot(reqs: list[Request]) -> list[Request]:
    return [r.fork() for r in reqs]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _step(runner: StepGraphRunner, reqs: list[Request], device: torch.device,
          held: dict[int, list[int]]) -> tuple[float, list[list[int]]]:
    """One timed step of `reqs`, applied to them as the scheduler applies a step. Each row
    sees the pages of `held` that the scheduler would have given it by now (its cache and what
    this step may write): the page table's width, and so the context a step gathers, grows with
    the text as it does in a served batch."""
    shape = next_shape(runner, reqs)
    for r in reqs:
        r.pages = held[r.rid][:pages_needed(r.cache_len + shape.max_emit, runner.pool.page_size)]
    _sync(device)
    t0 = time.perf_counter()
    out, _ = run_step(runner, reqs, shape.drafts)
    dt = time.perf_counter() - t0
    for r, toks in zip(reqs, out):
        r.output_ids += toks
    return dt, out


def _run(runner: StepGraphRunner, reqs: list[Request], held: dict[int, list[int]], warmup: int,
         steps: int, device: torch.device, horizon: int | None = None) -> dict[str, Any]:
    """Advance `reqs` through `warmup + steps` steps; time the last `steps`. With `horizon`,
    the warm-up steps run on a copy and the timed steps go on until every row has `horizon`
    new tokens, counting each row's steps and tokens only up to there: every budget is then
    measured over the same stretch of text (a long run drifts into repetition, which any
    drafter predicts, so a fixed step count favours the budgets that get there first)."""
    tp = runner.models.tp
    warm = _snapshot(reqs) if horizon is not None else reqs
    first = 0.0
    for _ in range(warmup):
        first = first or _step(runner, warm, device, held)[0]
    runner.timer.totals.clear()
    if tp is not None:
        tp.comm.reset()
    times, emitted, tokens, row_steps, got = [], [], 0, 0, [0] * len(reqs)
    while len(times) < steps if horizon is None else min(got) < horizon:
        dt, out = _step(runner, reqs, device, held)
        first = first or dt
        times.append(dt)
        emitted.append(out)
        for k, toks in enumerate(out):
            if horizon is None or got[k] < horizon:
                row_steps += 1
                tokens += len(toks) if horizon is None else min(len(toks), horizon - got[k])
            got[k] += len(toks)
    comm = tp.comm.seconds.get("all_reduce", 0.0) if tp is not None else None
    return {"median_s": statistics.median(times), "total_s": sum(times), "steps": len(times),
            "tokens": tokens, "row_steps": row_steps, "emitted": emitted,
            "phases": dict(runner.timer.totals), "allreduce_s": comm, "first_s": first}


def profile_size(bench: Bench, bs: int, budget: int, graphs: bool, tel: Telemetry,
                 temperature: float, first: int = 0, horizon: int | None = None,
                 kept: dict[bool, StepGraphRunner] | None = None) -> dict[str, Any]:
    """Eager (phase-timed) and, on CUDA, captured runs of one batch size at one budget, over
    prompts `first ..` (for `horizon` new tokens each, if given; see `_run`). `kept` holds the
    runners (eager: False, graphs: True) from one call to the next: a tune's batches of one
    (batch size, budget) then capture or compile once."""
    a, dev = bench.a, bench.device
    owned = kept is None
    kept = {} if kept is None else kept
    if False not in kept:
        kept[False] = bench.runner([bs], budget, use_graphs=False)
    runner = kept[False]
    # NOTE: both runs start from this state with the same coins, so they must agree.
    start = _snapshot(bench.requests(bs, runner, temperature, first))
    runner.timer = PhaseTimer(sync=dev.type == "cuda")
    tp = bench.models.tp
    if tp is not None:
        tp.timed = True  # eager only: a replayed graph's collectives are not seen
    eager = _run(runner, _snapshot(start), bench.held, a.warmup, a.steps, dev, horizon)
    if tp is not None:
        tp.timed = False
    row: dict[str, Any] = {
        "batch_size": bs, "budget": budget if a.mode == "tree" else None,
        "nodes": runner.shape.num_nodes,
        "eager_ms": eager["median_s"] * 1e3,
        "phase_ms": {k: eager["phases"].get(k, 0.0) * 1e3 / eager["steps"]
                     for k in (*PHASES, "host")},
        "tokens_per_step": eager["tokens"] / eager["row_steps"],
        "tokens": eager["tokens"], "row_steps": eager["row_steps"],
        "capture_s": None, "graph_bytes": None, "replay_ms": None, "speedup": None,
        "replay_matches_eager": None,
        "allreduce_share": (eager["allreduce_s"] / eager["total_s"]
                            if eager["allreduce_s"] is not None else None),
    }
    best = eager
    if graphs:
        if True not in kept:
            kept[True] = bench.runner([bs], budget, use_graphs=True)
            if kept[True].compiled is None:  # a compiled step compiles at its first step
                kept[True].capture(progress=False)
        g = kept[True]
        try:
            with tel.sampler() as smp:
                replay = _run(g, _snapshot(start), bench.held, a.warmup, a.steps, dev, horizon)
            stats = list(g.capture_stats.values())
            row["capture_s"] = replay["first_s"] if g.compiled is not None else sum(
                s["seconds"] for s in stats)
            row["graph_bytes"] = sum(s["bytes"] for s in stats)
            row["replay_ms"] = replay["median_s"] * 1e3
            row["speedup"] = eager["median_s"] / replay["median_s"]
            row["replay_matches_eager"] = replay["emitted"] == eager["emitted"]
            row.update(smp.summary(replay["total_s"], replay["tokens"]))
            best = replay
        finally:
            del g
            if owned:
                kept.clear()
                _free()
    # each row's tokens per step at the batch's mean step time (without `horizon`: tokens over
    # time; with it, rows done before the slowest would, in a server, make way for others)
    row["tokens_per_s"] = row["tokens_per_step"] * bs * best["steps"] / best["total_s"]
    return row


# ---- output -----------------------------------------------------------------------------------


def _f(x: Any, fmt: str, width: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:{width}{fmt}}"


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'bs':>4} {'budget':>6} {'capture s':>9} {'graph MiB':>9} {'eager ms':>9} "
            f"{'replay ms':>9} {'x eager':>7} {'tok/step':>8} {'tok/s':>9} "
            + " ".join(f"{p + ' ms':>9}" for p in PHASES) + f" {'J/tok':>7} {'allred %':>8}")
    lines = [head]
    for r in rows:
        mib = None if r["graph_bytes"] is None else r["graph_bytes"] / 2**20
        lines.append(
            f"{r['batch_size']:>4} {_f(r['budget'], 'd', 6)} {_f(r['capture_s'], '.2f', 9)} "
            f"{_f(mib, '.1f', 9)} {r['eager_ms']:9.2f} {_f(r['replay_ms'], '.2f', 9)} "
            f"{_f(r['speedup'], '.2f', 7)} {r['tokens_per_step']:8.2f} {r['tokens_per_s']:9.1f} "
            + " ".join(f"{r['phase_ms'][p]:9.2f}" for p in PHASES)
            + f" {_f(r.get('joules_per_token'), '.3f', 7)}"
            + f" {_f(r['allreduce_share'] and 100 * r['allreduce_share'], '.1f', 8)}")
    return "\n".join(lines)


def tune_estimate(a: argparse.Namespace, rows: list[dict[str, Any]]) -> tuple[int, float]:
    """The runs a tune makes and about how many seconds they take, from the profiled `rows`
    (one per batch size, at the profile's budget): each run decodes `--tune-tokens` tokens a
    row at that row's accepted length (one a step at budget 0) and step time, and each
    (temperature, batch size, budget) captures or compiles its step once. A rough guide: a
    budget's step takes its own time."""
    runs, seconds = 0, 0.0
    for r in rows:
        bs = r["batch_size"]
        step_s = (r["replay_ms"] if r["replay_ms"] is not None else r["eager_ms"]) / 1e3
        batches = len(range(0, tune_prompts(a, bs), bs))
        for b in a.tune_budgets:
            steps = a.tune_tokens / (1.0 if b == 0 else max(r["tokens_per_step"], 1.0))
            runs += 2 * batches
            seconds += 2 * (batches * (steps + a.warmup) * step_s + (r["capture_s"] or 0.0))
    return runs, seconds


def tune(bench: Bench, graphs: bool, tel: Telemetry, progress: bool) -> list[dict[str, Any]]:
    from tqdm import tqdm

    a = bench.a
    budgets, out = a.tune_budgets, []
    firsts = {bs: range(0, tune_prompts(a, bs), bs) for bs in a.batch_sizes}
    bar = tqdm(total=2 * len(budgets) * sum(map(len, firsts.values())), desc="tuning budgets",
               disable=not progress)
    for temperature in (0.0, a.tune_temperature):
        for bs in a.batch_sizes:
            # NOTE: on each batch of prompts every budget runs in turn, in rotating order, so a
            # drift in the machine's speed falls on all of them alike, and each sees the same text
            kept: dict[int, dict[bool, StepGraphRunner]] = {b: {} for b in budgets}
            runs: dict[int, list[dict[str, Any]]] = {b: [] for b in budgets}
            for i, first in enumerate(firsts[bs]):
                for b in round_order(budgets, i):
                    runs[b].append(profile_size(bench, bs, b, graphs, tel, temperature, first,
                                                a.tune_tokens, kept[b]))
                    bar.update()
            kept.clear()
            _free()
            for b, rs in runs.items():
                ms = statistics.mean(r["replay_ms"] if r["replay_ms"] is not None
                                     else r["eager_ms"] for r in rs)
                tokens = sum(r["tokens"] for r in rs)
                out.append({"sample": temperature > 0, "batch_size": bs, "budget": b,
                            "accept": tokens / sum(r["row_steps"] for r in rs), "step_ms": ms,
                            "tokens": tokens, "tokens_per_s": tokens / sum(
                                r["tokens"] / r["tokens_per_s"] for r in rs)})
    bar.close()
    return out


def main(argv: list[str] | None = None) -> int:
    a, cfg = parse_cli(build_parser(), argv, EngineConfig)
    if a.mode != "tree" and a.tune:
        print("error: --tune chooses tree budgets; use --mode tree", file=sys.stderr)
        return 2
    if a.steps < 1 or a.prompt_len < 1 or a.tune_tokens < 1:
        print("error: --steps, --prompt-len and --tune-tokens must be >= 1", file=sys.stderr)
        return 2
    if a.tune and a.tune_temperature <= 0:
        print("error: --tune-temperature must be > 0 (the sampled table)", file=sys.stderr)
        return 2
    try:
        device, dtype = resolve_device(cfg)
        compiled = compiles(cfg, device)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    graphs = device.type == "cuda" or compiled  # captured on CUDA, compiled on the CPU
    progress = not a.no_progress
    if a.threads or device.type == "cpu":
        torch.set_num_threads(a.threads or 1)
    tp = None
    try:
        if cfg.tp != 1:
            tp = Group.init(cfg.tp, device, heartbeat_timeout_s=cfg.tp_timeout)
            device = tp.device
            progress = progress and tp.rank == 0
            a.no_progress = not progress
        bench = Bench(a, cfg, device, dtype, tp)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return _profile(a, bench, device, dtype, graphs, progress)
    finally:
        if tp is not None:
            tp.close()


def policy_out(a: argparse.Namespace, device: torch.device, graphs: bool) -> Path:
    """Where a tune writes its table: `--policy-out`, else beside `--output` under the name of
    the engine's table for the device and execution path (not over that shipped file)."""
    if a.policy_out:
        return Path(a.policy_out)
    shipped = policy_path(device.type, graphs and device.type == "cpu")
    return Path(a.output).parent / shipped.name


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _step_kind(device: torch.device, graphs: bool) -> str:
    if not graphs:
        return "eager"
    return "graph replay" if device.type == "cuda" else "compiled"


def _profile(a: argparse.Namespace, bench: Bench, device: torch.device, dtype: torch.dtype,
             graphs: bool, progress: bool) -> int:
    leader = bench.models.tp is None or bench.models.tp.rank == 0
    tel = Telemetry(device.index or 0, enabled=device.type == "cuda")
    if not graphs and leader:
        print(f"note: {NO_GRAPHS}.", file=sys.stderr)
    from tqdm import tqdm

    rows = []
    try:
        for bs in tqdm(a.batch_sizes, desc="profiling batch sizes", disable=not progress):
            rows.append(profile_size(bench, bs, bench.budget, graphs, tel, a.temperature))
        if a.tune and leader:
            runs, seconds = tune_estimate(a, rows)
            print(f"tuning: {runs} runs (greedy and sampled, budgets "
                  f"{','.join(map(str, a.tune_budgets))}, batch sizes "
                  f"{','.join(map(str, a.batch_sizes))}), about {_duration(seconds)} at the "
                  f"profiled step times; the table goes to {policy_out(a, device, graphs)}",
                  file=sys.stderr)
        tuned = tune(bench, graphs, tel, progress) if a.tune else []
    except CaptureError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    result: dict[str, Any] = {
        "model": str(bench.model_dir), "draft": str(bench.draft_dir) if bench.draft_dir else None,
        "mode": a.mode, "budget": bench.budget, "device": str(device), "dtype": str(dtype),
        "attention": bench.models.attention.name, "graphs": graphs,
        "note": None if graphs else NO_GRAPHS,
        "prompt_len": a.prompt_len, "steps": a.steps, "temperature": a.temperature,
        "tune_tokens": a.tune_tokens if a.tune else None,
        "torch": torch.__version__, "gpu": tel.static(), "results": rows,
    }
    tel.close()
    if not leader:
        return 0  # every rank measured; rank 0 reports
    if bench.models.tp is not None:
        result["tp"] = bench.models.tp.world
    if a.tune:
        compiled = graphs and device.type == "cpu"
        n = torch.get_num_threads()
        where = policy_out(a, device, graphs)
        threads = f"{n} threads" + (f" (one for steps of <= {ONE_THREAD_ROWS} token rows)"
                                    if compiled and n > 1 else "")
        result.update(write_tuned(where, tuned, note=(
            f"model {bench.model_dir.name}, drafter {bench.draft_dir and bench.draft_dir.name}, "
            f"{device} {dtype}, {threads}, {_step_kind(device, graphs)} step "
            f"time, prompts of <= {a.prompt_len} tokens, {a.tune_tokens} new tokens each, "
            f"sampled at T = {a.tune_temperature}")))
    out = Path(a.output)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    except OSError as e:
        raise SystemExit(f"--output {out}: cannot write the results ({e})") from e
    sys.stderr.flush()
    print(table(rows))
    print(f"({result['attention']} attention, {dtype}, {_step_kind(device, graphs)} step)")
    if not graphs:
        print(f"({NO_GRAPHS}; {tel.reason})")
    elif not tel.available:
        print(f"({tel.reason})")
    else:
        s = result["gpu"]
        print(f"({s.get('name')}, SM clock {s.get('sm_clock_mhz')} MHz, PCIe gen "
              f"{s.get('pcie_gen')} x{s.get('pcie_width')}, NVLink links up "
              f"{s.get('nvlink_active_links')})")
    if a.tune:
        print(f"budget policy {result['policy']['budgets']} -> {result['policy']['path']}")
        shipped = policy_path(device.type, graphs and device.type == "cpu")
        if Path(result["policy"]["path"]).resolve() != shipped.resolve():
            print(f"(the engine reads {shipped}: copy the table there to make it the default, "
                  f"or pass --budget-policy {result['policy']['path']})")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
