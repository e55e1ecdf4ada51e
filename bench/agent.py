"""Agent sessions against the prefix cache: the server with it (the default) against one started
with `--no-enable-prefix-caching`, on the same sessions, in turns:

    python -m bench.agent [--sessions 3] [--turns 8] [--system-tokens 1200] [--max-tokens 32]
                          [--server-args "..."] [--report]

Each session is an agent loop through `/v1/chat/completions`: a long system prompt with tool
schemas (the same for every session), then `--turns` turns, each appending the model's answer
and a tool result (a few hundred tokens of source text), so every prompt resends the whole
conversation. `--sessions` sessions run side by side (one client thread each); each turn is sent
to both servers, which one first alternating from turn to turn, so the machine's drift falls on
both. Per turn: time to first token (the first streamed chunk), prompt tokens, cached tokens
(`usage.prompt_tokens_details.cached_tokens`) and prefilled tokens; the server's own hit rate
(Prometheus: hits / queries) must agree with the clients'. Every answer is checked equal between
the two servers (greedy). Then three checks:
- control: rounds of `--sessions` new prompts at once (0% hits), on one server then the other,
  generated tokens/s: the cache's overhead (the median of the rounds' ratios);
- cold against warm: a ~1,500-token prompt sent new, then again, on the cached server (TTFT);
- pressure: a server with `--kv-pages 300` takes 12 distinct ~1,400-token prompts, 4 at a time,
  each twice; every answer must equal the uncached server's.
Writes JSON and a PNG under `runs/bench/` (`--out`); `--report` writes `bench/reports/agent.md`.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from bench.common import server_metrics, table, write_report, write_results
from bench.serve import Server
from engine.llm import REPO

TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"{name.replace('_', ' ')} in the repository",
    "parameters": {"type": "object", "properties": {
        "path": {"type": "string", "description": "a file path relative to the root"},
        "pattern": {"type": "string"}, "limit": {"type": "integer"}}, "required": ["path"]}}}
    for name in ("read_file", "grep_files", "list_dir", "run_tests", "edit_file", "git_diff")]


def source_text(n_chars: int, seed: int) -> str:
    """`n_chars` of this repository's Python source from a seeded place: tool results."""
    files = sorted((REPO / "engine").glob("*.py"))
    rng = random.Random(seed)
    text = files[rng.randrange(len(files))].read_text()
    start = rng.randrange(max(len(text) - n_chars, 1))
    return text[start:start + n_chars]


def system_prompt(tokens: int) -> str:
    return ("You are a coding agent working in a Python repository. Use the tools; "
            "answer with short code. Repository notes:\n" + source_text(tokens * 3, 0))


def ask(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed chat request: the answer, its time to first token and its usage."""
    t0 = time.perf_counter()
    ttft, text = None, []
    usage: dict[str, Any] = {}
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=600, json={
            **body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk["choices"]:
                piece = c["delta"].get("content") or c["delta"].get("reasoning_content")
                if piece:
                    ttft = ttft or time.perf_counter() - t0
                    text.append(piece)
    return {"text": "".join(text), "ttft": ttft or time.perf_counter() - t0,
            "seconds": time.perf_counter() - t0, "prompt": usage["prompt_tokens"],
            "cached": usage["prompt_tokens_details"]["cached_tokens"],
            "completion": usage["completion_tokens"]}


def session_turns(servers: dict[str, Server], session: int, a: argparse.Namespace
                  ) -> list[dict[str, dict[str, Any]]]:
    """One agent session on both servers, turn by turn (the first server alternating)."""
    msgs = [{"role": "system", "content": system_prompt(a.system_tokens)},
            {"role": "user", "content": f"Session {session}: find why the scheduler test fails."}]
    out = []
    for turn in range(a.turns):
        body = {"messages": msgs, "tools": TOOLS, "max_tokens": a.max_tokens,
                "temperature": 0, "ignore_eos": True}
        names = list(servers) if (session + turn) % 2 == 0 else list(servers)[::-1]
        got = {n: ask(servers[n].url, body) for n in names}
        assert got["cached"]["text"] == got["uncached"]["text"], (session, turn)
        out.append(got)
        msgs = msgs + [{"role": "assistant", "content": got["cached"]["text"]},
                       {"role": "user", "content": "Tool result:\n" + source_text(
                           a.result_chars, 100 * session + turn)}]
    return out


def run_sessions(servers: dict[str, Server], a: argparse.Namespace
                 ) -> tuple[list[list[dict[str, Any]]], float]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(a.sessions) as pool:
        results = list(pool.map(lambda s: session_turns(servers, s, a), range(a.sessions)))
    return results, time.perf_counter() - t0


def per_turn(results: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for turn in range(len(results[0])):
        cells = [s[turn] for s in results]
        row: dict[str, Any] = {"turn": turn + 1}
        for name in ("cached", "uncached"):
            row[f"ttft_{name}"] = statistics.median(c[name]["ttft"] for c in cells)
        row["prompt"] = statistics.mean(c["cached"]["prompt"] for c in cells)
        row["cached_tokens"] = statistics.mean(c["cached"]["cached"] for c in cells)
        row["prefilled"] = row["prompt"] - row["cached_tokens"]
        row["hit_rate"] = row["cached_tokens"] / row["prompt"]
        row["ttft_ratio"] = row["ttft_cached"] / row["ttft_uncached"]
        rows.append(row)
    return rows


def control(servers: dict[str, Server], a: argparse.Namespace) -> list[float]:
    """0% hits: each round sends `--sessions` new prompts (a random head, then a session's
    first turn) at once to one server, then to the other (which first alternating), and
    compares their generated tokens/s; returns the per-round ratios cached / uncached."""
    ratios = []
    for r in range(a.rounds):
        rate = {}
        for name in (list(servers) if r % 2 == 0 else list(servers)[::-1]):
            bodies = [{"messages": [
                {"role": "system", "content": f"[{random.random()}] " + system_prompt(
                    a.system_tokens)}, {"role": "user", "content": source_text(300, r * 10 + i)}],
                "tools": TOOLS, "max_tokens": a.max_tokens, "temperature": 0, "ignore_eos": True}
                for i in range(a.sessions)]
            t0 = time.perf_counter()
            with ThreadPoolExecutor(len(bodies)) as pool:
                got = list(pool.map(lambda b, n=name: ask(servers[n].url, b), bodies))
            assert all(g["cached"] == 0 for g in got)  # nothing to hit
            rate[name] = sum(g["completion"] for g in got) / (time.perf_counter() - t0)
        ratios.append(rate["cached"] / rate["uncached"])
    return ratios


def pressure(a: argparse.Namespace, log_dir: Path, reference: Server) -> dict[str, Any]:
    """12 distinct ~1,400-token prompts, 4 at a time, each sent twice, through a 300-page pool:
    every answer equal to the uncached server's."""
    small = Server("pressure", [*shlex.split(a.server_args), "--kv-pages", "300"],
                   log_dir / "agent-pressure.log")
    try:
        small.wait_healthy(300)
        prompts = [[{"role": "system", "content": source_text(4200, 500 + i)},
                    {"role": "user", "content": "summarize"}] for i in range(12)]

        def both(i: int) -> bool:
            body = {"messages": prompts[i % 12], "max_tokens": 16, "temperature": 0}
            return ask(small.url, body)["text"] == ask(reference.url, body)["text"]

        with ThreadPoolExecutor(4) as pool:
            same = list(pool.map(both, list(range(12)) * 2))
        m = server_metrics(small.url)
        return {"requests": len(same), "equal": sum(same),
                "evicted_pages": m.get("kimi_prefix_cache_evicted_pages_total", 0.0),
                "preemptions": m.get("kimi_preemptions_total", 0.0)}
    finally:
        small.stop()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.agent", description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=1200)
    ap.add_argument("--result-chars", type=int, default=900, help="a tool result's characters")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=6, help="rounds of the 0%%-hit control")
    ap.add_argument("--server-args", default="", help="flags for both servers")
    ap.add_argument("--out", default="runs/bench")
    ap.add_argument("--report", action="store_true")
    a = ap.parse_args(argv)
    out = Path(a.out)
    args = shlex.split(a.server_args)
    servers = {"cached": Server("cached", args, out / "agent-cached.log"),
               "uncached": Server("uncached", [*args, "--no-enable-prefix-caching"],
                                  out / "agent-uncached.log")}
    try:
        for s in servers.values():
            s.wait_healthy(300)
        m0 = server_metrics(servers["cached"].url)
        results, wall = run_sessions(servers, a)
        m1 = server_metrics(servers["cached"].url)
        rows = per_turn(results)
        q = m1["kimi_prefix_cache_queries_total"] - m0.get("kimi_prefix_cache_queries_total", 0)
        h = m1["kimi_prefix_cache_hits_total"] - m0.get("kimi_prefix_cache_hits_total", 0)
        client_rate = (sum(t["cached"]["cached"] for s in results for t in s)
                       / sum(t["cached"]["prompt"] for s in results for t in s))
        ratios = control(servers, a)
        overhead = statistics.median(ratios)
        long = [{"role": "system", "content": source_text(4500, 999)},
                {"role": "user", "content": "what does this do?"}]
        cold = ask(servers["cached"].url, {"messages": long, "max_tokens": 4})
        warm = ask(servers["cached"].url, {"messages": long, "max_tokens": 4})
        press = pressure(a, out, servers["uncached"])
    finally:
        for s in servers.values():
            s.stop()
    cols = [("turn", "turn", "d"), ("prompt", "prompt tok", ".0f"),
            ("cached_tokens", "cached", ".0f"), ("prefilled", "prefilled", ".0f"),
            ("hit_rate", "hit rate", ".0%"), ("ttft_cached", "TTFT cache (s)", ".3f"),
            ("ttft_uncached", "TTFT no cache (s)", ".3f"), ("ttft_ratio", "ratio", ".2f")]
    text = [f"{a.sessions} sessions x {a.turns} turns side by side, greedy, answers of "
            f"{a.max_tokens} tokens, a {a.system_tokens}-token system prompt with "
            f"{len(TOOLS)} tools; every answer equal on both servers",
            table(rows, cols),
            f"hit rate over the sessions: clients {client_rate:.1%}, server (hits / queries) "
            f"{h / q:.1%}; from turn 2: "
            f"{sum(r['cached_tokens'] for r in rows[1:]) / sum(r['prompt'] for r in rows[1:]):.1%}",
            f"time to first token from turn 2, cache / no cache: "
            f"{statistics.median(r['ttft_ratio'] for r in rows[1:]):.2f}x (median of turns); "
            f"sessions' wall time {wall:.1f} s",
            f"control, every prompt new (0% hits), {a.sessions} at once, {a.rounds} rounds: "
            f"generated tokens/s with the cache {overhead:.3f}x without it (median of the "
            f"rounds' ratios; each: {', '.join(f'{x:.3f}' for x in ratios)})",
            f"a {cold['prompt']}-token prompt on the cached server: TTFT cold {cold['ttft']:.3f} "
            f"s, again {warm['ttft']:.3f} s ({warm['cached']} tokens cached): "
            f"{warm['ttft'] / cold['ttft']:.2f}x",
            f"pressure (--kv-pages 300, 12 distinct ~1,400-token prompts, 4 at a time, each "
            f"twice): {press['equal']} of {press['requests']} answers equal to the uncached "
            f"server's, {press['evicted_pages']:.0f} pages evicted, "
            f"{press['preemptions']:.0f} preemptions"]
    print("\n".join(text))
    payload = {"args": vars(a), "turns": rows, "client_hit_rate": client_rate,
               "server_hit_rate": h / q, "control_tokens_per_s_ratio": overhead,
               "control_round_ratios": ratios,
               "cold_ttft": cold, "warm_ttft": warm, "pressure": press}

    def plot(fig: Any) -> None:
        ax = fig.add_subplot(1, 2, 1)
        t = [r["turn"] for r in rows]
        ax.plot(t, [r["ttft_cached"] for r in rows], "o-", label="prefix cache")
        ax.plot(t, [r["ttft_uncached"] for r in rows], "s-", label="no cache")
        ax.set_xlabel("turn")
        ax.set_ylabel("time to first token (s)")
        ax.legend()
        bx = fig.add_subplot(1, 2, 2)
        bx.bar(t, [r["prefilled"] for r in rows], label="prefilled")
        bx.bar(t, [r["cached_tokens"] for r in rows], bottom=[r["prefilled"] for r in rows],
               label="cached")
        bx.set_xlabel("turn")
        bx.set_ylabel("prompt tokens")
        bx.legend()

    files = write_results("agent", payload, plot, out)
    if a.report:
        write_report("agent", "bench.agent", text, argv=argv, files=files)


if __name__ == "__main__":
    main()
