"""The OpenAI-compatible server against itself in `--mode ar` and against the offline engine:

    python -m bench.serve [--model DIR --draft DIR] [--requests 32] [--clients 1 4 16]
                          [--temperatures 0 0.7] [--max-tokens 64] [--prompt-len 128]
                          [--rounds 3] [--turn 4] [--server-args "--budget 8"]

Starts two `python -m engine.serve` processes on free loopback ports, one in its default mode
("default") and one with `--mode ar`, both with `--server-args`. Each cell (temperature, number
of concurrent clients) sends the same held-out prompts (token ids, at most `--prompt-len`) to
`/v1/completions` with `ignore_eos`, each client taking the next request until all are done;
throughput is completion tokens over the cell's wall time. Every round runs each cell on both
servers side by side: the servers take turns of `--turn` requests per client (`turns`), which one
first alternating from turn to turn, cell to cell and round to round (`round_order`), so a drift of
the machine's speed, which moves a tenth within seconds here, falls on both alike (`--turn 0`: the
whole cell on one server, then on the other). A turn's requests are its own: the next turn starts
when its last one returns, so each turn ends with a drain (a batch emptying as its rows finish);
at 16 clients the default turn holds every request of a cell. Then the offline `LLM` (the
default server's engine flags, loaded once in this process, torch's default threads) runs the
same requests one at a time, as a single client sees them. Each number is the median over
rounds, and each cell also reports the median of its rounds' own default/ar ratios ("paired",
`cell_row`), as does the server at one client against the offline engine. `--server-args
"--mode ar"` runs AR against AR: what a cell reads from noise alone. Writes JSON and a PNG under
`runs/bench/` (`--out`), and each server's log beside them (`serve-default.log`,
`serve-ar.log`); `--report` also writes `bench/reports/serve.md` (`bench.common.write_report`).
"""

from __future__ import annotations

import argparse
import shlex
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import httpx
from pydantic import ValidationError

from bench.common import (
    bench_prompts,
    environment,
    paired_ratios,
    server_metrics,
    table,
    write_report,
    write_results,
)
from engine.config import EngineConfig, SamplingParams, add_cli_args, error_text, from_cli
from engine.llm import LLM, REPO, compile_auto, model_pair
from graphs.measure import round_order


class Server:
    """One `engine.serve` subprocess on a free loopback port, its output in `log`."""

    def __init__(self, name: str, args: list[str], log: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.name, self.url = name, f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "engine.serve", "--host", "127.0.0.1",
                    "--port", str(self.port), *args]
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log: IO[bytes] = log.open("w+b")
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, stdout=self.log,
                                     stderr=subprocess.STDOUT)

    def tail(self, lines: int = 30) -> str:
        self.log.seek(0)
        return "\n".join(self.log.read().decode(errors="replace").splitlines()[-lines:])

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server {self.name!r} exited with {self.proc.returncode} "
                                 f"({shlex.join(self.cmd)}):\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"server {self.name!r} not healthy after {timeout:.0f} s "
                         f"({shlex.join(self.cmd)}):\n{self.tail()}")

    def engine_seconds(self) -> float:
        """The server's wall time in scheduler steps so far (Prometheus counter)."""
        return server_metrics(self.url).get("kimi_engine_step_seconds_total", float("nan"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def body(ids: list[int], max_tokens: int, temperature: float, seed: int | None
         ) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt": ids, "max_tokens": max_tokens, "ignore_eos": True,
                           "temperature": temperature}
    if temperature > 0 and seed is not None:
        out["seed"] = seed
    return out


def run_cell(client: httpx.Client, server: Server, prompts: list[list[int]], clients: int,
             max_tokens: int, temperature: float, seed: int,
             ids: range | None = None) -> dict[str, float]:
    """The prompts `ids` (default all) through `clients` concurrent clients; completion tokens
    over wall time, and the server's time in engine steps meanwhile."""
    url, busy = server.url, server.engine_seconds()

    def one(i: int) -> int:
        r = client.post(f"{url}/v1/completions",
                        json=body(prompts[i], max_tokens, temperature, seed + i))
        if r.status_code != 200:
            raise RuntimeError(f"{url}: request {i} failed with {r.status_code}: {r.text}")
        return r.json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:  # each worker takes the next request in turn
        tokens = sum(pool.map(one, range(len(prompts)) if ids is None else ids))
    dt = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt,
            "step_seconds": server.engine_seconds() - busy}


def turns(requests: int, clients: int, turn: int) -> list[range]:
    """The request indices each turn of a cell sends: `turn` requests per client (0: one turn)."""
    size = turn * clients or requests
    return [range(i, min(i + size, requests)) for i in range(0, requests, size)]


def run_offline(llm: LLM, prompts: list[list[int]], max_tokens: int, temperature: float,
                seed: int) -> dict[str, float]:
    """The same requests one at a time, as a single client sees them."""
    t0 = time.perf_counter()
    tokens = 0
    for i, ids in enumerate(prompts):
        sp = SamplingParams(temperature=temperature, max_new_tokens=max_tokens, ignore_eos=True,
                            seed=seed + i if temperature > 0 else None)
        tokens += len(llm.generate([ids], sp)[0].token_ids)
    dt = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt}


def median(rounds: list[dict[str, float]]) -> dict[str, Any]:
    rates = [r["tokens_per_s"] for r in rounds]
    out = {"tokens_per_s": statistics.median(rates), "tokens_per_s_rounds": rates,
           "tokens": rounds[0]["tokens"], "seconds_rounds": [r["seconds"] for r in rounds]}
    if "step_seconds" in rounds[0]:  # the server's time in engine steps, for stalls
        out["step_seconds_rounds"] = [r["step_seconds"] for r in rounds]
    return out


def cell_row(temperature: float, clients: int, default: list[dict[str, float]],
             ar: list[dict[str, float]]) -> dict[str, Any]:
    """One cell's row: each server's median over the rounds, the ratio of those medians, and
    each round's own ratio with their median (`round_median`, the table's "paired"). A round
    runs the cell on both servers in turns, so a slow spell of the machine that spans it moves
    both; the ratio of medians may take its two medians from different spells."""
    d, a = median(default), median(ar)
    pairs = paired_ratios([r["tokens_per_s"] for r in ar], [r["tokens_per_s"] for r in default])
    return {"temperature": temperature, "clients": clients, "default": d, "ar": a,
            "default_tok_s": d["tokens_per_s"], "ar_tok_s": a["tokens_per_s"],
            "ratio": d["tokens_per_s"] / a["tokens_per_s"], "round_ratios": pairs,
            "round_median": statistics.median(pairs)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--server-args", default="", help="engine flags for both servers and the "
                                                      "offline engine, one shell-quoted string")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128, help="prompts cut to this many tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--turn", type=int, default=4, help="requests per client in each server's "
                    "turn within a cell (0: each server the whole cell in one turn)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=1800.0,
                    help="seconds a server may take to load and compile its steps")
    ap.add_argument("--out", default="runs/bench")
    ap.add_argument("--report", action="store_true",
                    help="also write bench/reports/serve.md (command, commit, machine, date, the "
                         "table)")
    a = ap.parse_args(argv)
    for flag in ("requests", "max_tokens", "prompt_len", "rounds"):
        if getattr(a, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(a, flag)}")
    if a.turn < 0:
        ap.error(f"--turn must be >= 0, got {a.turn}")
    if min(a.clients) < 1:
        ap.error(f"--clients must all be >= 1, got {a.clients}")
    if min(a.temperatures) < 0:
        ap.error(f"--temperatures must all be >= 0, got {a.temperatures}")
    extra = shlex.split(a.server_args)
    engine_ap = argparse.ArgumentParser(prog="--server-args", add_help=False)
    add_cli_args(engine_ap, EngineConfig)
    paths = {k: v for k, v in (("model", a.model), ("draft", a.draft)) if v is not None}
    try:
        config = from_cli(EngineConfig, engine_ap.parse_known_args(extra)[0], **paths)
    except ValidationError as e:
        ap.error(f"--server-args: {error_text(e)}")
    common = [f for k, v in paths.items() for f in (f"--{k}", v)] + extra
    logs = Path(a.out)
    servers = [Server("default", common, logs / "serve-default.log"),
               Server("ar", [*common, "--mode", "ar"], logs / "serve-ar.log")]
    try:
        _bench(a, config, servers, argv)
    finally:
        for s in servers:
            s.stop()


def _bench(a: argparse.Namespace, config: EngineConfig, servers: list[Server],
           argv: list[str] | None = None) -> None:
    printed: list[str] = []  # what `--report` holds

    def show(text: str, **kw: Any) -> None:
        print(text, **kw)
        printed.append(text)

    # loads while the servers start; compiled only where the server is (`--compile auto` leaves
    # a server eager, as `engine.serve` settles it)
    llm = LLM(config=compile_auto(config, False), progress=False)
    prompts, source = bench_prompts(llm, model_pair(config.model, config.draft)[0], a.requests,
                                    a.seed)
    prompts = [p[:a.prompt_len] for p in prompts]
    for s in servers:
        s.wait_healthy(a.startup_timeout)
    show(f"{len(prompts)} requests ({source}, {min(map(len, prompts))}-"
         f"{max(map(len, prompts))} prompt tokens), {a.max_tokens} new tokens each; default "
         f"mode {config.mode!r}; servers up", flush=True)
    temps, cells = a.temperatures, [(t, c) for t in a.temperatures for c in a.clients]
    res: dict[tuple[str, float, int], list[dict[str, float]]] = {
        (s.name, t, c): [] for s in servers for t, c in cells}
    off: dict[float, list[dict[str, float]]] = {t: [] for t in temps}
    limits = httpx.Limits(max_connections=max(a.clients) + 4)
    with httpx.Client(timeout=httpx.Timeout(3600.0, connect=30.0), limits=limits) as client:
        for t in temps:  # warm-up: one short request per server and temperature
            for s in servers:
                run_cell(client, s, prompts[:1], 1, min(8, a.max_tokens), t, a.seed)
            run_offline(llm, prompts[:1], min(8, a.max_tokens), t, a.seed)
        for r in range(a.rounds):
            for k, (t, c) in enumerate(cells):
                parts: dict[str, list[dict[str, float]]] = {s.name: [] for s in servers}
                for j, ids in enumerate(turns(len(prompts), c, a.turn)):
                    for s in round_order(servers, r + k + j):
                        parts[s.name].append(
                            run_cell(client, s, prompts, c, a.max_tokens, t, a.seed, ids))
                for s in servers:
                    m = {f: sum(p[f] for p in parts[s.name])
                         for f in ("tokens", "seconds", "step_seconds")}
                    m["tokens_per_s"] = m["tokens"] / m["seconds"]
                    res[(s.name, t, c)].append(m)
                    print(f"round {r + 1}/{a.rounds}  T={t:g}  clients {c:>3}  {s.name:>7}: "
                          f"{m['tokens_per_s']:7.1f} tok/s ({m['tokens']:.0f} tokens in "
                          f"{m['seconds']:.1f} s, {m['step_seconds']:.1f} s in engine steps)",
                          flush=True)
            for t in temps:
                m = run_offline(llm, prompts, a.max_tokens, t, a.seed)
                off[t].append(m)
                print(f"round {r + 1}/{a.rounds}  T={t:g}  offline, one at a time: "
                      f"{m['tokens_per_s']:7.1f} tok/s ({m['seconds']:.1f} s)", flush=True)
    rows = [cell_row(t, c, res[("default", t, c)], res[("ar", t, c)]) for t, c in cells]
    show(table(rows, [("temperature", "T", "g"), ("clients", "clients", "d"),
                      ("default_tok_s", "default tok/s", ".1f"),
                      ("ar_tok_s", "ar tok/s", ".1f"), ("ratio", "default/ar", ".2f"),
                      ("round_median", "paired", ".2f")]))
    offline = []
    for t in temps:
        o = median(off[t])
        one = next((r for r in rows if r["temperature"] == t and r["clients"] == 1), None)
        # each round runs the one-client cell, then the offline engine: paired as the cells are
        paired = one and statistics.median(
            paired_ratios(o["tokens_per_s_rounds"], one["default"]["tokens_per_s_rounds"]))
        o.update(temperature=t, server_1client_tok_s=one and one["default_tok_s"],
                 server_vs_offline=one and one["default_tok_s"] / o["tokens_per_s"],
                 server_vs_offline_paired=paired)
        offline.append(o)
        show(f"T={t:g}: server 1 client {o['server_1client_tok_s'] or float('nan'):.1f} tok/s, "
             f"offline {o['tokens_per_s']:.1f} tok/s, server/offline "
             f"{o['server_vs_offline'] or float('nan'):.2f} (paired {paired or float('nan'):.2f})")
    greedy1 = next((r for r in rows if r["temperature"] == 0 and r["clients"] == 1), None)
    greedy_off = next((o for o in offline if o["temperature"] == 0), None)
    summary = {"min_default_vs_ar": min(r["ratio"] for r in rows),
               "default_vs_ar_1client_greedy": greedy1 and greedy1["ratio"],
               "min_paired": min(r["round_median"] for r in rows),
               "paired_1client_greedy": greedy1 and greedy1["round_median"],
               "server_vs_offline_1client_greedy": greedy_off and greedy_off["server_vs_offline"],
               "paired_server_vs_offline_1client_greedy":
                   greedy_off and greedy_off["server_vs_offline_paired"]}
    show("  ".join(f"{k} {v:.2f}" if v is not None else f"{k} -" for k, v in summary.items()))

    def plot(fig: Any) -> None:
        ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
        for i, t in enumerate(temps):
            mine = [r for r in rows if r["temperature"] == t]
            xs, color = [r["clients"] for r in mine], f"C{i}"
            ax1.plot(xs, [r["ratio"] for r in mine], "o-", color=color, label=f"T={t:g}")
            ax2.plot(xs, [r["default"]["tokens_per_s"] for r in mine], "o-", color=color,
                     label=f"default T={t:g}")
            ax2.plot(xs, [r["ar"]["tokens_per_s"] for r in mine], "s--", color=color,
                     label=f"ar T={t:g}")
            ax2.plot([1], [offline[i]["tokens_per_s"]], "*", ms=12, color=color,
                     label=f"offline T={t:g}")
        ax1.axhline(1.0, ls="--", color="gray")
        for ax, label in ((ax1, f"tokens/s, {config.mode} / ar"), (ax2, "tokens/s")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent clients")
            ax.set_ylabel(label)
            ax.legend(fontsize=8)

    for r in rows:
        del r["default_tok_s"], r["ar_tok_s"]
    paths = write_results("serve", {
        "params": vars(a), "env": environment("cpu"), "prompts": source,
        "default_mode": config.mode, "servers": {s.name: shlex.join(s.cmd) for s in servers},
        "cells": rows, "offline": offline, "summary": summary}, plot, a.out)
    if a.report:
        write_report("serve", "bench.serve", printed, argv=argv, files=paths)


if __name__ == "__main__":
    main()
