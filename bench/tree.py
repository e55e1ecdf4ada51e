"""DDTree build (device algorithm vs host heap reference) and the decide ops, timed in one run.

    python -m bench.tree [--quick] [--bs 1 8 32] [--budgets 8 16 32 64] [--block-size 16]
                         [--vocab 4096] [--device cpu|cuda] [--threads 1] [--out runs/bench]

Build times include the retrieval arrays and the attention mask, which the builder computes in the
same pass. Ratios are heap reference time over device build time, measured side by side.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from bench.common import DEFAULT_OUT, environment, table, time_fn, write_results
from ops.sampling import target_probs
from ops.tree import build_ddtree, build_ddtree_reference
from ops.verify import tree_greedy, tree_sample


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
    final = torch.rand(bs, generator=g).to(dev)
    tree = build_ddtree(logits, budget, anchor)
    probs = target_probs(target_logits, temp, top_k, top_p)
    argmax = target_logits.argmax(-1)
    links = (tree.tokens, tree.next_token, tree.next_sibling)
    rep = dict(warmup=args.warmup, repeats=args.repeats, device=dev)
    row: dict[str, Any] = {"bs": bs, "budget": budget, "depth": depth, "vocab": vocab}
    row["build_ms"] = 1e3 * time_fn(lambda: build_ddtree(logits, budget, anchor), **rep)
    row["reference_ms"] = 1e3 * time_fn(
        lambda: build_ddtree_reference(logits, budget, anchor),
        warmup=1,
        repeats=args.ref_repeats,
        device=dev,
    )
    row["speedup"] = row["reference_ms"] / row["build_ms"]
    row["target_probs_ms"] = 1e3 * time_fn(
        lambda: target_probs(target_logits, temp, top_k, top_p), **rep
    )
    row["sample_ms"] = 1e3 * time_fn(
        lambda: tree_sample(*links, probs, coins, final, max_accept=depth), **rep
    )
    row["greedy_ms"] = 1e3 * time_fn(lambda: tree_greedy(*links, argmax, max_accept=depth), **rep)
    row["sample_over_greedy"] = row["sample_ms"] / row["greedy_ms"]
    return row


def plot(rows: list[dict[str, Any]]):
    def draw(fig) -> None:
        left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
        for bs in sorted({r["bs"] for r in rows}):
            sub = [r for r in rows if r["bs"] == bs]
            budgets = [r["budget"] for r in sub]
            (line,) = left.plot(budgets, [r["build_ms"] for r in sub], "o-",
                                label=f"device bs={bs}")
            for ax, key, style, name in [(left, "reference_ms", "s--", "heap"),
                                         (right, "sample_ms", "o-", "tree_sample"),
                                         (right, "greedy_ms", "^:", "tree_greedy")]:
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
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.ref_repeats, args.warmup = 3, 1, 1
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    g = torch.Generator().manual_seed(args.seed)
    rows = [measure(bs, k, args, g) for bs in args.bs for k in args.budgets]
    columns = [
        ("bs", "bs", "d"),
        ("budget", "K", "d"),
        ("build_ms", "build ms", ".2f"),
        ("reference_ms", "heap ms", ".2f"),
        ("speedup", "heap/build", ".1f"),
        ("target_probs_ms", "target_probs ms", ".2f"),
        ("sample_ms", "sample ms", ".3f"),
        ("greedy_ms", "greedy ms", ".3f"),
        ("sample_over_greedy", "sample/greedy", ".2f"),
    ]
    env = environment(args.device)
    print(f"L={args.block_size - 1} V={args.vocab} device={args.device} threads={env['threads']}")
    print(table(rows, columns))
    payload = {"benchmark": "tree", "args": vars(args), "environment": env, "rows": rows}
    write_results("tree", payload, plot(rows), args.out)


if __name__ == "__main__":
    main()
