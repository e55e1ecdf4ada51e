"""The engine loop: one thread owns the scheduler and steps while there is work. Handlers on the
event loop only queue submissions and aborts for it, which it applies between steps; each step's
tokens come back to the loop in one call, into per-request asyncio queues."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import threading
import time
from collections import deque
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
# What a client whose request failed in the engine is told (the cause is in the server log).
BLAMED = ("the engine failed while running this request, and only this request: the others "
          "in its batch went on (the server log has the cause)")
UNATTRIBUTED = ("an engine step failed and the failure could not be attributed to one request, "
                "so every request of the step was failed (the server log has the cause)")


class ClientGone(Exception):
    """The client closed the connection while its request was in flight."""


@dataclass
class Handle:
    """One HTTP request's link to the engine. `queue` receives ("tokens", new_ids,
    finish_reason | None, text_end, logprobs, pieces) items (`logprobs`: the new tokens'
    `engine.runner.Logprob`s, None unless the request asks; `pieces`: their text as the
    engine decoded it, `engine.scheduler.StepEvent.pieces`), or ("error", msg)."""

    req: EngineRequest
    # Whether the answer is sent as it grows. A whole answer's handler wakes only for the last
    # item (all its tokens): waking it at every step costs the step thread a pause between
    # steps, the handler's Python holding the interpreter meanwhile.
    stream: bool = True
    queue: asyncio.Queue[tuple[Any, ...]] = field(default_factory=asyncio.Queue)
    closed: bool = False
    _checked: float = 0.0
    _held: list[int] = field(default_factory=list)  # tokens not yet queued (not `stream`)
    _held_logprobs: list[Any] = field(default_factory=list)  # and their log-probabilities
    _held_pieces: list[str] = field(default_factory=list)  # and their text

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
    """`running` is the app's lifespan; handlers `submit` and `post` aborts.

    The step thread owns the scheduler and steps back to back while there is work, as the
    offline engine does; the event loop only queues commands for it (`post`) and receives each
    step's tokens (`_deliver`). Handing every step to the thread from the loop and back costs a
    pause between every two steps (a larger share of a plain step than of a tree step), time in
    which neither runs a step."""

    def __init__(self, llm: LLM, threads: int | None = None):
        self.llm, self.sched = llm, llm.scheduler
        # A failing row fails alone (the scheduler runs a failed call again row by row); a lost
        # peer is nobody's fault and no later step can run.
        self.sched.isolate, self.sched.fatal = True, (PeerLost,)
        self.threads = threads or torch.get_num_threads()  # the step thread's torch threads
        self.metrics = Metrics(self.sched.step_span)
        self.fatal: str | None = None  # why the engine stopped for good (tensor parallelism)
        self.snapshot: dict[str, int] = {}  # NOTE: replaced whole, never half-updated
        self._todo: deque[tuple[str, Handle | None]] = deque()  # loop -> step thread
        self._wake = threading.Event()
        self._live: dict[int, Handle] = {}  # event loop only: requests whose answer is open
        self._owned: dict[int, EngineRequest] = {}  # step thread only: requests it runs
        self._loop: asyncio.AbstractEventLoop | None = None
        self._seen: dict[str, float] = {}  # counters' values at the last publish
        self._publish()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Step graphs captured on the step thread, then the engine loop there; leaving fails
        the rest."""
        self._loop = loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(1, "engine", torch.set_num_threads, (self.threads,)) as thread:
            await loop.run_in_executor(thread, functools.partial(self.llm.runner.capture,
                                                                 lagging=True))
            done = loop.run_in_executor(thread, self._run)
            try:
                yield
            finally:
                self.post("stop", None)
                await done
                self._fail([*self._live], "the server is shutting down")  # never handed over

    def submit(self, h: Handle) -> None:
        """Queues `h`'s request; raises RequestRejected at once when it can never run."""
        self.sched.check(h.req)  # NOTE: reads fixed limits only, so it may run beside a step
        self._live[h.req.rid] = h
        self.metrics.prompt_tokens.inc(len(h.req.prompt_ids))
        self.post("add", h)

    def post(self, kind: str, h: Handle | None) -> None:
        """`abort` a request, or `stop`, when the engine is next between steps."""
        if kind == "abort" and h is not None:
            self._live.pop(h.req.rid, None)  # no more tokens for it
        self._todo.append((kind, h))
        self._wake.set()

    # ---- the step thread -----------------------------------------------------------------------

    def _run(self) -> None:
        # NOTE: the scheduler and the models are touched only here, so commands apply between
        # steps. A post after the wait and before the clear is drained below.
        while True:
            if not self._todo and not self.sched.has_work:
                self._wake.wait()
            self._wake.clear()
            while self._todo:
                kind, h = self._todo.popleft()
                if kind == "stop":
                    return self._fail_all("the server is shutting down")
                assert h is not None
                self._command(kind, h.req)
            if not self.sched.has_work:  # a step publishes itself
                self._publish()
                continue
            try:
                t0 = time.perf_counter()
                events = self.sched.step()
                self._stepped(events, time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - the engine outlives any one failure
                log.exception("engine step failed outside fault isolation; failing every "
                              "in-flight request")
                # NOTE: the cause stays in the log: exception text is no client's business.
                self._fail_all(UNATTRIBUTED)
                if isinstance(e, PeerLost):
                    # NOTE: a tensor-parallel peer is gone and no later step can run: stop the
                    # server (main exits non-zero).
                    self.fatal = str(e)
                    os.kill(os.getpid(), signal.SIGTERM)
                    return

    def _command(self, kind: str, req: EngineRequest) -> None:
        if kind == "add":
            self.sched.add(req)
            self._owned[req.rid] = req
        elif self._owned.pop(req.rid, None) is not None:  # an abort of a running request
            self.sched.abort(req)
            self.metrics.finished.labels("abort").inc()

    def _stepped(self, events: list[Any], seconds: float) -> None:
        m = self.metrics
        m.step_seconds.inc(seconds)
        m.steps.inc()
        # Publish before handing out tokens: a client that saw its request finish must then
        # see its pages free in /health.
        self._publish()
        out = []
        for ev in events:  # NOTE: aborts apply between steps, so every event's request is owned
            req = ev.req
            if ev.emitted:
                m.accepted.observe(ev.emitted)
            m.generated.inc(len(ev.new_ids))
            reason = req.finish_reason if ev.finished else None
            if ev.finished:
                del self._owned[req.rid]
                m.finished.labels(reason or "stop").inc()
            if ev.error is not None:
                log.error("request %d failed in the engine (%s)", req.rid,
                          "it failed alone" if ev.blamed else "every row of its step failed",
                          exc_info=ev.error)
                out.append((req.rid, ("error", BLAMED if ev.blamed else UNATTRIBUTED)))
            elif ev.new_ids or ev.finished:
                out.append((req.rid, ("tokens", list(ev.new_ids), reason, req.text_end,
                                      ev.logprobs, ev.pieces)))
        if out:
            self._to_loop(self._deliver, out)

    def _fail_all(self, message: str) -> None:
        # NOTE: a request a failed step held may be in neither queue: abort each one by name.
        for req in [*self._owned.values(), *self.sched.running, *self.sched.prefilling,
                    *self.sched.waiting]:
            with contextlib.suppress(Exception):
                self.sched.abort(req)
        rids, self._owned = [*self._owned], {}
        self._publish()
        self._to_loop(self._fail, rids, message)

    def _to_loop(self, fn: Any, *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            self._loop.call_soon_threadsafe(fn, *args)

    def _publish(self) -> None:
        s, m = self.sched, self.metrics
        self.snapshot = {"running": s.admitted, "waiting": len(s.waiting),
                         "kv_pages_free": s.alloc.num_free, "kv_pages_total": s.alloc.capacity,
                         "preemptions": s.num_preemptions}
        for k in ("running", "kv_pages_free", "kv_pages_total"):
            getattr(m, k).set(self.snapshot[k])
        now = {"preemptions": s.num_preemptions, **self.llm.timer.totals}
        for k, v in now.items():  # counters move by what changed since the last publish
            (m.preemptions if k == "preemptions" else m.phase_seconds.labels(k)).inc(
                v - self._seen.get(k, 0))
        self._seen = now

    # ---- the event loop ------------------------------------------------------------------------

    def _deliver(self, out: list[tuple[int, tuple[Any, ...]]]) -> None:
        for rid, item in out:
            if (h := self._live.get(rid)) is None:
                continue
            if item[0] == "error":
                self._fail([rid], item[1])
                continue
            kind, new, reason, text_end, logprobs, pieces = item
            if reason is None and not h.stream:
                h._held += new
                h._held_logprobs += logprobs or []
                h._held_pieces += pieces or []
                continue
            if reason is not None:
                del self._live[rid]
            if h._held:
                new, h._held = h._held + new, []
                if logprobs is not None:
                    logprobs, h._held_logprobs = h._held_logprobs + logprobs, []
                if pieces is not None:
                    pieces, h._held_pieces = h._held_pieces + pieces, []
            h.queue.put_nowait((kind, new, reason, text_end, logprobs, pieces))

    def _fail(self, rids: list[int], message: str) -> None:
        for rid in rids:
            if (h := self._live.pop(rid, None)) is not None:
                h.queue.put_nowait(("error", message))
