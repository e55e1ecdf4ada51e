"""The host's share of an engine step, with the device step replaced by a no-op.

    python -m bench.host [--batch-sizes 1,8,64] [--contexts 768,32768] [--emit 4]
                         [--steps 40] [--rounds 3] [--json F] [--report]

On a GPU a whole speculative step is one graph replay of a few milliseconds; everything the
host does around it adds to that. This runs the real scheduler (`engine.scheduler.Scheduler`,
its page reservations and stop checks with the bundled tokenizer) and the real runner's staging
of every step input and read-back of the decision (`StepGraphRunner.load` and `step`), with the
step itself a no-op that emits `--emit` tokens per row (`NoopStep`), for running batches of
`--batch-sizes` rows whose contexts hold `--contexts` tokens, without and with two stop strings.
Admission and prefill are not timed: the rows start running. It prints the host microseconds per
step and per emitted token (medians over `--rounds`), and writes `{"rows": [{"batch_size",
"context", "stop_strings", "host_us_per_step", "host_us_per_token"}]}` to `--json`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import DEFAULT_OUT, table, write_report, write_results
from engine import LLM, SamplingParams
from engine.config import int_list
from engine.kv_cache import pages_needed
from engine.request import Request
from engine.runner import StepGraphRunner
from engine.scheduler import Scheduler
from engine.spec import StepBuffers, StepShape

STOPS = ("\n\n\n\n", "<|stop here|>")  # two stop strings no emitted text holds


class NoopStep:
    """Stands in for `StepGraphRunner.run_loaded`: the decision buffers say every row accepted
    `emit - 1` drafts and emitted `emit` ordinary tokens (fixed per row, drawn once)."""

    def __init__(self, emit: int, vocab: list[int], rows: int, seed: int = 0):
        g = random.Random(seed)
        self.emit = emit
        self.tokens = torch.tensor([[g.choice(vocab) for _ in range(emit)] for _ in range(rows)])

    def __call__(self, buf: StepBuffers, shape: StepShape, width: int) -> None:
        b = buf.anchor.shape[0]
        buf.emit[:, :self.emit] = self.tokens[:b]
        buf.accept_len.fill_(self.emit - 1)


def setup(llm: LLM, bs: int, context: int, emit: int, stops: bool
          ) -> tuple[Scheduler, list[Request]]:
    """A scheduler over a runner whose step is a no-op, with `bs` requests running at
    `context` committed tokens (their pages held, as after their prefills)."""
    cfg = llm.config
    shape = StepShape("tree", emit - 1, llm.models.drafter.c.block_size, False)
    max_len = context + 4096
    max_pages = pages_needed(max_len + shape.max_emit, cfg.page_size)
    runner = StepGraphRunner(llm.models, llm.pool, shape, max_batch_size=bs, max_pages=max_pages,
                             capture_sizes=[bs])
    tok = llm.tokenizer
    ordinary = [t for t in range(tok.vocab_size) if t not in tok.special_tokens.values()]
    runner.run_loaded = NoopStep(emit, ordinary, bs)  # type: ignore[method-assign]
    sched = Scheduler(runner, num_pages=1 + bs * max_pages, page_size=cfg.page_size,
                      vocab_size=llm.models.target.cfg.vocab_size, max_batch_size=bs,
                      max_model_len=max_len, stop_ids=llm.tokenizer.stop_ids,
                      decoder=llm._stop_decoder)
    g = random.Random(1)
    params = SamplingParams(max_new_tokens=4000, ignore_eos=True, stop=STOPS if stops else ())
    reqs = []
    for i in range(bs):
        r = Request(i, [g.choice(ordinary) for _ in range(context)], params)
        r.output_ids = [g.choice(ordinary)]
        r.pages = sched.alloc.alloc(pages_needed(context, cfg.page_size))
        r.cache_len = r.fed = context
        reqs.append(r)
    sched.running = list(reqs)
    return sched, reqs


def measure(llm: LLM, bs: int, context: int, emit: int, stops: bool, steps: int) -> float:
    """Seconds per engine step (host work only), over `steps` steps after a few warm-ups."""
    sched, _ = setup(llm, bs, context, emit, stops)
    for _ in range(3):
        sched.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        sched.step()
    return (time.perf_counter() - t0) / steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.host", description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", type=int_list(1), default=[1, 8, 64])
    ap.add_argument("--contexts", type=int_list(1), default=[768, 32768])
    ap.add_argument("--emit", type=int, default=4, help="tokens each row emits a step")
    ap.add_argument("--steps", type=int, default=40, help="timed steps a measurement")
    ap.add_argument("--rounds", type=int, default=3, help="measurements (the median is kept)")
    ap.add_argument("--json", type=Path, help="write the rows here too")
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--report", action="store_true", help="also write bench/reports/host.md")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    llm = LLM(progress=False, kv_pages=2, max_batch_size=1, compile="off")
    rows: list[dict[str, Any]] = []
    for bs in a.batch_sizes:
        for context in a.contexts:
            for stops in (False, True):
                runs = [measure(llm, bs, context, a.emit, stops, a.steps) for _ in range(a.rounds)]
                sec = statistics.median(runs)
                rows.append({"batch_size": bs, "context": context, "stop_strings": 2 * stops,
                             "host_us_per_step": 1e6 * sec,
                             "host_us_per_token": 1e6 * sec / (bs * a.emit)})
                print(f"batch {bs:3d} context {context:6d} stops {2 * stops}: "
                      f"{rows[-1]['host_us_per_step']:.0f} us a step", flush=True)
    text = table(rows, [("batch_size", "batch", "d"), ("context", "context", "d"),
                        ("stop_strings", "stop strings", "d"),
                        ("host_us_per_step", "host us/step", ".0f"),
                        ("host_us_per_token", "host us/token", ".1f")])
    print(text)
    payload = {"rows": rows, "emit": a.emit, "steps": a.steps, "rounds": a.rounds}
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(payload, indent=2) + "\n")
    files = write_results("host", payload, out_dir=a.out)
    if a.report:
        write_report("host", "bench.host", text, files=files)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
