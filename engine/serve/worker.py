"""The engine loop: one asyncio task owns the scheduler. Handlers only queue submissions and
aborts for it; it applies them between steps and runs each step on its own worker thread, so the
event loop keeps serving while a step runs, and tokens go to per-request asyncio queues."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import Request

from engine.dist import PeerLost
from engine.llm import LLM
from engine.request import Request as EngineRequest
from engine.serve.metrics import Metrics

log = logging.getLogger("engine.serve")
DISCONNECT_POLL_S = 0.25  # how often a waiting handler checks that its client is still there


class ClientGone(Exception):
    """The client closed the connection while its request was in flight."""


@dataclass
class Handle:
    """One HTTP request's link to the engine. `queue` receives ("tokens", new_ids,
    finish_reason | None, text_end) items, or ("error", msg)."""

    req: EngineRequest
    queue: asyncio.Queue[tuple[Any, ...]] = field(default_factory=asyncio.Queue)
    closed: bool = False
    _checked: float = 0.0

    async def next(self, http: Request) -> tuple[Any, ...]:
        """The next item; raises ClientGone if `http`'s client disconnects."""
        while True:
            # Checked on a clock, not only when idle: tokens may arrive faster than the poll.
            now = time.monotonic()
            if now - self._checked >= DISCONNECT_POLL_S:
                self._checked = now
                if await http.is_disconnected():
                    raise ClientGone()
            with contextlib.suppress(TimeoutError):
                return await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S)


class Engine:
    """`running` is the app's lifespan; handlers `submit` and `post` aborts."""

    def __init__(self, llm: LLM, threads: int | None = None):
        self.llm, self.sched = llm, llm.scheduler
        self.threads = threads or torch.get_num_threads()  # the step thread's torch threads
        self.metrics = Metrics(self.sched.step_span)
        self.fatal: str | None = None  # why the engine stopped for good (tensor parallelism)
        self.snapshot: dict[str, int] = {}  # NOTE: replaced whole, never half-updated
        self._todo: list[tuple[str, Handle]] = []
        self._live: dict[int, Handle] = {}
        self._wake = asyncio.Event()
        self._seen: dict[str, float] = {}  # counters' values at the last publish
        self._publish()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Step graphs captured on the step thread, then the engine loop; leaving fails the rest."""
        with ThreadPoolExecutor(1, "engine", torch.set_num_threads, (self.threads,)) as thread:
            await asyncio.get_running_loop().run_in_executor(
                thread, functools.partial(self.llm.runner.capture, lagging=True))
            task = asyncio.get_running_loop().create_task(self._run(thread))
            try:
                yield
            finally:
                self.post("stop", None)
                await task

    def submit(self, h: Handle) -> None:
        """Queues `h`'s request; raises RequestRejected at once when it can never run."""
        self.sched.check(h.req)  # NOTE: reads fixed limits only, so it may run beside a step
        self.post("add", h)

    def post(self, kind: str, h: Handle | None) -> None:
        """`abort` a request, or `stop`, when the engine is next between steps."""
        self._todo.append((kind, h))  # type: ignore[arg-type]
        self._wake.set()

    async def _run(self, thread: ThreadPoolExecutor) -> None:
        # NOTE: one thread for every step, so the scheduler and the models only ever run there
        # or here, never both at once (this task awaits each step before touching them again).
        loop = asyncio.get_running_loop()
        while True:
            if not self._todo and not self.sched.has_work:
                await self._wake.wait()
            self._wake.clear()
            todo, self._todo = self._todo, []
            for kind, h in todo:
                if kind == "stop":
                    return self._fail_all("the server is shutting down")
                self._command(kind, h)
            if self.sched.has_work:
                try:
                    t0 = time.perf_counter()
                    events = await loop.run_in_executor(thread, self.sched.step)
                    self._stepped(events, time.perf_counter() - t0)
                except Exception as e:  # noqa: BLE001 - the engine outlives any one failure
                    log.exception("engine step failed; failing every in-flight request")
                    self._fail_all(f"engine error: {type(e).__name__}: {e}")
                    if isinstance(e, PeerLost):
                        # NOTE: a tensor-parallel peer is gone and no later step can run:
                        # stop the server (main exits non-zero).
                        self.fatal = str(e)
                        os.kill(os.getpid(), signal.SIGTERM)
                        return
            else:  # a step publishes itself
                self._publish()

    def _command(self, kind: str, h: Handle) -> None:
        if kind == "add":
            self.sched.add(h.req)
            self._live[h.req.rid] = h
            self.metrics.prompt_tokens.inc(len(h.req.prompt_ids))
        elif self._live.pop(h.req.rid, None) is not None:  # an abort of a running request
            self.sched.abort(h.req)
            self.metrics.finished.labels("abort").inc()

    def _stepped(self, events: list[Any], seconds: float) -> None:
        m = self.metrics
        m.step_seconds.inc(seconds)
        m.steps.inc()
        # Publish before handing out tokens: a client that saw its request finish must then
        # see its pages free in /health.
        self._publish()
        for ev in events:
            h, req = self._live.get(ev.req.rid), ev.req
            if h is None:
                continue
            if ev.emitted:
                m.accepted.observe(ev.emitted)
            m.generated.inc(len(ev.new_ids))
            reason = req.finish_reason if ev.finished else None
            if ev.finished:
                del self._live[req.rid]
                m.finished.labels(reason or "stop").inc()
            if ev.new_ids or ev.finished:
                h.queue.put_nowait(("tokens", list(ev.new_ids), reason, req.text_end))

    def _fail_all(self, message: str) -> None:
        # NOTE: a request a failed step held may be in neither queue: abort each one by name.
        for req in [*(h.req for h in self._live.values()), *self.sched.running,
                    *self.sched.waiting]:
            with contextlib.suppress(Exception):
                self.sched.abort(req)
        for h in self._live.values():
            h.queue.put_nowait(("error", message))
        self._live.clear()
        self._publish()

    def _publish(self) -> None:
        s, m = self.sched, self.metrics
        self.snapshot = {"running": len(s.running), "waiting": len(s.waiting),
                         "kv_pages_free": s.alloc.num_free, "kv_pages_total": s.alloc.capacity,
                         "preemptions": s.num_preemptions}
        for k in ("running", "kv_pages_free", "kv_pages_total"):
            getattr(m, k).set(self.snapshot[k])
        now = {"preemptions": s.num_preemptions, **self.llm.timer.totals}
        for k, v in now.items():  # counters move by what changed since the last publish
            (m.preemptions if k == "preemptions" else m.phase_seconds.labels(k)).inc(
                v - self._seen.get(k, 0))
        self._seen = now
