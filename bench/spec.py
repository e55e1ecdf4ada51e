"""Speculative decoding against its own baseline and against transformers, in one run:

    python -m bench.spec [--model DIR --draft DIR] [--budgets 4 8 16 32 64] [--threads 1]

On one model (default: the bundled one) and the same prompts (held-out corpus files for the bundled
model, never trained on), greedy at batch size 1 by default, runs our `ar`, `chain` and `tree` at
each budget, one sampled `tree` run (temperature 0.7, budget 16) for its accepted length beside the
uncoupled perfect-drafter ceiling at that budget and temperature (`perfect_ceiling`), and, as peers
on the same checkpoint, transformers' greedy `generate` and its prompt-lookup speculative decoding;
then the default budget policy (`policy`: each step's budget from the shipped table, down to plain
decoding) greedy and sampled, each against `ar` at the same temperature (`--policy-only` runs just
those). `--compile` runs our engines' compiled step. Every engine is loaded once; then each of
`--rounds` rounds runs one pass of each, our engines side by side, `--grain` tokens each in turn
(`bench.common.interleave`: a shared machine's speed drifts within seconds, and engines taking turns
every few milliseconds meet the same drift), transformers' whole; each round's order is rotated by
one (`round_order`), and each run reports its median pass. Prints tokens/s with the ratio to our
`ar` (and its 90% bootstrap interval over the rounds: `bench.common.ratio_interval`), mean accepted
length (tokens per step, bonus included) and time per phase; writes JSON and PNG plots under
`runs/bench/`, and with `--report` `bench/reports/spec*.md` (`bench.common.write_report`).
`--random` uses a tiny random target and drafter instead (whose drafts are rarely accepted: the
numbers then show the step's overhead, not a speed-up).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    bench_prompts,
    environment,
    interleave,
    ratio_interval,
    table,
    write_report,
    write_results,
)
from engine.config import SamplingParams
from engine.cpu import torch_threads
from engine.llm import LLM, model_pair
from graphs.measure import round_order

# Tokens each of our runs adds in its turn (`bench.common.interleave`).
GRAIN = 32
# A compiled step is timed whole ("step"); an eager one by phase.
PHASES = ("draft", "build", "verify", "decide", "commit", "step", "host", "prefill+sched")


# One timed pass over the prompts: a generator that yields the tokens each engine step added (the
# time it is suspended is not its own) and returns the pass's result (`bench.common.interleave`).
Runner = Callable[[], Generator[int, None, dict[str, Any]]]


def ours(model: Path, draft: Path | None, mode: str, budget: int | None,
         prompts: list[list[int]], params: SamplingParams, batch: int, compile: bool = False
         ) -> Runner:
    """Loads one engine (warmed up; compiled with `compile`) and returns a function that runs
    every prompt once. A tree of budget None follows the default budget policy."""
    llm = LLM(model, draft if mode != "ar" else None, mode=mode, budget=budget,
              max_batch_size=batch, progress=compile, compile="on" if compile else "off")
    llm.generate(prompts[:batch], [params] * min(batch, len(prompts)))  # warm-up
    name = mode if mode != "tree" else f"tree-{budget}" if budget is not None else "policy"
    if not params.greedy:
        name += f" T={params.temperature:g}"

    def run() -> Generator[int, None, dict[str, Any]]:
        outs = yield from llm.generate_stepwise(prompts, params)
        s = llm.stats
        acc = [a for o in outs for a in o.accept_lengths]
        return {"mode": mode, "budget": budget if mode == "tree" else None, "name": name,
                "temperature": params.temperature, "tokens": s["tokens"],
                "seconds": s["seconds"], "tokens_per_s": s["tokens_per_s"], "steps": s["steps"],
                "mean_accept_len": s["mean_accept_len"], "accept_hist": dict(Counter(acc)),
                "phase_seconds": s["phase_seconds"], "outputs": [o.token_ids for o in outs]}

    return run


def hf_model(model: Path) -> Any:
    """The checkpoint as transformers' `DeepseekV3ForCausalLM` (fp32, eval); None, saying so,
    without transformers."""
    try:
        from transformers import DeepseekV3ForCausalLM
    except ImportError:
        print("transformers is not installed: skipping what it runs (pip install -e '.[dev]')")
        return None
    return DeepseekV3ForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


def theirs(model: Path, prompts: list[list[int]], new_tokens: int, lookup: int | None
           ) -> Runner | None:
    """transformers' greedy generate (or prompt-lookup decoding) on the same checkpoint, one
    prompt at a time, EOS ignored; None without transformers."""
    hf = hf_model(model)
    if hf is None:
        return None
    kw: dict[str, Any] = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0)
    if lookup:
        kw["prompt_lookup_num_tokens"] = lookup
    name = f"hf-lookup-{lookup}" if lookup else "hf-generate"
    with torch.inference_mode():
        hf.generate(torch.tensor([prompts[0]]), **{**kw, "max_new_tokens": 4,
                                                   "min_new_tokens": 4})

    def run() -> Generator[int, None, dict[str, Any]]:
        yield from ()  # one pass, whole: transformers' generate is not split into steps
        outs = []
        with torch.inference_mode():
            t0 = time.perf_counter()
            for p in prompts:
                out = hf.generate(torch.tensor([p]), **kw)
                outs.append(out[0, len(p):].tolist())
            dt = time.perf_counter() - t0
        n = sum(len(o) for o in outs)
        return {"mode": name, "budget": None, "name": name, "temperature": 0.0, "tokens": n,
                "seconds": dt, "tokens_per_s": n / dt, "steps": None, "mean_accept_len": None,
                "accept_hist": {}, "phase_seconds": {}, "outputs": outs}

    return run


def perfect_ceiling(model: Path, prompts: list[list[int]], outputs: list[list[int]],
                    budget: int, temperature: float, positions: int = 256) -> float | None:
    """Tokens per step a perfect drafter would reach when sampling without the step's coins: at
    `positions` points spread over the target's own sampled `outputs`, one plus the mass of the
    best-first tree of `budget` nodes over the target's own conditionals at `temperature` (a tree
    built blind to the coins reaches a node with its path's probability, and no such tree of that
    budget holds more). The engine's coupled drafting races the drafter with the coins, which
    this does not bound: a perfect drafter raced so would accept every depth. None without
    transformers, which runs the conditionals here."""
    import heapq

    hf = hf_model(model)
    if hf is None:
        return None
    points = [p + o[:t] for p, o in zip(prompts, outputs) for t in range(len(o))]
    points = points[::max(1, len(points) // positions)][:positions]
    total = 0.0
    with torch.inference_mode():
        for ctx in points:
            frontier: list[tuple[float, tuple[int, ...]]] = [(-1.0, ())]  # the root
            mass, nodes = 0.0, 0
            while nodes <= budget:
                neg, path = heapq.heappop(frontier)
                mass, nodes = mass - neg * (nodes > 0), nodes + 1
                if nodes > budget:
                    break
                logits = hf(torch.tensor([ctx + list(path)])).logits[0, -1]
                top = torch.softmax(logits.float() / temperature, -1).topk(budget)
                for pr, tok in zip(top.values.tolist(), top.indices.tolist()):
                    heapq.heappush(frontier, (neg * pr, (*path, tok)))
            total += 1.0 + mass
    return total / len(points)


def median_round(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median tokens/s, with every round's tokens/s attached."""
    rates = [r["tokens_per_s"] for r in results]
    row = sorted(results, key=lambda r: r["tokens_per_s"])[len(results) // 2]
    return {**row, "tokens_per_s_rounds": rates}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.spec", description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--random", action="store_true", help="a tiny random pair instead")
    ap.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    ap.add_argument("--prompts", type=int, default=8, help="number of held-out prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--sample-temperature", type=float, default=0.7,
                    help="temperature of the sampled tree-16 row (0: skip it)")
    ap.add_argument("--lookup", type=int, default=10, help="prompt_lookup_num_tokens")
    ap.add_argument("--no-transformers", action="store_true",
                    help="skip the transformers rows and the perfect-drafter ceiling (its "
                         "conditionals come from transformers)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--policy-only", action="store_true",
                    help="only ar and the default budget policy (greedy and sampled)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="timed passes over the prompts, every run interleaved in each round; "
                         "each run reports its median round")
    ap.add_argument("--grain", type=int, default=GRAIN,
                    help="tokens each of our runs adds in its turn within a round, all of them "
                         "side by side (transformers' runs go whole); 0: each run whole, one "
                         "after another")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile", action="store_true",
                    help="our engines run the compiled step (--compile on; each compiles its "
                         "steps at load, once per machine with a warm cache)")
    ap.add_argument("--out", default="runs/bench")
    ap.add_argument("--report", action="store_true",
                    help="also write bench/reports/spec[-compiled][-policy][-bB].md (command, "
                         "commit, machine, date, the table)")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU threads for every run, ours and transformers' (default 1, as in "
                         "graphs.profile: the step's ops are small and a second thread mostly "
                         "waits; 0: torch's default)")
    a = ap.parse_args(argv)
    if a.grain < 0:
        ap.error(f"--grain must be >= 0, got {a.grain}")
    if a.threads < 0:
        ap.error(f"--threads must be >= 0, got {a.threads}")
    with torch_threads(a.threads or torch.get_num_threads()):
        _bench(a, argv)


def _bench(a: argparse.Namespace, argv: list[str] | None = None) -> None:
    printed: list[str] = []  # what `--report` holds

    def show(text: str, **kw: Any) -> None:
        print(text, **kw)
        printed.append(text)

    tmp = None
    if a.random:
        from tools.make_draft import make_draft
        from tools.make_tiny import make_tiny

        tmp = tempfile.TemporaryDirectory()
        model = make_tiny(Path(tmp.name) / "target", dtype="fp32", layers=2, hidden=128)
        draft = make_draft(model, Path(tmp.name) / "draft", layers=1, block_size=8)
        print(f"using a random tiny target at {model}")
    else:
        model, draft = model_pair(a.model, a.draft)
        if not (model / "config.json").is_file():
            raise SystemExit(f"{model}: no model here (config.json missing); pass --model DIR "
                             f"or --random")
    probe = LLM(model, mode="ar", progress=False)
    prompts, source = bench_prompts(probe, model, a.prompts, a.seed)
    del probe
    show(f"{len(prompts)} prompts ({source}), {a.max_new_tokens} new tokens each, batch "
         f"{a.batch}, {torch.get_num_threads()} threads, "
         f"{'compiled' if a.compile else 'eager'} steps", flush=True)
    greedy = SamplingParams(max_new_tokens=a.max_new_tokens, ignore_eos=True, seed=a.seed)
    hot = SamplingParams(temperature=a.sample_temperature, max_new_tokens=a.max_new_tokens,
                         ignore_eos=True, seed=a.seed)
    runs: list[tuple[str, int | None, SamplingParams]] = [("ar", None, greedy)]
    if not a.policy_only:
        runs += [("chain", None, greedy), *(("tree", b, greedy) for b in a.budgets)]
        if a.sample_temperature > 0:
            runs.append(("tree", 16, hot))
    runs.append(("tree", None, greedy))
    if a.sample_temperature > 0:
        runs += [("ar", None, hot), ("tree", None, hot)]
    if a.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {a.rounds}")
    runners: list[Runner] = [ours(model, draft, m, b, prompts, p, a.batch, a.compile)
                             for m, b, p in runs]
    if not a.no_transformers:
        runners += [r for r in (theirs(model, prompts, a.max_new_tokens, lk)
                                for lk in (None, a.lookup)) if r is not None]
    results: list[list[dict[str, Any]]] = [[] for _ in runners]
    for i in range(a.rounds):
        order = round_order(list(zip(runners, results)), i)
        for (_, res), out in zip(order, interleave([run() for run, _ in order], a.grain)):
            res.append(out)
        print(f"  round {i + 1}/{a.rounds}: " + ", ".join(
            f"{res[-1]['name']} {res[-1]['tokens_per_s']:.0f}" for res in results), flush=True)
    rows = [median_round(res) for res in results]
    ar = rows[0]
    for r in rows:
        # sampled rows against sampled ar: same seeds, so the same tokens
        base = next((x for x in rows if x["mode"] == "ar" and
                     x["temperature"] == r["temperature"]), ar)
        r["speedup_vs_ar"] = r["tokens_per_s"] / base["tokens_per_s"]
        iv = (ratio_interval(base["tokens_per_s_rounds"], r["tokens_per_s_rounds"])
              if a.rounds > 1 and r is not base else None)
        r["speedup_vs_ar_90"] = list(iv) if iv else None
        r["x_ar_90"] = f"{iv[0]:.2f}-{iv[1]:.2f}" if iv else "-"
        r["same_as_ar"] = sum(o == g for o, g in zip(r["outputs"], base["outputs"]))
        r["accept"] = f"{r['mean_accept_len']:.2f}" if r["mean_accept_len"] else "-"
        steps = r["steps"] or 0
        for k in PHASES:
            t = r["phase_seconds"].get(k, 0.0)
            r[f"ms_{k}"] = 1000 * t / steps if steps else None  # printed as "-"
    trees = [r for r in rows if r["mode"] == "tree" and r["temperature"] == 0
             and r["budget"] is not None]
    chain = next((r for r in rows if r["mode"] == "chain"), None)  # runs whenever trees do
    hf = next((r for r in rows if r["mode"] == "hf-generate"), None)
    best = max(trees, key=lambda r: r["tokens_per_s"]) if trees else None
    show(table(rows, [("name", "run", "s"), ("tokens_per_s", "tok/s", ".1f"),
                      ("speedup_vs_ar", "x ar", ".2f"), ("x_ar_90", "90% of x ar", "s"),
                      ("accept", "accept", "s"),
                      ("same_as_ar", "= ar", "d"),
                      ("ms_draft", "draft", ".2f"), ("ms_build", "build", ".2f"),
                      ("ms_verify", "verify", ".2f"), ("ms_decide", "decide", ".2f"),
                      ("ms_commit", "commit", ".2f"), ("ms_step", "step", ".2f"),
                      ("ms_host", "host", ".2f"),
                      ("ms_prefill+sched", "prefill", ".2f")]))
    show("(phase columns: milliseconds per step; '= ar': outputs identical to our ar of "
         f"{len(prompts)}; '90% of x ar': a bootstrap interval over the rounds)")
    summary: dict[str, Any] = {  # "policy_vs_ar", "policy_vs_ar T=0.7"
        "policy_vs_ar" + r["name"].removeprefix("policy"): r["speedup_vs_ar"]
        for r in rows if r["name"].startswith("policy")}
    summary.update({"policy_vs_ar_90" + r["name"].removeprefix("policy"): r["speedup_vs_ar_90"]
                    for r in rows if r["name"].startswith("policy") and r["speedup_vs_ar_90"]})
    if best is not None:
        summary.update(best_tree=best["name"], best_vs_ar=best["speedup_vs_ar"])
        if hf is not None:
            summary["best_vs_hf_generate"] = best["tokens_per_s"] / hf["tokens_per_s"]
        t16 = next((r for r in trees if r["budget"] == 16), None)
        if t16 is not None and chain is not None:
            summary["accept_tree16"] = t16["mean_accept_len"]
            summary["accept_tree16_vs_chain"] = t16["mean_accept_len"] / chain["mean_accept_len"]
        hot = next((r for r in rows if r["mode"] == "tree" and r["temperature"] > 0
                    and r["budget"] == 16), None)
        if hot is not None:
            summary["accept_tree16_sampled"] = hot["mean_accept_len"]
            cap = None if a.no_transformers else perfect_ceiling(
                model, prompts, hot["outputs"], 16, a.sample_temperature)
            if cap is not None:
                summary["ceiling_tree16_sampled"] = cap
                summary["sampled_vs_ceiling"] = hot["mean_accept_len"] / cap
    show("  ".join(f"{k} {v:.2f}" if isinstance(v, float) else
                   f"{k} {v[0]:.2f}-{v[1]:.2f}" if isinstance(v, list) else f"{k} {v}"
                   for k, v in summary.items()))

    def plot(fig):
        ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
        xs = [r["budget"] for r in trees]
        ax1.plot(xs, [r["speedup_vs_ar"] for r in trees], "o-", label="tree")
        if chain is not None:
            ax1.axhline(chain["speedup_vs_ar"], ls="--", color="gray", label="chain")
        ax1.axhline(1.0, ls=":", color="black", label="ar")
        if hf is not None:
            ax1.axhline(hf["speedup_vs_ar"], ls="-.", color="tab:green",
                        label="transformers generate")
        if xs:
            ax1.set_xscale("log", base=2)
        ax1.set_xlabel("tree budget")
        ax1.set_ylabel("tokens/s vs ar")
        ax1b = ax1.twinx()
        ax1b.plot(xs, [r["mean_accept_len"] for r in trees], "s-", color="tab:orange")
        ax1b.set_ylabel("mean accepted length", color="tab:orange")
        ax1.legend(loc="upper left")
        if best is not None:
            hist = best["accept_hist"]
            ks = sorted(hist)
            ax2.bar(ks, [hist[k] for k in ks])
            ax2.set_xlabel(f"tokens per step ({best['name']})")
            ax2.set_ylabel("steps")

    for r in rows:
        r.pop("accept")
    name = "spec-compiled" if a.compile else "spec"
    paths = write_results(name, {"model": str(model), "draft": str(draft), "prompts": source,
                                 "env": environment("cpu"), "params": vars(a),
                                 "summary": summary, "runs": rows}, plot, a.out)
    if a.report:
        kind = name + "-policy" * a.policy_only + (f"-b{a.batch}" if a.batch != 1 else "")
        write_report(kind, "bench.spec", printed, argv=argv, files=paths)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
