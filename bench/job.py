"""A job as the CLI runs it, in the engine's default mode against `--mode ar`:

    python -m bench.job [--pairs 16] [--prompts examples/prompts.jsonl] [GENERATE FLAGS ...]

Each pair runs `python -m engine.generate --prompts FILE` twice, each in a fresh process, once
with the given `engine.generate` flags and once with `--mode ar` added, which one first
alternating from pair to pair (`round_order`), and reads the tokens/s each prints (output
tokens over the generation's wall time, loading excluded), its steps and its mean accepted
length. With no flags this is the README's default job. Reports both modes' medians, the ratio
of medians with its 90% bootstrap interval over the pairs (`ratio_interval`), the range and
median of the pairs' own ratios, and how many runs wrote every line's tokens as the first AR
run did. Writes JSON and a PNG under `runs/bench/` (`--out`, `--name`) and each run's output
beside them; `--report` also writes `bench/reports/<name>.md` (`bench.common.write_report`).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bench.common import environment, paired_ratios, ratio_interval, write_report, write_results
from engine.llm import REPO
from graphs.measure import round_order

# What `engine.generate` prints when a job ends (its `_generate`).
SUMMARY = re.compile(r"([\d.]+) tokens/s, mean accepted length ([\d.]+) per step over (\d+) steps")
MODES = ("default", "ar")


def parse_summary(stderr: str) -> dict[str, float]:
    """Tokens/s, mean accepted length and steps from `engine.generate`'s closing lines."""
    m = SUMMARY.search(stderr)
    if m is None:
        raise ValueError("engine.generate printed no summary line (tokens/s ... steps)")
    return {"tokens_per_s": float(m[1]), "mean_accept_len": float(m[2]), "steps": int(m[3])}


def run_job(prompts: Path, flags: list[str], out: Path) -> dict[str, Any]:
    """One `engine.generate` process: its summary and every line's token ids."""
    cmd = [sys.executable, "-m", "engine.generate", "--prompts", str(prompts), "--output",
           str(out), *flags]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if p.returncode != 0:
        tail = "\n".join(p.stderr.strip().splitlines()[-15:])
        raise SystemExit(f"`{' '.join(cmd)}` exited with {p.returncode}:\n{tail}")
    lines = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    return {**parse_summary(p.stderr), "token_ids": [x["token_ids"] for x in lines]}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per mode, the ratio of medians with its interval over the pairs, the pairs' own
    ratios, and the runs whose tokens equal the first AR run's line for line."""
    tps = {m: [r["tokens_per_s"] for r in runs if r["mode"] == m] for m in MODES}
    med = {m: statistics.median(v) for m, v in tps.items()}
    pairs = paired_ratios(tps["ar"], tps["default"])
    lo, hi = ratio_interval(tps["ar"], tps["default"]) if len(pairs) > 1 else (pairs[0],) * 2
    return {"tokens_per_s": med, "ratio": med["default"] / med["ar"], "ratio_90": [lo, hi],
            "pair_ratios": pairs, "pair_median": statistics.median(pairs),
            "steps": {m: statistics.median(r["steps"] for r in runs if r["mode"] == m)
                      for m in MODES},
            "mean_accept_len": statistics.median(r["mean_accept_len"] for r in runs
                                                 if r["mode"] == "default"),
            "same_as_ar": sum(r["same_as_ar"] for r in runs), "runs": len(runs)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.job", description=__doc__.split("\n")[0],
                                 epilog="Other flags go to both engine.generate runs.")
    ap.add_argument("--pairs", type=int, default=16)
    ap.add_argument("--prompts", type=Path, default=REPO / "examples" / "prompts.jsonl")
    ap.add_argument("--out", default="runs/bench")
    ap.add_argument("--name", default="job", help="the JSON and PNG's name under --out")
    ap.add_argument("--report", action="store_true",
                    help="also write bench/reports/<--name>.md (command, commit, machine, date)")
    a, flags = ap.parse_known_args(argv)
    if a.pairs < 1:
        ap.error(f"--pairs must be at least 1, got {a.pairs}")
    if "--output" in flags:
        ap.error("--output is the benchmark's own (each run writes beside the JSON)")
    out = Path(a.out) / a.name
    out.mkdir(parents=True, exist_ok=True)
    prompts = a.prompts.resolve()
    runs: list[dict[str, Any]] = []
    for i in tqdm(range(a.pairs), desc="pairs", unit="pair"):
        for mode in round_order(list(MODES), i):
            extra = ["--mode", "ar"] if mode == "ar" else []
            r = run_job(prompts, [*flags, *extra], out / f"{mode}-{i}.jsonl")
            r.update(mode=mode, pair=i)
            runs.append(r)
    first_ar = next(r["token_ids"] for r in runs if r["mode"] == "ar")
    for r in runs:
        r["same_as_ar"] = r.pop("token_ids") == first_ar
    s = summarize(runs)
    med = s["tokens_per_s"]
    lo, hi = s["ratio_90"]
    plo, phi = min(s["pair_ratios"]), max(s["pair_ratios"])
    env = environment("cuda" if torch.cuda.is_available() else "cpu")
    result = (f"default {med['default']:.1f} tokens/s against ar {med['ar']:.1f} (medians of "
              f"{a.pairs}): {s['ratio']:.2f}x (90% bootstrap interval {lo:.2f}-{hi:.2f}, pairs "
              f"{plo:.2f}-{phi:.2f}, their median {s['pair_median']:.2f}); "
              f"{s['mean_accept_len']:.2f} tokens a request's step over "
              f"{s['steps']['default']:g} request steps against {s['steps']['ar']:g}; "
              f"{s['same_as_ar']} of {s['runs']} runs wrote the first AR run's tokens; "
              f"{env['cpu']}, {env['cpus']} CPUs, {env['threads']} torch threads")
    print(result)

    def plot(fig: Any) -> None:
        ax1, ax2 = fig.subplots(1, 2)
        for m in MODES:
            ax1.plot([r["tokens_per_s"] for r in runs if r["mode"] == m], "o-", label=m)
        ax1.set(xlabel="pair", ylabel="tokens/s (as the CLI prints)", title="each run")
        ax1.legend()
        ax2.plot(s["pair_ratios"], "o", label="pair")
        ax2.axhline(s["ratio"], color="C1", label=f"ratio of medians {s['ratio']:.2f}x")
        ax2.axhline(s["pair_median"], color="C2", ls="--",
                    label=f"median of pairs {s['pair_median']:.2f}x")
        ax2.axhline(1.0, color="grey", lw=0.8)
        ax2.set(xlabel="pair", ylabel="default / ar", title="ratio")
        ax2.legend()

    paths = write_results(a.name, {"prompts": str(prompts), "flags": flags, "pairs": a.pairs,
                                   "environment": env, "summary": s, "runs": runs},
                          plot, a.out)
    if a.report:
        write_report(a.name, "bench.job", textwrap.fill(result, 100), argv=argv, files=paths,
                     device=env["device"])


if __name__ == "__main__":
    main()
