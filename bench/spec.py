"""Speculative decoding against its own baseline, in one run on one model:

    python -m bench.spec [--model DIR --draft DIR] [--budgets 4 8 16 32 64] [--max-new-tokens N]

Runs `ar`, `chain` and `tree` at each budget over the same prompts (greedy, batch size 1 by
default), and prints tokens/s with its ratio to `ar`, mean accepted length (tokens per step,
bonus included) and time per phase. Writes JSON and a PNG under `runs/bench/`. Without a model
it generates a tiny random target and drafter (whose drafts are rarely accepted: the numbers
then show the step's overhead, not a speed-up).
"""

from __future__ import annotations

import argparse
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import environment, table, write_results
from engine.config import SamplingParams
from engine.llm import DEFAULT_DRAFT, DEFAULT_MODEL, LLM


def held_out_prompts(llm: LLM, n: int, seed: int) -> list[list[int]]:
    import random

    g = random.Random(seed)
    V = llm.models.target.cfg.vocab_size - 256
    return [[g.randrange(V) for _ in range(g.randint(4, 32))] for _ in range(n)]


def run_one(model: Path, draft: Path | None, mode: str, budget: int, prompts: list[Any],
            params: SamplingParams, batch: int) -> dict[str, Any]:
    llm = LLM(model, draft if mode != "ar" else None, mode=mode, budget=budget,
              max_batch_size=batch, progress=False)
    if isinstance(prompts[0], str):
        prompts = [llm.encode_prompt(p) for p in prompts]
    llm.generate(prompts[:1], params)  # warm-up
    outs = llm.generate(prompts, params)
    s = llm.stats
    acc = [a for o in outs for a in o.accept_lengths]
    return {"mode": mode, "budget": budget if mode == "tree" else None,
            "name": f"tree-{budget}" if mode == "tree" else mode,
            "tokens": s["tokens"], "seconds": s["seconds"], "tokens_per_s": s["tokens_per_s"],
            "mean_accept_len": s["mean_accept_len"], "accept_hist": dict(Counter(acc)),
            "phase_seconds": s["phase_seconds"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.spec", description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    ap.add_argument("--prompts", type=int, default=8, help="number of held-out prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/bench")
    a = ap.parse_args(argv)

    tmp = None
    if a.model:
        model, draft = Path(a.model), Path(a.draft) if a.draft else None
    elif (DEFAULT_MODEL / "config.json").is_file():
        model, draft = DEFAULT_MODEL, DEFAULT_DRAFT
    else:
        from engine.tools.make_draft import make_draft
        from engine.tools.make_tiny import make_tiny

        tmp = tempfile.TemporaryDirectory()
        model = make_tiny(Path(tmp.name) / "target", dtype="fp32", layers=2, hidden=128)
        draft = make_draft(model, Path(tmp.name) / "draft", layers=1, block_size=8)
        print(f"no model given and none bundled: using a random tiny target at {model}")
    params = SamplingParams(temperature=a.temperature, max_new_tokens=a.max_new_tokens,
                            ignore_eos=True, seed=a.seed)
    probe = LLM(model, mode="ar", progress=False)
    prompts = held_out_prompts(probe, a.prompts, a.seed)
    del probe
    runs = [("ar", 1), ("chain", 1)] + [("tree", b) for b in a.budgets]
    rows = []
    for mode, budget in runs:
        r = run_one(model, draft, mode, budget, prompts, params, a.batch)
        rows.append(r)
        print(f"  {r['name']:>8}: {r['tokens_per_s']:.1f} tokens/s, "
              f"accepted {r['mean_accept_len']:.2f}", flush=True)
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["speedup_vs_ar"] = r["tokens_per_s"] / base
        for k in ("draft", "build", "verify", "decide", "commit", "host"):
            r[f"t_{k}"] = r["phase_seconds"].get(k, 0.0)
    print(table(rows, [("name", "run", "s"), ("tokens_per_s", "tok/s", ".1f"),
                       ("speedup_vs_ar", "x ar", ".2f"), ("mean_accept_len", "accept", ".2f"),
                       ("t_draft", "draft s", ".2f"), ("t_build", "build s", ".2f"),
                       ("t_verify", "verify s", ".2f"), ("t_decide", "decide s", ".2f"),
                       ("t_commit", "commit s", ".2f"), ("t_host", "host s", ".2f")]))

    def plot(fig):
        trees = [r for r in rows if r["mode"] == "tree"]
        ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
        xs = [r["budget"] for r in trees]
        ax1.plot(xs, [r["speedup_vs_ar"] for r in trees], "o-", label="tree")
        ax1.axhline(rows[1]["speedup_vs_ar"], ls="--", color="gray", label="chain")
        ax1.axhline(1.0, ls=":", color="black", label="ar")
        ax1.set_xscale("log", base=2)
        ax1.set_xlabel("tree budget")
        ax1.set_ylabel("tokens/s vs ar")
        ax1b = ax1.twinx()
        ax1b.plot(xs, [r["mean_accept_len"] for r in trees], "s-", color="tab:orange")
        ax1b.set_ylabel("mean accepted length", color="tab:orange")
        ax1.legend(loc="upper left")
        best = max(trees, key=lambda r: r["tokens_per_s"])
        hist = best["accept_hist"]
        ks = sorted(hist)
        ax2.bar(ks, [hist[k] for k in ks])
        ax2.set_xlabel(f"tokens per step ({best['name']})")
        ax2.set_ylabel("steps")

    write_results("spec", {"model": str(model), "draft": str(draft), "env": environment("cpu"),
                           "params": vars(a), "runs": rows}, plot, a.out)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
