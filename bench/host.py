"""The host's share of an engine step, with the device step replaced by a no-op.

    python -m bench.host [--batch-sizes 1,8,64] [--contexts 768,32768] [--emit 4]
                         [--steps 40] [--rounds 3] [--json F] [--report]
                         [--streaming N [--stream-tokens 64] [--server-args "..."]]

On a GPU a whole speculative step is one graph replay of a few milliseconds; everything the
host does around it adds to that. This runs the real scheduler (`engine.scheduler.Scheduler`,
its page reservations and stop checks with the bundled tokenizer) and the real runner's staging
of every step input and read-back of the decision (`StepGraphRunner.load` and `step`), with the
step itself a no-op that emits `--emit` tokens per row (`NoopStep`), for running batches of
`--batch-sizes` rows whose contexts hold `--contexts` tokens, without and with two stop strings.
Admission and prefill are not timed: the rows start running. It prints the host microseconds per
step and per emitted token (medians over `--rounds`), and writes `{"rows": [{"batch_size",
"context", "stop_strings", "host_us_per_step", "host_us_per_token"}]}` to `--json`.

With `--streaming N`, it also serves the bundled pair (`engine.serve`, eager steps) to N
concurrent clients asking `--stream-tokens` tokens each, streamed and not, back to back in
each of `--rounds` rounds: the engine's mean step time (its `/metrics` counters) and the
tokens a second each way, as `"streaming": {"clients", "step_ms_streamed", "step_ms_not_streamed",
"tokens_per_s_streamed", "tokens_per_s_not_streamed"}` (medians) and `"step_ratio"`,
`"throughput_ratio"` (streamed over not, the median of each round's).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
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
                      decoder=llm.scheduler.decoder)
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


def serve_load(url: str, clients: int, tokens: int, stream: bool) -> dict[str, float]:
    """`clients` concurrent completions of `tokens` tokens each against the server at `url`,
    streamed or not: their tokens a second, and the engine's mean step time meanwhile."""
    import asyncio

    import httpx

    from bench.common import server_metrics

    def counters() -> tuple[float, float]:
        m = server_metrics(url)
        return m["kimi_engine_step_seconds_total"], m["kimi_engine_steps_total"]

    async def one(http: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": f"def f{i}(x):\n", "max_tokens": tokens, "ignore_eos": True,
                "temperature": 0, "stream": stream}
        async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{url}: {r.status_code}: {(await r.aread())[:200]!r}")
            async for _ in r.aiter_lines():  # every chunk, as a client reads them
                pass

    async def run() -> None:
        async with httpx.AsyncClient(timeout=600) as http:
            await asyncio.gather(*(one(http, i) for i in range(clients)))

    (s0, n0), t0 = counters(), time.perf_counter()
    asyncio.run(run())
    dt, (s1, n1) = time.perf_counter() - t0, counters()
    return {"step_ms": 1e3 * (s1 - s0) / max(n1 - n0, 1), "tokens_per_s": clients * tokens / dt}


def streaming(clients: int, tokens: int, rounds: int, out: Path, args: list[str]
              ) -> dict[str, Any]:
    """`serve_load` streamed and not, in turns, on one server of the bundled pair (given
    `args` too)."""
    from bench.serve import Server

    server = Server("host", ["--max-batch-size", str(clients), "--compile", "off",
                             "--log-level", "warning", *args], out / "host-server.log")
    try:
        server.wait_healthy(300)
        serve_load(server.url, clients, 8, False)  # warm-up
        runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
        for i in range(rounds):
            for stream in (False, True) if i % 2 == 0 else (True, False):
                runs[stream].append(serve_load(server.url, clients, tokens, stream))
                print(f"  {'streamed' if stream else 'whole'}: {runs[stream][-1]}", flush=True)
    finally:
        server.stop()
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("step_ms", "tokens_per_s")}
           for k, v in runs.items()}
    # NOTE: this machine's speed drifts over seconds: each round's two runs, back to back,
    # give a ratio, and the ratios' median is the figure (the medians' ratio is kept too).
    ratio = {m: statistics.median(s[m] / w[m] for s, w in zip(runs[True], runs[False]))
             for m in ("step_ms", "tokens_per_s")}
    return {"clients": clients, "tokens": tokens,
            "step_ms_streamed": med[True]["step_ms"], "step_ms_not_streamed": med[False]["step_ms"],
            "tokens_per_s_streamed": med[True]["tokens_per_s"],
            "tokens_per_s_not_streamed": med[False]["tokens_per_s"],
            "step_ratio": ratio["step_ms"], "throughput_ratio": ratio["tokens_per_s"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.host", description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", type=int_list(1), default=[1, 8, 64])
    ap.add_argument("--contexts", type=int_list(1), default=[768, 32768])
    ap.add_argument("--emit", type=int, default=4, help="tokens each row emits a step")
    ap.add_argument("--steps", type=int, default=40, help="timed steps a measurement")
    ap.add_argument("--rounds", type=int, default=3, help="measurements (the median is kept)")
    ap.add_argument("--streaming", type=int, default=0, metavar="N",
                    help="also serve N streaming clients against N whole-answer ones")
    ap.add_argument("--stream-tokens", type=int, default=64, help="tokens each client asks")
    ap.add_argument("--server-args", default="", help="more flags for the server, quoted")
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
    payload: dict[str, Any] = {"rows": rows, "emit": a.emit, "steps": a.steps,
                               "rounds": a.rounds}
    if a.streaming:
        st = payload["streaming"] = streaming(a.streaming, a.stream_tokens, a.rounds,
                                              Path(a.out), shlex.split(a.server_args))
        text += (f"\n\n{st['clients']} clients x {st['tokens']} tokens, {a.rounds} rounds"
                 f"{', server ' + a.server_args if a.server_args else ''}: "
                 f"engine step {st['step_ms_streamed']:.1f} ms streamed, "
                 f"{st['step_ms_not_streamed']:.1f} ms not (each round's ratio, median: "
                 f"{st['step_ratio']:.3f}x); {st['tokens_per_s_streamed']:.0f} tokens/s "
                 f"streamed, {st['tokens_per_s_not_streamed']:.0f} not "
                 f"({st['throughput_ratio']:.3f}x)")
    print(text)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(payload, indent=2) + "\n")
    files = write_results("host", payload, out_dir=a.out)
    if a.report:
        write_report("host", "bench.host", text, files=files)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
