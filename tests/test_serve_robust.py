"""No single request can break the server: fault isolation in the engine, bounded work before
the expensive parts, disconnects as aborts, timeouts, and the API key / Host / Content-Type
guard. A real `python -m engine.serve` (tiny model, `--api-key`, a 1 s `--request-timeout`) on
localhost, an in-process app whose runner is made to fail for one request, and the scheduler
with a fake runner. Every loop is bounded in count and time; only 127.0.0.1 is contacted."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.datastructures import Headers

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from engine.config import SamplingParams  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.serve import ServeConfig  # noqa: E402
from engine.serve.app import Guard, allowed_hosts, build_app, uvicorn_options  # noqa: E402
from engine.serve.worker import BLAMED, UNATTRIBUTED  # noqa: E402
from tests.test_scheduler import FakeRunner, req, scheduler  # noqa: E402
from tests.test_serve import (  # noqa: E402
    MAX_LEN,
    ServerProc,
    _collect_stream,
    _ids,
    _sse_events,
    _start,
    _stop,
    serving,
)
from tools.make_draft import make_draft  # noqa: E402
from tools.make_tiny import make_tiny  # noqa: E402

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
TIMEOUT_S = 1.0  # the guarded server's --request-timeout (and --timeout-keep-alive)
CONNECTIONS = 16  # its --limit-concurrency
POISON = 666  # the seed of the request whose steps fail in the in-process server


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("robust")
    model = make_tiny(d / "tiny", dtype="fp32")
    return model, make_draft(model, d / "tiny-dflash", layers=1, block_size=8)


# ---- the scheduler on its own ------------------------------------------------------------------


class PoisonRunner(FakeRunner):
    """Fails any call holding a row whose seed is POISON (steps only, or prefills too)."""

    def __init__(self, prefill_too: bool = False, everyone: bool = False):
        super().__init__()
        self.prefill_too, self.everyone = prefill_too, everyone

    def _check(self, params: list[Any]) -> None:
        if self.everyone or any(p is not None and p.seed == POISON for p in params):
            raise OverflowError("Overflow when unpacking long long")

    def prefill(self, inps: list[Any]) -> list[int | None]:
        if self.prefill_too:
            self._check([i.params for i in inps])
        return super().prefill(inps)

    def step(self, inp: Any, pad: bool = False) -> Any:
        self._check(inp.params)
        return super().step(inp, pad)


@pytest.mark.parametrize("prefill_too", [False, True])
def test_the_scheduler_fails_only_the_row_that_fails(prefill_too: bool) -> None:
    r = PoisonRunner(prefill_too)
    s = scheduler(r)
    s.isolate = True
    free = s.cache.available
    good = [req(i, [1, 2, 3 + i], max_new_tokens=7) for i in range(3)]
    bad = req(9, [5, 6], max_new_tokens=7, seed=POISON)
    for x in (good[0], bad, *good[1:]):
        s.add(x)
    events = []
    for _ in range(50):
        if not s.has_work:
            break
        events += s.step()
    assert [x.output_ids for x in good] == [[4 + i + j for j in range(7)] for i in range(3)]
    assert all(x.finish_reason == "length" for x in good)
    assert bad.finish_reason == "error" and not bad.pages
    (err,) = [e for e in events if e.error is not None]
    assert err.req is bad and err.blamed and isinstance(err.error, OverflowError)
    assert s.cache.available == free and not s.has_work


def test_the_scheduler_blames_no_one_when_every_row_fails() -> None:
    s = scheduler(PoisonRunner(everyone=True))
    s.isolate = True
    xs = [req(i, [1, 2, 3], max_new_tokens=20) for i in range(2)]
    for x in xs:
        s.add(x)
    s.runner.everyone = False
    events = s.step()  # the prefill runs
    s.runner.everyone = True
    events = s.step()
    assert all(e.error is not None and not e.blamed for e in events) and len(events) == 2
    assert not s.has_work and all(x.finish_reason == "error" for x in xs)
    # without isolation (the offline API) the error rises as before
    s2 = scheduler(PoisonRunner(everyone=True))
    s2.add(req(0, [1, 2], max_new_tokens=4))
    with pytest.raises(OverflowError):
        s2.step()


# ---- an in-process server whose runner fails for one request -----------------------------------


@pytest.fixture(scope="module")
def inproc(ckpt: tuple[Path, Path]) -> Iterator[tuple[LLM, str]]:
    llm = LLM(ckpt[0], ckpt[1], mode="tree", budget=4, max_batch_size=8,
              max_model_len=MAX_LEN, progress=False)
    cfg = ServeConfig(request_timeout=5)
    with serving(build_app(llm, "tiny", config=cfg), **uvicorn_options(cfg)) as url:
        yield llm, url


def test_a_poison_request_fails_alone(inproc: tuple[LLM, str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A request whose steps raise (as a top_k past int64 once did) fails with a 500 that leaks
    no exception text; the streams running beside it end with their single-run output."""
    llm, url = inproc
    bodies = [{"prompt": _ids(700 + i, 6 + i), "max_tokens": 24, "temperature": 0,
               "ignore_eos": True, "stream": i < 7} for i in range(9)]  # seven streams

    async def one(http: httpx.AsyncClient, body: dict[str, Any]) -> tuple[int, Any]:
        if not body["stream"]:
            r = await http.post(url + "/v1/completions", json=body)
            return r.status_code, r.json()
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            lines = [line async for line in r.aiter_lines()]
        return r.status_code, _sse_events(lines)

    def text(status: int, out: Any, stream: bool) -> str:
        assert status == 200, out
        return _collect_stream(out, False)[0] if stream else out["choices"][0]["text"]

    async def run() -> tuple[list[str], list[tuple[int, Any]]]:
        async with httpx.AsyncClient(timeout=120) as http:
            alone = [text(*await one(http, b), b["stream"]) for b in bodies]
            real = llm.runner.step

            def step(inp: Any, pad: bool = False) -> Any:
                if any(p.seed == POISON for p in inp.params):
                    raise OverflowError("Overflow when unpacking long long")
                return real(inp, pad)

            monkeypatch.setattr(llm.runner, "step", step)
            poison = {"prompt": "x", "max_tokens": 4, "temperature": 0.8, "seed": POISON}
            together = await asyncio.gather(
                *[one(http, b) for b in bodies],
                *[one(http, dict(poison, stream=s)) for s in (False, True)])
            return alone, list(together)

    alone, together = asyncio.run(run())
    for b, want, got in zip(bodies, alone, together):
        assert text(*got, b["stream"]) == want
        assert not b["stream"] or got[1][-1] == "[DONE]"
    (s1, whole), (s2, streamed) = together[-2:]
    assert s1 == 500 and whole["error"]["type"] == "server_error"
    assert s2 == 200 and streamed[-1] == "[DONE]" and "error" in streamed[-2]
    for err in (whole["error"], streamed[-2]["error"]):
        assert "Overflow" not in err["message"]
        assert err["message"] in (BLAMED, UNATTRIBUTED)
    assert BLAMED in (whole["error"]["message"], streamed[-2]["error"]["message"])
    sched = llm.scheduler
    deadline = time.monotonic() + 30
    while sched.has_work and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not sched.has_work and sched.cache.available == sched.alloc.capacity


def test_the_key_can_come_from_the_environment(inproc: tuple[LLM, str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from starlette.testclient import TestClient

    monkeypatch.setenv("KIMI_API_KEY", "from-env")
    http = TestClient(build_app(inproc[0], "tiny"), base_url="http://127.0.0.1")
    assert http.get("/v1/models").status_code == 401
    assert http.get("/v1/models", headers={"Authorization": "Bearer from-env"}).status_code == 200
    assert http.get("/health").status_code == 200


def test_tiny_temperatures_are_greedy() -> None:
    assert SamplingParams(temperature=1e-300).greedy and SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=1e-4).greedy


def test_default_hosts_and_key(monkeypatch: pytest.MonkeyPatch) -> None:
    assert allowed_hosts(ServeConfig()) == {"localhost", "127.0.0.1", "::1"}
    assert allowed_hosts(ServeConfig(host="::1")) == {"localhost", "127.0.0.1", "::1"}
    assert allowed_hosts(ServeConfig(host="0.0.0.0")) is None
    assert allowed_hosts(ServeConfig(host="0.0.0.0", allowed_hosts="a.example, B.example")) == \
        {"a.example", "b.example"}
    assert allowed_hosts(ServeConfig(allowed_hosts="*")) is None
    guard = Guard(None, frozenset({"localhost"}), "k")  # type: ignore[arg-type]
    scope = {"type": "http", "method": "POST", "path": "/v1/completions"}

    def problem(**headers: str) -> int | None:
        raw = [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]
        got = guard._problem({**scope, "headers": raw}, Headers(raw=raw))
        return got and got[0]

    ok = {"host": "localhost:8000", "authorization": "Bearer k",
          "content_type": "application/json; charset=utf-8"}
    assert problem(**ok) is None
    assert problem(**{**ok, "host": "127.0.0.1.nip.io"}) == 400
    assert problem(**{**ok, "authorization": "Bearer x"}) == 401
    assert problem(**{**ok, "content_type": "application/x-www-form-urlencoded"}) == 415
    assert problem(host="localhost", authorization="Bearer k") == 415  # untyped


# ---- a real server with a key and a short request timeout --------------------------------------


@pytest.fixture(scope="module")
def guarded(ckpt: tuple[Path, Path]) -> Iterator[ServerProc]:
    s = _start(ckpt, ckpt[0].parent / "guarded.log", "--max-batch-size", "8", "--max-model-len",
               str(MAX_LEN), "--api-key", KEY, "--request-timeout", str(TIMEOUT_S),
               "--timeout-keep-alive", "1", "--limit-concurrency", str(CONNECTIONS),
               "--log-level", "info")
    yield s
    _stop(s)


def _post(s: ServerProc, body: dict[str, Any], path: str = "/v1/completions",
          **kw: Any) -> httpx.Response:
    return httpx.post(s.url + path, json=body, headers=kw.pop("headers", AUTH), timeout=60, **kw)


def _raw(s: ServerProc, data: bytes, wait: float = 10.0) -> tuple[float, bytes]:
    """Sends `data` on a fresh connection and reads until the server closes it (at most
    `wait` seconds): the seconds it took and what came back."""
    host, port = s.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as c:
        t0 = time.monotonic()
        c.sendall(data)
        out = b""
        try:
            while chunk := c.recv(65536):
                out += chunk
        except TimeoutError:
            pass
        return time.monotonic() - t0, out


def _status_counts(s: ServerProc) -> dict[str, float]:
    return {k: v for k, v in s.metrics().items() if k.startswith("kimi_requests_total")}


BAD_FIELDS = [
    ({"prompt": "x", "max_tokens": 4, "temperature": 0.8, "top_k": 2**63}, "top_k"),
    ({"prompt": "x", "max_tokens": 4, "temperature": 0.8, "top_k": 5000}, "top_k"),
    ({"prompt": "x", "temperature": 1e300}, "temperature"),
    ({"prompt": "x", "seed": 2**70}, "seed"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [3, 5000]}, "prompt"),
    ({"prompt": [3, -1]}, "prompt"),
    ({"prompt": "x", "max_tokens": 2**70}, "max_tokens"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
]


def test_every_field_is_checked_where_it_is_parsed(guarded: ServerProc) -> None:
    for body, param in BAD_FIELDS:
        r = _post(guarded, body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and param in err["message"], (body, err)
        assert "constrained-str" not in err["message"], err
    chat = {"messages": [{"role": "user", "content": "x"}] * 5000}
    r = _post(guarded, chat, "/v1/chat/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    # a tiny temperature is greedy (it used to give NUL characters)
    greedy = _post(guarded, {"prompt": "hello", "max_tokens": 8, "temperature": 0}).json()
    tiny = _post(guarded, {"prompt": "hello", "max_tokens": 8, "temperature": 1e-300}).json()
    assert tiny["choices"][0]["text"] == greedy["choices"][0]["text"]
    assert "\x00" not in tiny["choices"][0]["text"]
    assert not any('status="500"' in k for k in _status_counts(guarded))


def test_a_big_body_is_refused_before_the_expensive_part(guarded: ServerProc) -> None:
    """15 MB of tiny chat messages is refused from its bytes, before parsing it whole, and a
    4-token request beside it is not held up; a prompt whose bytes prove it too long is refused
    before tokenizing."""
    small = {"prompt": "hello", "max_tokens": 4, "temperature": 0}
    big = json.dumps({"messages": [{"role": "user", "content": "hi"}] * 449_000}).encode()
    assert len(big) > 15_000_000
    t0 = time.monotonic()
    assert _post(guarded, small).status_code == 200
    idle = time.monotonic() - t0

    async def run() -> tuple[httpx.Response, float, float]:
        async with httpx.AsyncClient(timeout=60, headers=AUTH) as http:
            async def timed(coro: Any) -> tuple[httpx.Response, float]:
                t = time.monotonic()
                return await coro, time.monotonic() - t
            big_task = asyncio.create_task(timed(http.post(
                guarded.url + "/v1/chat/completions", content=big,
                headers={"content-type": "application/json"})))
            await asyncio.sleep(0.2)
            (r, _), (rs, busy) = await asyncio.gather(
                big_task, timed(http.post(guarded.url + "/v1/completions", json=small)))
            assert rs.status_code == 200
            return r, busy, idle

    r, busy, idle = asyncio.run(run())
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    assert busy < idle + 3.0, (busy, idle)  # generous: timing on a shared machine
    text = "ab " * 2_000_000  # 6 MB: far more tokens than the context holds
    r = _post(guarded, {"prompt": text})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt" and "bytes of text" in err["message"]
    r = _post(guarded, {"messages": [{"role": "user", "content": text}]}, "/v1/chat/completions")
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages" and "bytes" in err["message"]


def test_disconnects_are_aborts(guarded: ServerProc) -> None:
    """A client that leaves at any point is an abort: counted 499 (or, mid-stream, 200),
    logged at INFO, every KV page back; never a 500 or an ERROR."""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}"
            f"\r\ncontent-type: application/json\r\n").encode()
    body = json.dumps({"prompt": _ids(800, 8), "max_tokens": 200, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    host, port = guarded.url.removeprefix("http://").split(":")
    before = _status_counts(guarded)  # NOTE: the module's server has served other tests

    def leave(data: bytes, after: float) -> None:
        with socket.create_connection((host, int(port)), timeout=10) as c:
            c.sendall(data)
            time.sleep(after)

    leave(head[:40], 0.1)  # in the headers
    leave(head + b"content-length: 500\r\n\r\n" + body[:20], 0.3)  # in the body
    leave(head + b"content-length: %d\r\n\r\n" % len(body) + body, 0.0)  # right after it
    leave(head + b"content-length: %d\r\n\r\n" % len(body) + body, 1.0)  # mid-stream

    async def give_up() -> None:  # a whole answer nobody waits for
        async with httpx.AsyncClient(timeout=httpx.Timeout(60, read=0.5), headers=AUTH) as h:
            with pytest.raises(httpx.ReadTimeout):
                await h.post(guarded.url + "/v1/completions", json={
                    "prompt": _ids(801, 8), "max_tokens": 240, "temperature": 0,
                    "ignore_eos": True})

    asyncio.run(give_up())
    guarded.wait_idle(timeout=30)
    counts = _status_counts(guarded)
    assert not any('status="500"' in k for k in counts), counts
    # NOTE: whether a client that leaves right after its body (or a second into its stream)
    # is still waiting (499) or already streaming (200) depends on the machine's speed; the
    # four that got past their headers are each counted once, and the one that left in its
    # body is always an abort
    left, streamed = (counts.get(k, 0) - before.get(k, 0) for k in (
        'kimi_requests_total{handler="/v1/completions",status="499"}',
        'kimi_requests_total{handler="/v1/completions",status="200"}'))
    assert left >= 1 and left + streamed == 4, counts
    log = guarded.log.read_text()
    assert "ERROR" not in log and "Traceback" not in log, log[-3000:]
    assert "the client left" in log


def test_slow_requests_get_408(guarded: ServerProc) -> None:
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}"
            f"\r\ncontent-type: application/json\r\ncontent-length: 100\r\n").encode()
    for data in (head[:30], head + b"\r\n" + b'{"prompt": "x"'):  # headers, then body, unfinished
        took, out = _raw(guarded, data)
        assert out.startswith(b"HTTP/1.1 408 "), out[:200]
        assert b"request_timeout" in out and b"--request-timeout" in out
        assert TIMEOUT_S - 0.1 < took < TIMEOUT_S + 5, took
    assert guarded.health()["active"] == 0


def test_idle_and_surplus_connections(guarded: ServerProc) -> None:
    host, port = guarded.url.removeprefix("http://").split(":")
    ask = (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    with socket.create_connection((host, int(port)), timeout=10) as c:  # kept alive, then idle
        c.sendall(ask)
        t0 = time.monotonic()
        out = b""
        while chunk := c.recv(65536):
            out += chunk
        assert out.startswith(b"HTTP/1.1 200") and time.monotonic() - t0 < TIMEOUT_S + 5
    held = [socket.create_connection((host, int(port)), timeout=10) for _ in range(CONNECTIONS)]
    try:
        time.sleep(0.2)
        r = httpx.get(guarded.url + "/health", timeout=10)
        assert r.status_code == 503
    finally:
        for c in held:
            c.close()
    deadline = time.monotonic() + 10
    while httpx.get(guarded.url + "/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_key_host_and_content_type(guarded: ServerProc) -> None:
    body = {"prompt": "x", "max_tokens": 2}
    assert _post(guarded, body, headers={}).status_code == 401
    r = _post(guarded, body, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert _post(guarded, body).status_code == 200
    assert httpx.get(guarded.url + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(guarded.url + "/health", timeout=10).status_code == 200
    assert httpx.get(guarded.url + "/metrics", timeout=10).status_code == 200
    r = httpx.post(guarded.url + "/v1/completions", content=json.dumps(body), timeout=10,
                   headers={**AUTH, "content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    r = httpx.post(guarded.url + "/v1/completions", json=body, timeout=10,
                   headers={**AUTH, "Host": "attacker.example"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
    r = httpx.post(guarded.url.replace("127.0.0.1", "localhost") + "/v1/completions", json=body,
                   timeout=10, headers=AUTH)
    assert r.status_code == 200


def test_a_short_mixed_soak(guarded: ServerProc) -> None:
    """60 requests of every kind, 8 at a time, some bad, some abandoned: no 500, every page
    back."""
    before = _status_counts(guarded)

    async def one(i: int, http: httpx.AsyncClient) -> int:
        kind = i % 6
        if kind == 0:
            r = await http.post(guarded.url + "/v1/completions", json={
                "prompt": _ids(900 + i, 5 + i % 7), "max_tokens": 12, "temperature": 0.7,
                "seed": i})
            return r.status_code
        if kind == 1:
            r = await http.post(guarded.url + "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 10})
            return r.status_code
        if kind == 2:
            async with http.stream("POST", guarded.url + "/v1/completions", json={
                    "prompt": "stream", "max_tokens": 10, "stream": True}) as r:
                lines = [line async for line in r.aiter_lines()]
            assert _sse_events(lines)[-1] == "[DONE]"
            return r.status_code
        if kind == 3:
            r = await http.post(guarded.url + "/v1/completions", json={
                "prompt": "x", "top_k": 2**64})
            return r.status_code
        if kind == 4:  # leaves after the first chunk
            async with http.stream("POST", guarded.url + "/v1/completions", json={
                    "prompt": "leave", "max_tokens": 100, "stream": True,
                    "ignore_eos": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break
            return r.status_code
        r = await http.post(guarded.url + "/v1/completions", json={
            "prompt": "x", "temperature": 1e-30, "max_tokens": 3})
        return r.status_code

    async def run() -> list[int]:
        gate = asyncio.Semaphore(8)
        async with httpx.AsyncClient(timeout=60, headers=AUTH) as http:
            async def gated(i: int) -> int:
                async with gate:
                    return await one(i, http)
            return await asyncio.wait_for(asyncio.gather(*[gated(i) for i in range(60)]), 300)

    statuses = asyncio.run(run())
    assert sorted(set(statuses)) == [200, 400], statuses
    guarded.wait_idle(timeout=30)
    after = _status_counts(guarded)
    assert not any('status="500"' in k for k in after), after
    assert after != before
