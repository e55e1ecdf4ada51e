"""DDTree build and the greedy walk, each on the device and on the host, and the decide ops.

    python -m bench.tree [--quick] [--bs 1 8 32] [--budgets 8 16 32 64] [--block-size 16]
                         [--vocab 4096] [--device cpu|cuda] [--threads 1] [--out runs/bench]
                         [--probs-only | --no-probs] [--probs-vocab 3072 163840]
                         [--probs-shape 8x17 1x17] [--report]

Build times include the retrieval arrays and the attention mask, which the builder computes in the
same pass. Ratios are host heap time (`build_ddtree_host`, the eager CPU step's builder) over device
build time, measured side by side; `host walk ms` is `tree_greedy_host` (the eager CPU step's walk)
beside `tree_greedy`.

The second table times `target_probs` (the decide phase's top-k / top-p) on `[bs, N, V]` logits:
the full vocabulary sort (`bound=None`, the old path) against the bounded top-k path, both with the
row counts an eager runner passes (`topk_rows` / `sort_rows` from `row_promises`) and with every row
(what a graph serving any mix runs). Mixes: top-k 50 + top-p 0.95 on every row; one top-p 0.95 row
among greedy rows (peaked logits: the nucleus fits the bound; flat: it does not and that row takes
the fallback sort); top-p 0.95 on every row. `--report` also writes `bench/reports/tree.md` (or
`tree_probs.md` with `--probs-only`; `bench.common.write_report`).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from bench.common import DEFAULT_OUT, environment, table, time_fn, write_report, write_results
from ops.sampling import TOPK_BOUND, row_promises, target_probs
from ops.tree import build_ddtree, build_ddtree_host
from ops.verify import tree_greedy, tree_greedy_host, tree_sample


def measure(bs: int, budget: int, args: argparse.Namespace, g: torch.Generator) -> dict[str, Any]:
    depth, vocab, dev = args.block_size - 1, args.vocab, args.device
    n = budget + 1
    logits = (torch.randn(bs, depth, vocab, generator=g) * 3).to(dev)
    anchor = torch.randint(0, vocab, (bs,), generator=g).to(dev)
    target_logits = (torch.randn(bs, n, vocab, generator=g) * 3).to(dev)
    temp = torch.full((bs,), 0.8, device=dev)
    top_k = torch.full((bs,), 50, device=dev, dtype=torch.int64)
    top_p = torch.full((bs,), 0.95, device=dev)
    coins = torch.rand(bs, n, generator=g).to(dev)
    tree = build_ddtree(logits, budget, anchor)
    probs = target_probs(target_logits, temp, top_k, top_p)
    argmax = target_logits.argmax(-1)
    links = (tree.tokens, tree.next_token, tree.next_sibling)
    rep = dict(warmup=args.warmup, repeats=args.repeats, device=dev)
    row: dict[str, Any] = {"bs": bs, "budget": budget, "depth": depth, "vocab": vocab}
    row["build_ms"] = 1e3 * time_fn(lambda: build_ddtree(logits, budget, anchor), **rep)
    row["heap_ms"] = 1e3 * time_fn(
        lambda: build_ddtree_host(logits, budget, anchor),
        warmup=1,
        repeats=args.ref_repeats,
        device=dev,
    )
    row["speedup"] = row["heap_ms"] / row["build_ms"]
    row["target_probs_ms"] = 1e3 * time_fn(
        lambda: target_probs(target_logits, temp, top_k, top_p), **rep
    )
    row["sample_ms"] = 1e3 * time_fn(
        lambda: tree_sample(*links, probs, coins, max_accept=depth), **rep
    )
    row["greedy_ms"] = 1e3 * time_fn(lambda: tree_greedy(*links, argmax, max_accept=depth), **rep)
    row["greedy_host_ms"] = 1e3 * time_fn(
        lambda: tree_greedy_host(*links, argmax, max_accept=depth), **rep)
    row["sample_over_greedy"] = row["sample_ms"] / row["greedy_ms"]
    return row


# name -> (logit scale: 6 is peaked, the nucleus fits the bound; 3 is flat, it does not at V =
# 163,840), per-row (temperature, top_k, top_p) of row 0 and of the other rows.
PROBS_MIXES: dict[str, tuple[float, tuple[float, int, float], tuple[float, int, float]]] = {
    "k50-p95-all": (6.0, (0.8, 50, 0.95), (0.8, 50, 0.95)),
    "p95-one-greedy": (6.0, (0.8, 0, 0.95), (1.0, 1, 1.0)),
    "p95-one-flat-greedy": (3.0, (0.8, 0, 0.95), (1.0, 1, 1.0)),
    "p95-all": (6.0, (0.8, 0, 0.95), (0.8, 0, 0.95)),
}


def measure_probs(vocab: int, bs: int, n: int, mix: str, args: argparse.Namespace,
                  g: torch.Generator) -> dict[str, Any]:
    """`target_probs` at `[bs, n, vocab]`: the full sort against the bounded path."""
    dev = args.device
    scale, first, rest = PROBS_MIXES[mix]
    params = [first] + [rest] * (bs - 1)
    logits = (torch.randn(bs, n, vocab, generator=g) * scale).to(dev)
    temp, top_k, top_p = (torch.tensor(col, device=dev) for col in zip(*params))
    promises = row_promises([(k, p) for _, k, p in params], vocab)
    counts = {k: promises[k] for k in ("topk_rows", "sort_rows")}
    rep = dict(warmup=args.warmup, repeats=args.repeats, device=dev)
    old = 1e3 * time_fn(lambda: target_probs(logits, temp, top_k, top_p, bound=None), **rep)
    new = 1e3 * time_fn(lambda: target_probs(logits, temp, top_k, top_p, **counts), **rep)
    every = 1e3 * time_fn(lambda: target_probs(logits, temp, top_k, top_p), **rep)
    return {"vocab": vocab, "bs": bs, "nodes": n, "mix": mix, **counts, "sort_ms": old,
            "bounded_ms": new, "bounded_all_ms": every, "ratio": old / new,
            "ratio_all": old / every}


def plot(rows: list[dict[str, Any]]):
    def draw(fig) -> None:
        left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
        for bs in sorted({r["bs"] for r in rows}):
            sub = [r for r in rows if r["bs"] == bs]
            budgets = [r["budget"] for r in sub]
            (line,) = left.plot(budgets, [r["build_ms"] for r in sub], "o-",
                                label=f"device bs={bs}")
            for ax, key, style, name in [(left, "heap_ms", "s--", "heap"),
                                         (right, "sample_ms", "o-", "tree_sample"),
                                         (right, "greedy_ms", "^:", "tree_greedy"),
                                         (right, "greedy_host_ms", "v-.", "host walk")]:
                ax.plot(budgets, [r[key] for r in sub], style, color=line.get_color(),
                        label=f"{name} bs={bs}")
        for ax, title in [(left, "DDTree build (+ retrieval, mask)"), (right, "decide")]:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("budget K")
            ax.set_ylabel("median ms")
            ax.set_title(title)
            ax.legend(fontsize=7)

    return draw


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bs", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--block-size", type=int, default=16, help="drafted depths L = block size - 1")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (0: leave torch's)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--ref-repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--report", action="store_true",
                    help="also write bench/reports/<tree|tree_probs>.md (command, commit, machine, "
                         "date)")
    probs = ap.add_mutually_exclusive_group()
    probs.add_argument("--probs-only", action="store_true", help="only the target_probs table")
    probs.add_argument("--no-probs", action="store_true", help="skip the target_probs table")
    ap.add_argument("--probs-vocab", type=int, nargs="+", default=[3072, 163840])
    ap.add_argument("--probs-shape", nargs="+", default=["8x17", "1x17"], help="bs x N")
    ap.add_argument("--probs-mix", nargs="+", default=list(PROBS_MIXES), choices=list(PROBS_MIXES))
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.ref_repeats, args.warmup = 3, 1, 1
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    g = torch.Generator().manual_seed(args.seed)
    env = environment(args.device)
    payload: dict[str, Any] = {"benchmark": "tree", "args": vars(args), "environment": env}
    printed: list[str] = []  # what the report holds

    def show(text: str) -> None:
        print(text)
        printed.append(text)

    if not args.no_probs:
        shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.probs_shape]
        probs_rows = [measure_probs(v, bs, n, mix, args, g) for v in args.probs_vocab
                      for bs, n in shapes for mix in args.probs_mix]
        show(f"target_probs: full sort vs bounded top-k (bound {TOPK_BOUND}) "
             f"device={args.device} threads={env['threads']}")
        show(table(probs_rows, [
            ("vocab", "V", "d"), ("bs", "bs", "d"), ("nodes", "N", "d"), ("mix", "mix", "s"),
            ("topk_rows", "topk rows", "d"), ("sort_rows", "sort rows", "d"),
            ("sort_ms", "sort ms", ".2f"), ("bounded_ms", "bounded ms", ".2f"),
            ("ratio", "sort/bounded", ".1f"), ("bounded_all_ms", "all-rows ms", ".2f"),
            ("ratio_all", "sort/all-rows", ".1f"),
        ]))
        payload["probs_rows"] = probs_rows
    if args.probs_only:
        paths = write_results("tree_probs", payload, None, args.out)
        if args.report:
            write_report("tree_probs", "bench.tree", printed, argv=argv, files=paths,
                         device=args.device)
        return
    rows = [measure(bs, k, args, g) for bs in args.bs for k in args.budgets]
    columns = [
        ("bs", "bs", "d"),
        ("budget", "K", "d"),
        ("build_ms", "build ms", ".2f"),
        ("heap_ms", "heap ms", ".2f"),
        ("speedup", "heap/build", ".1f"),
        ("target_probs_ms", "target_probs ms", ".2f"),
        ("sample_ms", "sample ms", ".3f"),
        ("greedy_ms", "greedy ms", ".3f"),
        ("greedy_host_ms", "host walk ms", ".3f"),
        ("sample_over_greedy", "sample/greedy", ".2f"),
    ]
    show(f"L={args.block_size - 1} V={args.vocab} device={args.device} threads={env['threads']}")
    show(table(rows, columns))
    payload["rows"] = rows
    paths = write_results("tree", payload, plot(rows), args.out)
    if args.report:
        write_report("tree", "bench.tree", printed, argv=argv, files=paths, device=args.device)


if __name__ == "__main__":
    main()
