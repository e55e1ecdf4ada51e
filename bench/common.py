"""Small helpers shared by the benchmarks: timing, JSON + PNG output, and the Markdown report."""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Generator, Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

DEFAULT_OUT = Path("runs/bench")
# `--report` writes here, one file per kind of run, each overwritten by the next of its kind.
REPORTS = Path(__file__).resolve().parent / "reports"


def interleave(passes: list[Generator[int, None, Any]], grain: int) -> list[Any]:
    """Run `passes` side by side: generators that yield the tokens each step of theirs added and
    return their result. Each in turn, in the given order, runs steps until it has added at
    least `grain` tokens, until every one has returned (0: each whole, one after another).
    Passes over the same requests then keep pace token for token, however fast each step is,
    and span the same stretch of time: a shared machine's speed drifts by a tenth from one
    second to the next, and passes taking turns every few milliseconds meet the same drift, so
    a ratio of their speeds is about the engines, not about when each ran. Returns their
    results."""
    if grain < 0:
        raise ValueError(f"grain must be >= 0, got {grain}")
    results: list[Any] = [None] * len(passes)
    live = list(range(len(passes)))
    while live:
        for i in list(live):
            added = 0
            while not grain or added < grain:
                try:
                    added += next(passes[i])
                except StopIteration as done:
                    results[i] = done.value
                    live.remove(i)
                    break
    return results


def paired_ratios(base: list[float], other: list[float]) -> list[float]:
    """Each round's own `other / base` (round `i` of each ran in the same pass, so a slow spell
    of the machine that spans it moves both)."""
    if len(base) != len(other) or not base:
        raise ValueError(f"paired rounds needed, got {len(base)} and {len(other)}")
    return [o / b for b, o in zip(base, other)]


def ratio_interval(base: list[float], other: list[float], level: float = 0.9,
                   draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A bootstrap interval of `median(other) / median(base)` over paired rounds (round `i` of
    each ran in the same pass): scipy's paired percentile bootstrap, `draws` resamples of the
    rounds, the middle `level` of the ratios. On a shared machine a ratio of two engines doing
    the same work moves by several percent from run to run; this says how far, from the run's
    own rounds."""
    paired_ratios(base, other)  # the rounds must pair
    import numpy as np
    from scipy.stats import bootstrap  # NOTE: a dev dependency, as the plots' matplotlib is

    res = bootstrap((base, other), lambda a, b: np.median(b) / np.median(a), paired=True,
                    vectorized=False, n_resamples=draws, confidence_level=level,
                    method="percentile", random_state=seed)
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def sync(device: torch.device | str) -> None:
    """Wait for queued device work, so that wall time measures the work itself."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_fn(
    fn: Callable[[], Any], *, warmup: int = 2, repeats: int = 10, device: str = "cpu"
) -> float:
    """Median wall time of `fn()` in seconds over `repeats` runs after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cpu_name(cpuinfo: str | None = None) -> str:
    """The CPU as Linux's `/proc/cpuinfo` (or the text `cpuinfo`) names its first processor, with
    its family, model and stepping: a cloud names different parts alike ("AMD EPYC"), and this
    project's ratios have read differently from one day's machine to another's. Elsewhere
    `platform.processor()`."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return platform.processor() or "unknown"
    info: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            info.setdefault(key.strip(), value.strip())
    name = info.get("model name") or platform.processor() or "unknown"
    ids = [f"{k.split()[-1]} {info[k]}" for k in ("cpu family", "model", "stepping") if k in info]
    return f"{name} ({', '.join(ids)})" if ids else name


def environment(device: str) -> dict[str, Any]:
    """What the numbers depend on, stored next to them."""
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "cpu": cpu_name(),
        "cpus": os.cpu_count(),
    }
    if torch.device(device).type == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    return env


def write_results(
    name: str,
    payload: dict[str, Any],
    plot: Callable[[Any], None] | None = None,
    out_dir: str | Path = DEFAULT_OUT,
) -> list[Path]:
    """Write `<out_dir>/<name>.json` and, given `plot(figure)`, `<name>.png`; print the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.json"]
    paths[0].write_text(json.dumps(payload, indent=2) + "\n")
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")  # headless: benchmarks run on machines without a display
        import matplotlib.pyplot as plt

        fig = plt.figure(figsize=(11, 4.5))
        plot(fig)
        fig.tight_layout()
        paths.append(out / f"{name}.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    for path in paths:
        print(f"wrote {path}")
    return paths


def _commit(repo: Path) -> str:
    """`git rev-parse --short HEAD`, with `+dirty` when tracked files outside the reports differ
    from it ("unknown" outside a git checkout)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True,
                              check=True).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        # NOTE: the reports themselves are left out, or each report would make the next dirty
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".",
                    ":(exclude)bench/reports")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def write_report(kind: str, prog: str, results: str | list[str], *,
                 argv: list[str] | None = None, files: Iterable[Path] = (), device: str = "cpu",
                 reports: str | Path = REPORTS) -> Path:
    """Write `<reports>/<kind>.md`: the command line (`python -m <prog>` and `argv`, by default
    this process's arguments), the commit, the machine, the date (UTC) and `results`, the text
    the benchmark printed, verbatim. `files` (its JSON and PNG) are copied beside the report as
    `<kind>.json` / `<kind>.png` and linked: the benchmarks write them under `runs/`, which git
    ignores. Returns the report's path."""
    out = Path(reports)
    out.mkdir(parents=True, exist_ok=True)
    args = sys.argv[1:] if argv is None else argv
    cmd = shlex.join(["python", "-m", prog, *args])
    env = environment(device)
    machine = (f"{env['cpu']}, {env['cpus']} cores, torch {env['torch']} "
               f"({env['threads']} thread{'s' * (env['threads'] != 1)}), Python {env['python']}")
    machine += f", GPU {env['gpu']}" if "gpu" in env else ", no GPU"
    if hasattr(os, "getloadavg"):  # a shared machine's other work moves every absolute number
        machine += f"; load average {os.getloadavg()[0]:.1f} when written"
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = results if isinstance(results, str) else "\n".join(results)
    lines = [f"# {prog}", "", "Written by the command below (`--report`); the next run of this "
             "kind overwrites it.", "",
             f"- Command: `{cmd}`", f"- Commit: `{_commit(Path(__file__).resolve().parents[1])}`",
             f"- Machine: {machine}", f"- Date: {date}", "", "## Results", "", "```",
             text.rstrip("\n"), "```"]
    copies = []
    for f in map(Path, files):
        if f.is_file():
            dest = out / f"{kind}{f.suffix}"
            if f.resolve() != dest.resolve():
                shutil.copyfile(f, dest)
            copies.append(dest)
    if copies:
        lines += ["", "Output: " + ", ".join(f"[{c.name}]({c.name})" for c in copies)]
        lines += [f"![{kind}]({c.name})" for c in copies if c.suffix == ".png"]
    path = out / f"{kind}.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {path}")
    return path


def server_metrics(url: str) -> dict[str, float]:
    """A server's `/metrics` as `{sample name with its labels: value}` (Prometheus text)."""
    import httpx

    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """A fixed-width text table; columns are (key, header, format spec); None prints "-"."""
    cells = [[header for _, header, _ in columns]]
    for row in rows:
        cells.append(["-" if row[key] is None else format(row[key], spec)
                      for key, _, spec in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def bench_prompts(llm: Any, model: Path, n: int, seed: int) -> tuple[list[list[int]], str]:
    """`n` prompts as token ids and where they come from: held-out corpus files (never trained
    on) for the bundled model, else random ids of the model's vocabulary (below its specials)."""
    import random

    from engine.llm import DEFAULT_MODEL

    if llm.tokenizer is not None and model.resolve() == DEFAULT_MODEL.resolve():
        from engine.held_out import held_out_prompts

        return [llm.encode_prompt(t) for t in held_out_prompts(n, seed)], "held-out corpus files"
    g, vocab = random.Random(seed), llm.models.target.cfg.vocab_size
    return ([[g.randrange(vocab - 256) for _ in range(g.randint(4, 32))] for _ in range(n)],
            "random token ids")

