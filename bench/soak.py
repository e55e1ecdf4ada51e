"""A long mixed load against one server, to show that no request breaks it:

    python -m bench.soak [--model DIR --draft DIR] [--requests 1000] [--concurrency 16]
                         [--max-seconds 900] [--max-tokens 32] [--timeout 600]
                         [--server-args "..."] [--report]

Starts `python -m engine.serve` on a free loopback port (the bundled model by default) with an
API key and `--request-timeout 2`, then sends `--requests` requests, `--concurrency` at a time,
drawn in turn from every kind below: good completions and chats (greedy, sampled, streamed or
not), Anthropic Messages (`/v1/messages`) and Responses (`/v1/responses`, stored or not, a
stored one read back) answers, streamed or not, bodies with bad fields on each of these routes,
untyped bodies, wrong keys, bodies declaring more bytes than the limit, clients that leave
mid-stream, while waiting or mid-body, and bodies that never finish (408). It stops early after
`--max-seconds`. It then waits for the server to be idle and reports the answers' statuses by
kind, the server's own counts (`/metrics`), its resident memory after a warm-up and at the end,
and its free KV pages before and after. The run fails (exit 1) on any
500, a status a kind should never get, or KV pages not all back. `--report` writes
`bench/reports/soak.md` (`bench.common.write_report`). Only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import shlex
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

from bench.common import server_metrics, write_report
from bench.serve import Server

KEY = "soak-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
REQUEST_TIMEOUT_S = 2.0
# kind -> the statuses it may get (0: the client left, so it read none)
KINDS: dict[str, set[int]] = {
    "greedy": {200}, "sampled": {200}, "stream": {200}, "chat": {200}, "chat-stream": {200},
    "bad-field": {400}, "untyped": {415}, "no-key": {401}, "too-large": {413},
    "leave-stream": {0, 200}, "leave-waiting": {0}, "leave-body": {0}, "slow-body": {408},
    "messages": {200}, "messages-stream": {200}, "messages-bad": {400},
    "responses": {200}, "responses-stream": {200}, "responses-bad": {400, 404},
}
WARM_UP = 32  # requests before the first memory reading
# The most the server's memory may grow from the warm-up to the end, less the KV pages the
# prefix cache wrote meanwhile: a CPU pool's memory is taken as its pages are first written,
# and the cache keeps its pages (up to the pool), so neither is a leak.
MAX_RSS_GROWTH_MIB = 50
KV_POOL_RE = re.compile(r"KV pool: [\d,]+ tokens \(([\d,]+) pages of \d+, ([\d.]+) GB\)")


def page_bytes(log: str) -> float:
    """A KV page's bytes, from the server's `KV pool:` line (0 when it printed none)."""
    m = KV_POOL_RE.search(log)
    return float(m.group(2)) * 1e9 / int(m.group(1).replace(",", "")) if m else 0.0


def rss_kib(pid: int) -> int:
    """The resident memory of process `pid` and its descendants (the server's HTTP process is
    the engine's child)."""
    total = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            total = int(line.split()[1])
    kids = Path(f"/proc/{pid}/task/{pid}/children")
    for kid in kids.read_text().split() if kids.exists() else ():
        with contextlib.suppress(OSError):  # gone meanwhile
            total += rss_kib(int(kid))
    return total


async def raw(url: str, data: bytes, read: bool, wait: float) -> int:
    """`data` on a fresh connection; the answer's status when `read` (0 if none came within
    `wait` seconds), else 0 after leaving at once."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        await writer.drain()
        if not read:
            return 0
        line = await asyncio.wait_for(reader.readline(), wait)
        return int(line.split()[1]) if line.startswith(b"HTTP/1.1 ") else 0
    except TimeoutError:
        return 0
    finally:
        writer.close()


async def _read(http: httpx.AsyncClient, url: str, body: dict, stream: bool) -> int:
    """POSTs `body`; the status, after reading the whole answer (a stream to its end)."""
    if not stream:
        return (await http.post(url, json=body)).status_code
    async with http.stream("POST", url, json=body) as r:
        async for _ in r.aiter_lines():
            pass
        return r.status_code


async def one(kind: str, i: int, url: str, http: httpx.AsyncClient, max_tokens: int) -> int:
    rng = random.Random(i)
    prompt = " ".join(rng.choice(["the", "a", "cat", "sat", "on", "mat", "why", "how"])
                      for _ in range(rng.randrange(3, 40)))
    comp = {"prompt": prompt, "max_tokens": rng.randrange(1, max_tokens + 1)}
    chat = {"messages": [{"role": "user", "content": prompt}],
            "max_tokens": rng.randrange(1, max_tokens + 1)}
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}"
            f"\r\ncontent-type: application/json\r\n").encode()
    if kind in ("greedy", "sampled"):
        body = dict(comp, temperature=0.0) if kind == "greedy" else dict(
            comp, temperature=rng.choice([0.5, 1.0, 1e-30]), top_k=rng.choice([-1, 0, 5]),
            top_p=rng.choice([1.0, 0.9]), seed=i)
        return (await http.post(url + "/v1/completions", json=body)).status_code
    if kind in ("stream", "chat-stream", "leave-stream"):
        path, body = (("/v1/chat/completions", chat) if kind == "chat-stream"
                      else ("/v1/completions", comp))
        async with http.stream("POST", url + path, json=dict(body, stream=True)) as r:
            async for line in r.aiter_lines():
                if kind == "leave-stream" and line.startswith("data: "):
                    return 0
            return r.status_code
    if kind == "chat":
        return (await http.post(url + "/v1/chat/completions", json=chat)).status_code
    if kind.startswith("messages"):
        msgs = {"messages": chat["messages"], "max_tokens": chat["max_tokens"],
                "system": rng.choice([None, "Be brief."]), "temperature": rng.choice([0.0, 0.8])}
        if kind == "messages-bad":
            msgs.update(rng.choice([{"max_tokens": 0}, {"messages": []}, {"top_k": -1},
                                    {"messages": [{"role": "user", "content": [
                                        {"type": "image", "source": {}}]}]},
                                    {"stop_sequences": ["a", "b", "c", "d", "e"]}]))
        elif kind == "messages-stream":
            msgs["stream"] = True
        return await _read(http, url + "/v1/messages", msgs, kind.endswith("stream"))
    if kind.startswith("responses"):
        body = {"input": prompt, "max_output_tokens": chat["max_tokens"],
                "store": rng.random() < 0.5, "temperature": rng.choice([0.0, 0.8])}
        if kind == "responses-bad":
            if rng.random() < 0.25:
                return (await http.get(url + "/v1/responses/resp_unknown")).status_code
            body.update(rng.choice([{"input": []}, {"max_output_tokens": 0},
                                    {"previous_response_id": "resp_unknown"},
                                    {"tool_choice": "sometimes"}, {"top_p": 2}]))
        elif kind == "responses-stream":
            body["stream"] = True
        if kind != "responses" or not body["store"]:
            return await _read(http, url + "/v1/responses", body, kind.endswith("stream"))
        r = await http.post(url + "/v1/responses", json=body)
        if r.status_code != 200:
            return r.status_code
        # a stored answer is read back (the same), then deleted
        stored = await http.get(url + "/v1/responses/" + r.json()["id"])
        gone = await http.delete(url + "/v1/responses/" + r.json()["id"])
        same = stored.status_code == 200 and stored.json()["output"] == r.json()["output"]
        return gone.status_code if same else -2
    if kind == "bad-field":
        bad = rng.choice([{"top_k": 2**63}, {"temperature": float("1e300")}, {"seed": 2**70},
                          {"stop": ["a", "b", "c", "d", "e"]}, {"stop": [""]},
                          {"prompt": ["a", "b"]}, {"max_tokens": 2**80}, {"prompt": [1, 10**9]}])
        return (await http.post(url + "/v1/completions", json={**comp, **bad})).status_code
    if kind == "untyped":
        return (await http.post(url + "/v1/completions", content=json.dumps(comp),
                                headers={**AUTH, "content-type": "text/plain"})).status_code
    if kind == "no-key":
        return (await http.post(url + "/v1/completions", json=comp,
                                headers={"Authorization": "Bearer wrong"})).status_code
    if kind == "too-large":
        return await raw(url, head + b"content-length: 999999999\r\n\r\n{", True, 10)
    if kind == "leave-waiting":
        try:
            await http.post(url + "/v1/completions", json=dict(comp, max_tokens=max_tokens,
                                                               ignore_eos=True),
                            timeout=httpx.Timeout(60, read=0.05))
        except httpx.ReadTimeout:
            return 0
        return 0
    if kind == "leave-body":
        return await raw(url, head + b"content-length: 500\r\n\r\n{\"prompt\"", False, 0)
    assert kind == "slow-body"
    return await raw(url, head + b"content-length: 500\r\n\r\n{\"prompt\"", True,
                     REQUEST_TIMEOUT_S + 10)


async def drive(a: argparse.Namespace, server: Server) -> tuple[Counter, int, int]:
    """Sends the requests; returns (kind, status) counts, the RSS after the warm-up, and how
    many requests were sent."""
    kinds = list(KINDS)
    seen: Counter = Counter()
    gate = asyncio.Semaphore(a.concurrency)
    deadline = time.monotonic() + a.max_seconds
    warm_rss, warm_cached = 0, 0
    sent = 0

    async with httpx.AsyncClient(timeout=a.timeout, headers=AUTH,
                                 limits=httpx.Limits(max_connections=a.concurrency)) as http:
        async def gated(i: int) -> None:
            nonlocal warm_rss, warm_cached
            async with gate:
                if time.monotonic() > deadline:
                    return
                kind = kinds[i % len(kinds)]
                try:
                    status = await one(kind, i, server.url, http, a.max_tokens)
                except httpx.HTTPError as e:
                    status = -1
                    print(f"request {i} ({kind}): {type(e).__name__}: {e}", file=sys.stderr)
                seen[kind, status] += 1
                if i == WARM_UP:
                    warm_rss = rss_kib(server.proc.pid)
                    warm_cached = (await http.get(server.url + "/health")).json().get(
                        "kv_pages_cached", 0)

        tasks = []
        for i in range(a.requests):
            tasks.append(asyncio.create_task(gated(i)))
            sent += 1
        await asyncio.gather(*tasks)
    return seen, (warm_rss, warm_cached), sent


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--server-args", default="", help="more flags for engine.serve")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-seconds", type=float, default=900.0, help="stop sending after this")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a client waits for "
                    "an answer (one that gives up counts as status -1)")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--out", default="runs/bench", help="where the server's log goes")
    ap.add_argument("--report", action="store_true", help="write bench/reports/soak.md")
    a = ap.parse_args(argv)
    args = ["--api-key", KEY, "--request-timeout", str(REQUEST_TIMEOUT_S), "--log-level",
            "warning", *shlex.split(a.server_args)]
    if a.model:
        args += ["--model", a.model]
    if a.draft:
        args += ["--draft", a.draft]
    log_path = Path(a.out) / "soak-server.log"
    server = Server("soak", args, log_path)
    try:
        server.wait_healthy(a.startup_timeout)
        h0 = httpx.get(f"{server.url}/health", timeout=10).json()
        pages0 = h0["kv_pages_free"]
        start_rss = rss_kib(server.proc.pid)
        t0 = time.monotonic()
        seen, (warm_rss, warm_cached), sent = asyncio.run(drive(a, server))
        judged = bool(warm_rss)  # memory is judged after a warm-up only
        if not judged:
            warm_rss, warm_cached = start_rss, h0.get("kv_pages_cached", 0)
        seconds = time.monotonic() - t0
        deadline = time.monotonic() + 60
        while True:  # idle: nothing running or waiting, every page back
            h = httpx.get(f"{server.url}/health", timeout=10).json()
            if not (h["running"] or h["waiting"] or h["active"]) and \
                    h["kv_pages_free"] == pages0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        end_rss = rss_kib(server.proc.pid)
        m = server_metrics(server.url)
    finally:
        server.stop()

    lines = [f"server: {shlex.join(server.cmd)}",
             f"requests: {sum(seen.values())} answered of {sent} sent, {a.concurrency} at a "
             f"time, in {seconds:.1f} s", "", "status by kind (0: the client left first):"]
    bad = []
    for kind, allowed in KINDS.items():
        got = {s: n for (k, s), n in sorted(seen.items()) if k == kind}
        wrong = {s: n for s, n in got.items() if s not in allowed}
        bad += [f"{kind}: status {s} x{n}" for s, n in wrong.items()]
        lines.append(f"  {kind:<14} " + ", ".join(f"{s}: {n}" for s, n in got.items())
                     + ("   <- unexpected" if wrong else ""))
    lines += ["", "server's counts (/metrics):"]
    for k, v in sorted(m.items()):
        if k.startswith(("kimi_requests_total", "kimi_requests_finished_total")) and v:
            lines.append(f"  {k} {v:g}")
    served500 = sum(v for k, v in m.items() if 'status="500"' in k)
    text = log_path.read_text(errors="replace")
    errors = sum(1 for line in text.splitlines() if line.startswith("ERROR") or "Traceback" in line)
    cache = (h.get("kv_pages_cached", 0) - warm_cached) * page_bytes(text) / 2**20
    grew = (end_rss - warm_rss) / 1024 - cache
    lines += ["", f"RSS: {start_rss / 1024:.0f} MiB at start, {warm_rss / 1024:.0f} MiB after "
              f"{WARM_UP} requests, {end_rss / 1024:.0f} MiB at the end (growth after the "
              f"warm-up: {(end_rss - warm_rss) / 1024:+.1f} MiB, of which the prefix cache's "
              f"pages written meanwhile {cache:+.1f} MiB: {grew:+.1f} MiB else)"
              + ("" if judged else f"; not judged: fewer than {WARM_UP} requests"),
              f"KV pages free: {pages0} before, {h['kv_pages_free']} after",
              f"server log: {errors} ERROR or Traceback lines"]
    grew = grew if judged else 0.0
    ok = (not bad and not served500 and not errors and grew <= MAX_RSS_GROWTH_MIB
          and h["kv_pages_free"] == pages0)
    why = [*bad, *(["500s"] if served500 else []), *([f"{errors} errors logged"] if errors else []),
           *([f"RSS grew {grew:.0f} MiB"] if grew > MAX_RSS_GROWTH_MIB else []),
           *([f"pages {h['kv_pages_free']}/{pages0}"] if h["kv_pages_free"] != pages0 else [])]
    lines.append("result: PASS" if ok else f"result: FAIL ({'; '.join(why)})")
    text = "\n".join(lines)
    print(text)
    if a.report:
        write_report("soak", "bench.soak", text, argv=argv)
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
