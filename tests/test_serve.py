"""The OpenAI-compatible server, end to end: real `python -m engine.serve` processes on localhost
with a tiny random model and drafter, driven by the official `openai` client and raw httpx."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from bench.common import server_metrics  # noqa: E402
from engine.config import SamplingParams  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.serve.worker import Engine, Handle, merge  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from tools.make_draft import make_draft  # noqa: E402
from tools.make_tiny import make_tiny  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MAX_LEN = 256
ORDINARY = 768  # tiny vocab 1024 = 768 ordinary tokens + 256 specials
# Eager steps: compiling every step at start (the CPU default) takes minutes.
COMMON = ["--mode", "tree", "--budget", "4", "--log-level", "warning", "--compile", "off"]


# ---- fixtures ----------------------------------------------------------------------------------


@dataclass
class ServerProc:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    initial_free: int

    def health(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def metrics(self) -> dict[str, float]:
        return server_metrics(self.url)

    def wait_idle(self, timeout: float = 30.0) -> dict[str, Any]:
        """Polls /health until nothing runs or waits and every page is free again."""
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if (h["kv_pages_free"] == self.initial_free and h["running"] == 0
                    and h["waiting"] == 0 and h["active"] == 0):
                return h
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout}s: {h} "
                                     f"(initial free pages {self.initial_free})")
            time.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(app: Any, timeout: float = 60, **options: Any) -> Iterator[str]:
    """`app` served by uvicorn from a thread of this process on a free loopback port; yields
    its base URL, and stops it after."""
    import threading

    import uvicorn

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", **options))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


def _start(ckpt: tuple[Path, Path], log: Path, *args: str) -> ServerProc:
    model, draft = ckpt
    port = _free_port()
    cmd = [sys.executable, "-m", "engine.serve", "--model", str(model), "--draft", str(draft),
           "--port", str(port), *COMMON, *args]
    # One intra-op thread: the tests share few cores and run several processes at once.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            h = httpx.get(f"{url}/health", timeout=2).json()
            return ServerProc(url, proc, log, h["kv_pages_free"])
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server did not come up:\n{log.read_text()}")
        time.sleep(0.2)


def _stop(s: ServerProc) -> None:
    s.proc.terminate()
    try:
        s.proc.wait(15)
    except subprocess.TimeoutExpired:
        s.proc.kill()
        s.proc.wait(5)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("serve")
    model = make_tiny(d / "tiny", dtype="fp32")
    draft = make_draft(model, d / "tiny-dflash", layers=1, block_size=8)
    return model, draft


@pytest.fixture(scope="module")
def server(ckpt: tuple[Path, Path]) -> Iterator[ServerProc]:
    s = _start(ckpt, ckpt[0].parent / "server.log", "--max-batch-size", "8",
               "--max-model-len", str(MAX_LEN))
    yield s
    _stop(s)


@pytest.fixture(scope="module")
def small_server(ckpt: tuple[Path, Path]) -> Iterator[ServerProc]:
    """Two batch slots, 12 usable KV pages (two long requests do not fit at once), two queue
    places."""
    s = _start(ckpt, ckpt[0].parent / "small.log", "--max-batch-size", "2", "--kv-pages", "13",
               "--max-model-len", "128", "--max-queue", "2", "--served-model-name", "small")
    yield s
    _stop(s)


@pytest.fixture(scope="module")
def tight_server(ckpt: tuple[Path, Path]) -> Iterator[ServerProc]:
    """Eight batch slots over a KV pool for about two requests (14 usable pages, 7 each), and
    prompts prefilled 16 tokens an engine step."""
    s = _start(ckpt, ckpt[0].parent / "tight.log", "--max-batch-size", "8", "--kv-pages", "15",
               "--max-model-len", "128", "--prefill-chunk", "16")
    yield s
    _stop(s)


@pytest.fixture(scope="module")
def client(server: ServerProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(ckpt: tuple[Path, Path]) -> Tokenizer:
    return Tokenizer.from_dir(ckpt[0])


@pytest.fixture(scope="module")
def offline_llm(ckpt: tuple[Path, Path]) -> LLM:
    # conftest.py keeps this process at one intra-op thread, like the servers (OMP_NUM_THREADS).
    return LLM(ckpt[0], ckpt[1], mode="tree", budget=4, max_batch_size=8,
               max_model_len=MAX_LEN, progress=False)


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(ORDINARY) for _ in range(n)]


# ---- helpers over raw HTTP ---------------------------------------------------------------------


def _sse_events(lines: list[str]) -> list[Any]:
    out: list[Any] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _collect_stream(events: list[Any], chat: bool) -> tuple[str, str | None, dict | None]:
    """(text, finish_reason, usage) from a list of parsed SSE events."""
    assert events and events[-1] == "[DONE]"
    text, reason, usage = "", None, None
    for ev in events[:-1]:
        assert "error" not in ev, ev
        if ev.get("usage"):
            usage = ev["usage"]
        for ch in ev["choices"]:
            text += (ch["delta"].get("content") or "") if chat else ch["text"]
            reason = ch["finish_reason"] or reason
    return text, reason, usage


async def _ask(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[str, str]:
    """One request (streamed or not) -> (text, finish_reason)."""
    chat = "messages" in body
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if not body.get("stream"):
        r = await http.post(url + path, json=body)
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        return (ch["message"]["content"] if chat else ch["text"]), ch["finish_reason"]
    async with http.stream("POST", url + path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        lines = [line async for line in r.aiter_lines()]
    text, reason, _ = _collect_stream(_sse_events(lines), chat)
    assert reason is not None
    return text, reason


def _ok_after(server: ServerProc) -> None:
    r = httpx.post(f"{server.url}/v1/completions", timeout=30,
                   json={"prompt": "still alive", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


# ---- basics ------------------------------------------------------------------------------------


def test_models_health_metrics(server: ServerProc, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    h = server.health()
    assert h["status"] == "ok" and h["max_model_len"] == MAX_LEN
    assert h["kv_pages_free"] == h["kv_pages_total"] > 0
    client.completions.create(model="tiny", prompt="metrics", max_tokens=4, temperature=0)
    m = server.metrics()
    for name in ("kimi_prompt_tokens_total", "kimi_generation_tokens_total",
                 "kimi_queue_depth", "kimi_running_requests", "kimi_kv_pages_free",
                 "kimi_accepted_tokens_per_step_count", 'kimi_step_phase_seconds_total{'
                 'phase="verify"}', 'kimi_requests_total{handler="/v1/completions",'
                 'status="200"}'):
        assert name in m, name
    assert m["kimi_generation_tokens_total"] >= 1
    assert m["kimi_accepted_tokens_per_step_count"] >= 1
    assert m["kimi_kv_pages_free"] == server.initial_free


def test_server_matches_offline(server: ServerProc, client: openai.OpenAI,
                                offline_llm: LLM) -> None:
    prompts: list[Any] = ["The quick brown fox", _ids(1, 40)]
    msgs = [{"role": "user", "content": "Say something."}]
    sp = SamplingParams(max_new_tokens=16)
    offline = [offline_llm.generate([p], sp)[0] for p in prompts]
    off_chat = offline_llm.generate([{"messages": msgs}], sp)[0]
    for p, off in zip(prompts, offline):
        r = client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0)
        assert r.choices[0].text == off.text
        assert r.choices[0].finish_reason == off.finish_reason
        assert r.usage.prompt_tokens == len(off.prompt_token_ids)
        assert r.usage.completion_tokens == len(off.token_ids)
    off = off_chat
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == off.text
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(off.prompt_token_ids)
    # seeded sampling too: a request's coins are its seed's wherever it runs
    seeded = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.9, seed=11,
                            ignore_eos=True)
    off = offline_llm.generate([prompts[1]], seeded)[0]
    r = client.completions.create(model="tiny", prompt=prompts[1], max_tokens=16,
                                  temperature=0.9, top_p=0.9, seed=11,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == off.text and r.usage.completion_tokens == 16


def test_echoed_prompt_logprobs_cross_to_the_http_process(server: ServerProc) -> None:
    """The prompt's log-probabilities, computed in the engine's process, reach the echoed
    answer in the HTTP process, whole and streamed (once, with the first tokens)."""
    body = {"prompt": _ids(5, 6), "max_tokens": 3, "temperature": 0, "echo": True,
            "logprobs": 1, "ignore_eos": True}
    lp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()[
        "choices"][0]["logprobs"]["token_logprobs"]
    assert len(lp) == 6 + 3 and lp[0] is None and None not in lp[1:]
    streamed: list[Any] = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])["choices"][0]
                streamed += (ch["logprobs"] or {}).get("token_logprobs") or []
    assert streamed == lp


def _collect(stream: Any, piece: Callable[[Any], str]) -> tuple[str, str | None, Any]:
    """Text (each choice's `piece`), last finish reason and usage of a streamed response."""
    text, reason, usage = "", None, None
    for ev in stream:
        if ev.usage is not None:
            usage = ev.usage
        for ch in ev.choices:
            text += piece(ch)
            reason = ch.finish_reason or reason
    return text, reason, usage


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.9,
                                                           "seed": 7}], ids=["greedy", "seeded"])
def test_stream_equals_nonstream(client: openai.OpenAI, tokenizer: Tokenizer, chat: bool,
                                 sampling: dict[str, Any]) -> None:
    extra = {"extra_body": {"top_k": 50, "ignore_eos": True}} if "seed" in sampling else {}
    if chat:
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
        full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=20,
                                              **sampling, **extra)
        stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=20,
                                                stream=True,
                                                stream_options={"include_usage": True},
                                                **sampling, **extra)
        text, reason, usage = _collect(stream, lambda ch: ch.delta.content or "")
        assert text == full.choices[0].message.content
        assert len(tokenizer.apply_chat_template(msgs)) == full.usage.prompt_tokens
    else:
        full = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=20,
                                         **sampling, **extra)
        stream = client.completions.create(model="tiny", prompt="Once upon a time",
                                           max_tokens=20, stream=True,
                                           stream_options={"include_usage": True},
                                           **sampling, **extra)
        text, reason, usage = _collect(stream, lambda ch: ch.text)
        assert text == full.choices[0].text
    assert reason == full.choices[0].finish_reason
    # the same usage, but the streamed request hit the pages the whole one cached
    cached = usage.prompt_tokens_details.cached_tokens if usage else None
    assert cached is not None and cached >= full.usage.prompt_tokens_details.cached_tokens
    assert usage.model_dump(exclude={"prompt_tokens_details"}) == full.usage.model_dump(
        exclude={"prompt_tokens_details"})
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def _ascii_window(text: str, width: int) -> str:
    for i in range(2, len(text) - width):
        w = text[i:i + width]
        if all(c.isascii() and c.isprintable() for c in w):
            return w
    raise AssertionError(f"no ascii window in {text!r}")


def test_stop_strings_cut_text(server: ServerProc, client: openai.OpenAI) -> None:
    prompt = _ids(3, 12)
    base = client.completions.create(model="tiny", prompt=prompt, max_tokens=32, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = _ascii_window(base, 3)
    want = base[: base.find(stop)]
    # The long second stop string makes the stream hold back 11 characters at a time.
    stops = [stop, "~~~~~~~~~~~~"]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=32, temperature=0,
                                  stop=stops, extra_body={"ignore_eos": True})
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=32, temperature=0, stop=stops, stream=True,
        extra_body={"ignore_eos": True}) if c.choices]
    assert "".join(pieces) == want
    assert all(stop not in p for p in pieces)
    server.wait_idle()


# ---- load --------------------------------------------------------------------------------------


def test_concurrent_load(server: ServerProc) -> None:
    """64 concurrent requests, mixed lengths, greedy and seeded sampling, streamed or not: each
    answer equals the same request's answer when it ran alone, and every page comes back."""
    lengths = [1, 5, 17, 33, 64, 100, 150, 230]
    jobs: list[dict[str, Any]] = []
    for i, n in enumerate(lengths):
        greedy = {"prompt": _ids(100 + i, n), "max_tokens": 8 + i, "temperature": 0}
        sampled = {"prompt": _ids(200 + i, n), "max_tokens": 16 - i, "temperature": 1.0,
                   "top_k": 40, "seed": 1000 + i, "ignore_eos": True}
        jobs += [greedy, sampled]

    async def run() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        limits = httpx.Limits(max_connections=80, max_keepalive_connections=80)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            alone = [await _ask(http, server.url, j) for j in jobs]
            batch = [dict(j, stream=k % 2 == 1) for j in jobs for k in range(4)]
            random.Random(0).shuffle(batch)
            got = await asyncio.gather(*[_ask(http, server.url, b) for b in batch])
            # map back: identical bodies (minus stream) must give the alone answer
            results = []
            for b, g in zip(batch, got):
                j = jobs.index({k: v for k, v in b.items() if k != "stream"})
                results.append((alone[j], g))
            return alone, results

    alone, results = asyncio.run(run())
    assert len(results) == 64
    for want, got in results:
        assert got == want
    assert any(r == "length" for _, r in alone)
    server.wait_idle(timeout=10)


# ---- bad input ---------------------------------------------------------------------------------

BAD: list[tuple[str, str, Any, int, str | None]] = [
    # (name, endpoint, body (str: raw), status, param)
    ("malformed json", "completions", '{"prompt": "x",', 400, None),
    ("body not an object", "completions", "[1, 2]", 400, None),
    ("unknown field", "completions", {"prompt": "x", "max_tokenz": 3}, 400, "max_tokenz"),
    ("max_tokens str", "completions", {"prompt": "x", "max_tokens": "8"}, 400, "max_tokens"),
    ("max_tokens bool", "completions", {"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ("temperature str", "completions", {"prompt": "x", "temperature": "hot"}, 400,
     "temperature"),
    ("max_tokens negative", "completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("max_tokens zero", "completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens huge", "completions", {"prompt": "x", "max_tokens": 10**12}, 400, "max_tokens"),
    ("temperature negative", "completions", {"prompt": "x", "temperature": -0.5}, 400,
     "temperature"),
    ("top_p zero", "completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("top_p above one", "completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("top_k below -1", "completions", {"prompt": "x", "top_k": -2}, 400, "top_k"),
    ("seed too big", "completions", {"prompt": "x", "seed": 2**70}, 400, "seed"),
    ("n above 8", "completions", {"prompt": "x", "n": 9}, 400, "n"),
    ("stop not strings", "completions", {"prompt": "x", "stop": [1]}, 400, "stop"),
    ("stop empty string", "completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("stream_options without stream", "completions",
     {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("penalty", "completions", {"prompt": "x", "presence_penalty": 1.0}, 400,
     "presence_penalty"),
    ("prompt missing", "completions", {"max_tokens": 3}, 400, "prompt"),
    ("prompt empty", "completions", {"prompt": ""}, 400, "prompt"),
    ("prompt ids empty", "completions", {"prompt": []}, 400, "prompt"),
    ("two prompts", "completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("prompt wrong type", "completions", {"prompt": 5}, 400, "prompt"),
    ("prompt too long", "completions", {"prompt": _ids(9, MAX_LEN + 20)}, 400, "prompt"),
    ("token outside vocab", "completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("unknown model", "completions", {"prompt": "x", "model": "gpt-5"}, 404, "model"),
    ("messages missing", "chat/completions", {"max_tokens": 2}, 400, "messages"),
    ("messages empty", "chat/completions", {"messages": []}, 400, "messages"),
    ("messages not a list", "chat/completions", {"messages": "hi"}, 400, "messages"),
    ("bad role", "chat/completions", {"messages": [{"role": "bot", "content": "x"}]}, 400,
     "messages"),
    ("content missing", "chat/completions", {"messages": [{"role": "user"}]}, 400, "messages"),
    ("chat max_completion_tokens", "chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3}, 400,
     "max_completion_tokens"),
    ("chat unknown field", "chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "functions": []}, 400, "functions"),
    ("chat unknown model", "chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "model": "nope"}, 404, "model"),
]


def test_bad_inputs(server: ServerProc) -> None:
    long_text = "word " * (MAX_LEN + 50)
    cases = BAD + [("text prompt too long", "completions", {"prompt": long_text}, 400,
                    "prompt")]
    for name, ep, body, status, param in cases:
        url = f"{server.url}/v1/{ep}"
        if isinstance(body, str):
            r = httpx.post(url, content=body, headers={"content-type": "application/json"},
                           timeout=30)
        else:
            r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == status, (name, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, (name, err)
        assert err["param"] == param, (name, err)
        if param is not None:
            assert param in err["message"], (name, err)
        if name == "prompt too long":
            assert str(MAX_LEN + 20) in err["message"] and str(MAX_LEN) in err["message"]
        _ok_after(server)
    big = json.dumps({"prompt": "a" * (17 << 20)})
    r = httpx.post(f"{server.url}/v1/completions", content=big, timeout=60,
                   headers={"content-type": "application/json"})  # untyped bodies get 415
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    _ok_after(server)
    r = httpx.get(f"{server.url}/v1/nothing", timeout=10)
    assert r.status_code == 404 and "error" in r.json()
    # The openai client raises the matching exception types.
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny", prompt="x", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="missing", prompt="x")
    server.wait_idle(timeout=10)


# ---- disconnects, queue limit, preemption ------------------------------------------------------


def test_disconnects_free_pages(server: ServerProc) -> None:
    aborted0 = server.metrics().get('kimi_requests_finished_total{reason="abort"}', 0)

    async def leave(i: int, http: httpx.AsyncClient) -> None:
        if i % 2:
            path, body = "/v1/chat/completions", {
                "messages": [{"role": "user", "content": f"client {i}"}]}
        else:
            path, body = "/v1/completions", {"prompt": _ids(300 + i, 10 + i)}
        body.update(max_tokens=150, temperature=0, ignore_eos=True, stream=True)
        async with http.stream("POST", server.url + path, json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break  # one chunk, then hang up

    async def give_up(i: int) -> None:
        # A non-streaming client that stops waiting: the server notices by polling.
        async with httpx.AsyncClient(timeout=httpx.Timeout(60, read=0.3)) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post(server.url + "/v1/completions", json={
                    "prompt": _ids(350 + i, 8), "max_tokens": 240, "temperature": 0,
                    "ignore_eos": True})

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            await asyncio.gather(*[leave(i, http) for i in range(20)],
                                 *[give_up(i) for i in range(4)])

    asyncio.run(run())
    server.wait_idle(timeout=30)
    aborted = server.metrics()['kimi_requests_finished_total{reason="abort"}'] - aborted0
    assert aborted == 24
    _ok_after(server)


def test_queue_full_gives_503(small_server: ServerProc) -> None:
    async def one(i: int, http: httpx.AsyncClient) -> httpx.Response:
        return await http.post(small_server.url + "/v1/completions", json={
            "prompt": _ids(400 + i, 8), "max_tokens": 40, "temperature": 0, "ignore_eos": True})

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*[one(i, http) for i in range(10)])

    rs = asyncio.run(run())
    busy = [r for r in rs if r.status_code == 503]
    assert busy, [r.status_code for r in rs]
    for r in busy:
        assert r.headers.get("retry-after") == "1"
        assert r.json()["error"]["code"] == "queue_full"
    assert all(r.status_code == 200 for r in rs if r.status_code != 503)
    small_server.wait_idle(timeout=30)
    _ok_after(small_server)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_preemption_keeps_the_output(small_server: ServerProc, temperature: float) -> None:
    """Two long requests cannot both hold their pages (12 usable pages, up to 8 each): the newer
    is preempted and recomputed, and both still give their stand-alone answers, greedy or
    seeded (a position's token is drawn with that position's coin, whatever the batch)."""
    bodies = [{"prompt": _ids(500 + i, 20), "max_tokens": 100, "temperature": temperature,
               "seed": 40 + i, "ignore_eos": True} for i in range(2)]

    async def run() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        async with httpx.AsyncClient(timeout=120) as http:
            alone = [await _ask(http, small_server.url, b) for b in bodies]
            before = small_server.health()["preemptions"]
            together = await asyncio.gather(
                *[_ask(http, small_server.url, dict(b, stream=i == 1))
                  for i, b in enumerate(bodies)])
            assert small_server.health()["preemptions"] > before
            return alone, list(together)

    alone, together = asyncio.run(run())
    assert together == alone
    assert all(r == "length" for _, r in alone)
    small_server.wait_idle(timeout=30)


def test_eight_requests_through_a_pool_for_two(tight_server: ServerProc) -> None:
    """Eight concurrent requests whose prompts are prefilled in chunks (64 tokens, 16 a step)
    while a pool that holds about two of them queues and preempts the rest: every one
    completes with its answer alone, greedy or seeded, streamed or not."""
    bodies = [{"prompt": _ids(700 + i, 64), "max_tokens": 32, "seed": 60 + i,
               "temperature": 0.0 if i % 2 else 0.8, "ignore_eos": True} for i in range(8)]

    async def run() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        async with httpx.AsyncClient(timeout=120) as http:
            alone = [await _ask(http, tight_server.url, b) for b in bodies]
            together = await asyncio.gather(
                *[_ask(http, tight_server.url, dict(b, stream=i % 3 == 0))
                  for i, b in enumerate(bodies)])
            return alone, list(together)

    alone, together = asyncio.run(run())
    assert together == alone
    assert all(r == "length" for _, r in together)
    tight_server.wait_idle(timeout=30)
    _ok_after(tight_server)


# ---- the engine thread on its own --------------------------------------------------------------


def test_engine_survives_a_failing_step(offline_llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that raises fails the requests in flight with an error item, frees their pages,
    and the engine thread goes on serving."""
    sched = offline_llm.scheduler
    real_step = sched.step
    calls = {"n": 0}

    def flaky_step() -> list[Any]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected failure")
        return real_step()

    monkeypatch.setattr(sched, "step", flaky_step)
    free0 = sched.cache.available

    async def ask(engine: Engine, prompt: list[int]) -> list[tuple[Any, ...]]:
        req = offline_llm.make_request(prompt, SamplingParams(max_new_tokens=4))
        h = Handle(req)
        engine.submit(h)
        items = []
        while not items or (items[-1][0] == "tokens" and items[-1][2] is None):
            items.append(await asyncio.wait_for(h.queue.get(), timeout=60))
        return items

    async def run() -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
        engine = Engine(offline_llm)
        async with engine.running():
            return await ask(engine, _ids(7, 5)), await ask(engine, _ids(8, 5))

    failed, ok = asyncio.run(run())
    # the cause stays in the server's log, out of the client's answer
    assert failed[-1][0] == "error" and "injected failure" not in failed[-1][1]
    assert "could not be attributed" in failed[-1][1]
    assert ok[-1][0] == "tokens" and ok[-1][2] == "length"
    assert sum(len(i[1]) for i in ok) == 4
    assert sched.cache.available == free0 and not sched.has_work


def test_engine_thread_hands_out_tokens_per_step_or_whole(offline_llm: LLM) -> None:
    """The step thread runs the requests it is handed back to back; a streamed request gets its
    tokens as steps make them, a whole answer one item with all of them, both the offline
    engine's tokens; an abort between steps ends a request there and frees its pages."""
    sp = SamplingParams(max_new_tokens=12)
    prompt = _ids(9, 6)
    want = offline_llm.generate([prompt], sp)[0].token_ids
    sched = offline_llm.scheduler
    free0 = sched.cache.available

    async def collect(h: Handle) -> list[tuple[Any, ...]]:
        items = []
        while not items or (items[-1][0] == "tokens" and items[-1][2] is None):
            items.append(await asyncio.wait_for(h.queue.get(), timeout=60))
        return items

    async def run() -> tuple[list[Any], list[Any], list[Any]]:
        engine = Engine(offline_llm)
        async with engine.running():
            hs = [Handle(offline_llm.make_request(prompt, sp), stream=s) for s in (True, False)]
            for h in hs:
                engine.submit(h)
            streamed, whole = await asyncio.gather(*map(collect, hs))
            long = Handle(offline_llm.make_request(prompt, SamplingParams(max_new_tokens=240)))
            engine.submit(long)
            first = await asyncio.wait_for(long.queue.get(), timeout=60)
            engine.post("abort", long)
            while engine.snapshot["running"]:  # until the abort is applied
                await asyncio.sleep(0.01)
            rest = [long.queue.get_nowait() for _ in range(long.queue.qsize())]
            return streamed, whole, [first, *rest]

    streamed, whole, aborted = asyncio.run(run())
    assert len(streamed) > 1 and [t for i in streamed for t in i[1]] == want
    assert len(whole) == 1 and whole[0][1] == want and whole[0][2] == "length"
    assert all(i[0] == "tokens" and i[2] is None for i in aborted)  # it never finished
    assert sum(len(i[1]) for i in aborted) < 240
    assert sched.cache.available == free0 and not sched.has_work


def test_a_slow_reader_gets_the_queued_steps_merged() -> None:
    """A handler that falls behind the engine takes every tokens item queued so far as one
    (ids, log-probabilities and text in order); an error behind them comes next, apart."""

    class Http:
        async def is_disconnected(self) -> bool:
            return False

    def item(ids: list[int], reason: str | None = None) -> tuple[Any, ...]:
        return ("tokens", ids, reason, None, None, [str(i) for i in ids], None, None)

    async def run() -> list[tuple[Any, ...]]:
        h = Handle(None)  # type: ignore[arg-type]
        for x in (item([1, 2]), item([3]), ("error", "boom"), item([4], "stop")):
            h.queue.put_nowait(x)
        return [await h.next(Http()) for _ in range(3)]  # type: ignore[arg-type]

    merged_, error, last = asyncio.run(run())
    assert merged_ == ("tokens", [1, 2, 3], None, None, None, ["1", "2", "3"], None, None)
    assert error == ("error", "boom") and last == item([4], "stop")
    lp = merge([("tokens", [1], None, None, ["a"], ["x"], ["p"], 32),
                ("tokens", [2], "stop", 5, ["b"], ["y"], None, None)])
    assert lp == ("tokens", [1, 2], "stop", 5, ["a", "b"], ["x", "y"], ["p"], 32)


def test_the_engine_leaves_cores_to_the_http_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU the engine's torch threads leave `--reserve-cpus` cores to the HTTP process,
    never fewer than one thread; on CUDA, or with 0, it keeps what it was given."""
    from engine.config import EngineConfig
    from engine.serve.options import ServeConfig
    from engine.serve.procs import engine_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(8)), raising=False)
    cpu = EngineConfig(device="cpu")
    assert engine_threads(cpu, ServeConfig(), 8) == 7
    assert engine_threads(cpu, ServeConfig(reserve_cpus=3), 8) == 5
    assert engine_threads(cpu, ServeConfig(reserve_cpus=3), 2) == 2  # already few enough
    assert engine_threads(cpu, ServeConfig(reserve_cpus=8), 8) == 1
    assert engine_threads(cpu, ServeConfig(reserve_cpus=0), 8) == 8
    monkeypatch.setattr("engine.llm.resolve_device", lambda _: (torch.device("cuda"), None))
    assert engine_threads(EngineConfig(device="cuda"), ServeConfig(), 8) == 8


def _frontend(pid: int) -> int:
    """The HTTP process a server's engine process `pid` spawned."""
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    (front,) = [int(k) for k in kids if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]
    return front


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc (Linux)")
def test_engine_and_http_processes_stop_together(ckpt: tuple[Path, Path], tmp_path: Path
                                                  ) -> None:
    """`python -m engine.serve` is two processes: the engine's and, its child, the HTTP
    frontend, which never loads torch. A SIGTERM to the engine's lets a stream in flight end
    whole, then both exit 0; a frontend that dies takes the engine down with an error."""
    s = _start(ckpt, tmp_path / "stop.log", "--max-model-len", "128")
    try:
        front = _frontend(s.proc.pid)
        assert "libtorch" not in Path(f"/proc/{front}/maps").read_text()
        body = {"prompt": _ids(3, 5), "max_tokens": 100, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=30) as r:
            it = r.iter_lines()
            lines = [next(it)]
            s.proc.send_signal(signal.SIGTERM)
            lines += [x for x in it if x]
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert lines[-1] == "data: [DONE]" and events[-1]["choices"][0]["finish_reason"] == "length"
        assert s.proc.wait(30) == 0
        assert not Path(f"/proc/{front}").exists()
    finally:
        _stop(s)
    s = _start(ckpt, tmp_path / "lost.log", "--max-model-len", "128")
    try:
        front = _frontend(s.proc.pid)
        os.kill(front, signal.SIGKILL)
        assert s.proc.wait(30) != 0
        assert "the HTTP server exited" in s.log.read_text()
    finally:
        _stop(s)


# ---- tools and template kwargs -----------------------------------------------------------------


def test_tool_fields_reach_a_real_server(server: ServerProc, client: openai.OpenAI,
                                         tokenizer: Tokenizer) -> None:
    """`tools`, `tool_choice`, `chat_template_kwargs` and a tool-call conversation go through a
    real server process to the checkpoint's template; an answer without tool-call markers is the
    plain answer (tests/test_serve_tools.py scripts answers that have them)."""
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "get_weather",
                                               "parameters": {"type": "object"}}}]
    kw: dict[str, Any] = {"model": "tiny", "max_tokens": 12, "temperature": 0}
    plain = client.chat.completions.create(messages=msgs, **kw)
    r = client.chat.completions.create(messages=msgs, tools=tools, tool_choice="auto",
                                       extra_body={"chat_template_kwargs": {"thinking": False}},
                                       **kw)
    assert r.choices[0].message.content == plain.choices[0].message.content
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == plain.choices[0].finish_reason
    assert r.usage.prompt_tokens == len(tokenizer.apply_chat_template(msgs, tools=tools,
                                                                      thinking=False))
    history = [*msgs, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "functions.get_weather:0", "type": "function",
        "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"}]
    r = client.chat.completions.create(messages=history, tools=tools, **kw)
    assert r.usage.prompt_tokens == len(tokenizer.apply_chat_template(history, tools=tools))
    server.wait_idle()
