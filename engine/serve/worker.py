"""The engine loop and the server's link to it.

`Core` owns the scheduler: it applies queued commands (add, abort, stop) between steps and steps
back to back while there is work; each step's outcome is one `Report`: the items of every
request that got tokens (or failed), the engine's state (`snapshot`) and its counters'
increments. `Engine` is the HTTP side: handlers `submit` requests and `post` aborts, and each
report lands, on the event loop, in per-request asyncio queues and the Prometheus metrics.

The core runs beside the event loop in one of two ways:
- `Local`: on a thread of the server's process (tests, an `LLM` served from Python);
- `Remote`: in a process of its own, linked by two pipes (`python -m engine.serve`, see
  `engine.serve.procs`). The core's process is the model's (the tensor-parallel leader under
  torchrun); HTTP, JSON, the answers' parsing and streaming run in a child process, so they
  never hold the interpreter lock a step needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import queue
import signal
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Protocol

from engine.config import SamplingParams
from engine.grammar import Grammars
from engine.media import MediaConfig
from engine.request import Limits
from engine.request import Request as EngineRequest
from engine.serve.metrics import Metrics
from engine.tokenizer import Tokenizer

if TYPE_CHECKING:  # the engine's process imports this module and serves no HTTP
    from fastapi import Request

log = logging.getLogger("engine.serve")
DISCONNECT_POLL_S = 0.25  # how often a waiting handler checks that its client is still there
# What a client whose request failed in the engine is told (the cause is in the server log).
BLAMED = ("the engine failed while running this request, and only this request: the others "
          "in its batch went on (the server log has the cause)")
UNATTRIBUTED = ("an engine step failed and the failure could not be attributed to one request, "
                "so every request of the step was failed (the server log has the cause)")
SHUTDOWN = "the server is shutting down"
Item = tuple[Any, ...]


class ClientGone(Exception):
    """The client closed the connection while its request was in flight."""


@dataclass
class Report:
    """What the core tells the HTTP side after a step (or after commands changed its state):
    `items` per request id, ("tokens", new_ids, finish_reason | None, text_end, logprobs,
    pieces, prompt_logprobs, cached_tokens) or ("error", message), in the order the engine
    made them; the engine's `snapshot` after them; and its counters' increments (`counts`: steps,
    step_seconds, generated, accepted (each row's tokens a step), finished (by reason),
    preemptions, prefix_queries / prefix_hits (prompt tokens looked up in the prefix cache, and
    found), evicted (pages), phases (seconds by step phase))."""

    items: list[tuple[int, Item]]
    snapshot: dict[str, int]
    counts: dict[str, Any]


@dataclass
class ModelInfo:
    """What the HTTP side knows of the served model, without its weights: tokenizer, limits
    and grammars; it names the requests it makes."""

    tokenizer: Tokenizer | None
    max_model_len: int
    vocab_size: int
    grammars: Grammars | None = None
    # The placeholder id an image's tokens expand from, when the model takes images, and how
    # its images are preprocessed (`engine.media`).
    image_pad: int | None = None
    media: MediaConfig = field(default_factory=MediaConfig)
    _rids: Iterator[int] = field(default_factory=itertools.count, repr=False)

    @classmethod
    def of(cls, llm: Any) -> ModelInfo:
        """The view of an `engine.llm.LLM` (or anything with its tokenizer, max_model_len and
        scheduler)."""
        s = llm.scheduler
        models = getattr(llm, "models", None)
        vision = getattr(models, "vision", None)
        return cls(llm.tokenizer, llm.max_model_len, s.vocab_size, s.grammars,
                   vision.cfg.placeholder_id if vision is not None else None,
                   getattr(llm, "media_config", None) or MediaConfig())

    def make_request(self, prompt_ids: list[int], params: SamplingParams,
                     images: list[tuple[int, Any]] | None = None) -> EngineRequest:
        return EngineRequest(next(self._rids), list(prompt_ids), params,
                             images=list(images or ()))


@dataclass
class Handle:
    """One HTTP request's link to the engine. `queue` receives the request's report items
    (`Report.items`; its tokens' `logprobs` are `engine.config.Logprob`s, None unless it asks;
    `pieces` their text as the engine decoded it, `engine.scheduler.StepEvent.pieces`)."""

    req: EngineRequest
    # Whether the answer is sent as it grows. A whole answer's handler wakes only for the last
    # item (all its tokens): waking it at every step costs the event loop for nothing.
    stream: bool = True
    queue: asyncio.Queue[Item] = field(default_factory=asyncio.Queue)
    closed: bool = False
    _checked: float = 0.0
    _held: list[Item] = field(default_factory=list)  # items not yet queued (not `stream`)
    _pending: Item | None = None  # taken from the queue, not yet handed out

    async def next(self, http: Request) -> Item:
        """The next item, every tokens item queued behind it merged into it (a client slower
        than the engine gets fewer, larger chunks); raises ClientGone if `http`'s client
        disconnects."""
        while True:
            # Checked on a clock, not only when idle: tokens may arrive faster than the poll.
            now = time.monotonic()
            if now - self._checked >= DISCONNECT_POLL_S:
                self._checked = now
                if await http.is_disconnected():
                    raise ClientGone()
            if self._pending is None and self.queue.empty():
                with contextlib.suppress(TimeoutError):
                    self._pending = await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S)
                if self._pending is None:
                    continue
            item, self._pending = self._pending or self.queue.get_nowait(), None
            items = [item]
            while item[0] == "tokens" and item[2] is None and not self.queue.empty():
                item = self.queue.get_nowait()
                if item[0] != "tokens":
                    self._pending = item  # an error: handed out next
                    break
                items.append(item)
            return merge(items)


def wire(req: EngineRequest) -> tuple[int, list[int], SamplingParams, list[tuple[int, Any]]]:
    """What a request is across processes (`unwire` makes it again): its id, prompt,
    parameters and images (their pixels: the engine's process encodes them); its random stream
    is seeded where it runs, as anywhere."""
    return req.rid, req.prompt_ids, req.params, req.images


def unwire(w: tuple[int, list[int], SamplingParams, list[tuple[int, Any]]]) -> EngineRequest:
    rid, ids, params, images = w
    return EngineRequest(rid, ids, params, images=images)


def merge(items: list[Item]) -> Item:
    """Tokens items of one request, in order, as one (the last one's finish)."""
    if len(items) == 1:
        return items[0]

    def joined(k: int) -> list[Any] | None:
        parts = [x[k] for x in items if x[k] is not None]
        return [v for part in parts for v in part] if parts else None

    plp = next((x[6] for x in items if x[6] is not None), None)
    cached = next((x[7] for x in items if x[7] is not None), None)
    return ("tokens", joined(1), items[-1][2], items[-1][3], joined(4), joined(5), plp, cached)


# ---- the core: the scheduler's thread ------------------------------------------------------------


class Core:
    """The engine loop over `llm`'s scheduler. `post` queues a command from any thread:
    ("add", request), ("abort", request id) or ("stop", None); `run` applies them between
    steps and steps while there is work, handing each `Report` to `emit` (on its own thread),
    until a stop (every request left then fails) or a lost tensor-parallel peer (`fatal`)."""

    def __init__(self, llm: Any, emit: Callable[[Report], None]):
        from engine.dist import PeerLost

        self.llm, self.sched, self.emit = llm, llm.scheduler, emit
        # A failing row fails alone (the scheduler runs a failed call again row by row); a lost
        # peer is nobody's fault and no later step can run.
        self.sched.isolate, self.sched.fatal = True, (PeerLost,)
        self.fatal: str | None = None  # why the engine stopped for good
        self._todo: deque[tuple[str, Any]] = deque()
        self._wake = threading.Event()
        self._owned: dict[int, EngineRequest] = {}  # the requests it runs, by id
        self._seen: dict[str, float] = self._totals()  # counters' values at the last report
        self.snapshot = self._snapshot()

    def post(self, cmd: tuple[str, Any]) -> None:
        self._todo.append(cmd)
        self._wake.set()

    def run(self) -> None:
        # NOTE: the scheduler and the models are touched only here, so commands apply between
        # steps. A post after the wait and before the clear is drained below.
        while True:
            if not self._todo and not self.sched.has_work:
                self._wake.wait()
            self._wake.clear()
            items: list[tuple[int, Item]] = []
            counts: dict[str, Any] = {}
            while self._todo:
                kind, arg = self._todo.popleft()
                if kind == "stop":
                    return self._fail_all(SHUTDOWN)
                self._command(kind, arg, items, counts)
            if not self.sched.has_work:
                self._report(items, counts)
                continue
            try:
                t0 = time.perf_counter()
                events = self.sched.step()
                counts.update(steps=1, step_seconds=time.perf_counter() - t0)
                self._stepped(events, items, counts)
            except Exception as e:  # noqa: BLE001 - the engine outlives any one failure
                log.exception("engine step failed outside fault isolation; failing every "
                              "in-flight request")
                # NOTE: the cause stays in the log: exception text is no client's business.
                self._fail_all(UNATTRIBUTED)
                if isinstance(e, self.sched.fatal):  # no later step can run: the server stops
                    self.fatal = str(e)
                    return
            self._report(items, counts)

    def _command(self, kind: str, arg: Any, items: list[tuple[int, Item]],
                 counts: dict[str, Any]) -> None:
        if kind == "add":
            try:
                self.sched.add(arg)
            except Exception as e:  # noqa: BLE001 - the HTTP side checked it; this one fails
                items.append((arg.rid, ("error", f"request rejected: {e}")))
                return
            self._owned[arg.rid] = arg
        elif kind == "abort" and (req := self._owned.pop(arg, None)) is not None:
            self.sched.abort(req)  # a request still running; a finished one is gone already
            counts.setdefault("finished", Counter())["abort"] += 1
        elif kind not in ("add", "abort"):
            raise ValueError(f"unknown engine command {kind!r}")

    def _stepped(self, events: list[Any], items: list[tuple[int, Item]],
                 counts: dict[str, Any]) -> None:
        accepted, finished = [], counts.setdefault("finished", Counter())
        generated = 0
        for ev in events:  # NOTE: aborts apply between steps, so every event's request is owned
            req, rid = ev.req, ev.req.rid
            if ev.emitted:
                accepted.append(ev.emitted)
            generated += len(ev.new_ids)
            reason = req.finish_reason if ev.finished else None
            if ev.finished:
                del self._owned[rid]
                finished[reason or "stop"] += 1
            if ev.error is not None:
                log.error("request %d failed in the engine (%s)", rid,
                          "it failed alone" if ev.blamed else "every row of its step failed",
                          exc_info=ev.error)
                items.append((rid, ("error", BLAMED if ev.blamed else UNATTRIBUTED)))
            elif ev.new_ids or ev.finished:
                # the prompt's log-probabilities and its cached tokens come with its
                # prefill's event (its first tokens; a recomputed prompt's prefill makes none)
                prefilled = ev.emitted == 0
                items.append((rid, ("tokens", list(ev.new_ids), reason, req.text_end,
                                    ev.logprobs, ev.pieces,
                                    req.prompt_logprobs if prefilled else None,
                                    req.cached_tokens if prefilled else None)))
        counts.update(generated=generated, accepted=accepted)

    def _fail_all(self, message: str) -> None:
        # NOTE: a request a failed step held may be in neither queue: abort each one by name.
        for req in [*self._owned.values(), *self.sched.running, *self.sched.prefilling,
                    *self.sched.waiting]:
            with contextlib.suppress(Exception):
                self.sched.abort(req)
        items = [(rid, ("error", message)) for rid in self._owned]
        self._owned = {}
        self._report(items, {})

    def _totals(self) -> dict[str, float]:
        s = self.sched
        return {"preemptions": s.num_preemptions, "prefix_queries": s.prefix_queries,
                "prefix_hits": s.prefix_hits, "evicted": s.cache.evicted,
                **self.llm.timer.totals}

    def _snapshot(self) -> dict[str, int]:
        # NOTE: free pages are those an admission can have: cached ones no request holds too
        s = self.sched
        return {"running": s.admitted, "waiting": len(s.waiting),
                "kv_pages_free": s.cache.available, "kv_pages_total": s.alloc.capacity,
                "kv_pages_cached": s.cache.cached, "preemptions": s.num_preemptions}

    def _report(self, items: list[tuple[int, Item]], counts: dict[str, Any]) -> None:
        """Emits the items, the state after them and the counters' increments since the last
        report, unless there is nothing new."""
        snapshot, now = self._snapshot(), self._totals()
        moved = {k: v - self._seen.get(k, 0) for k, v in now.items() if v != self._seen.get(k, 0)}
        self._seen = now
        for k in ("preemptions", "prefix_queries", "prefix_hits", "evicted"):
            if k in moved:
                counts[k] = moved.pop(k)
        if moved:
            counts["phases"] = moved
        if items or counts or snapshot != self.snapshot:
            self.snapshot = snapshot
            self.emit(Report(items, snapshot, counts))


# ---- the links: where the core runs ------------------------------------------------------------


class Link(Protocol):
    """Where the core runs, as `Engine` sees it."""

    limits: Limits
    snapshot: dict[str, int]  # the engine's state before its first report

    @property
    def fatal(self) -> str | None: ...

    def check(self, req: EngineRequest) -> None: ...

    def send(self, cmd: tuple[str, Any]) -> None: ...

    def running(self, deliver: Callable[[Report], None]
                ) -> contextlib.AbstractAsyncContextManager[None]: ...


class Local:
    """The core on a thread of this process, its reports handed to the event loop."""

    def __init__(self, llm: Any, threads: int | None = None):
        import torch

        self.llm, self.threads = llm, threads or torch.get_num_threads()
        self.limits = llm.scheduler.limits
        self.check = llm.scheduler.check  # the grammar's matcher is made here too
        self.core = Core(llm, self._emit)
        self.snapshot = self.core.snapshot
        self._to_loop: Callable[[Report], None] = lambda _: None

    @property
    def fatal(self) -> str | None:
        return self.core.fatal

    def send(self, cmd: tuple[str, Any]) -> None:
        self.core.post(cmd)

    def _emit(self, report: Report) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            self._to_loop(report)

    @contextlib.asynccontextmanager
    async def running(self, deliver: Callable[[Report], None]) -> AsyncIterator[None]:
        """Step graphs captured on the core's thread (torch's thread team is that thread's),
        then the core's loop there."""
        import torch

        loop = asyncio.get_running_loop()
        self._to_loop = functools.partial(loop.call_soon_threadsafe, deliver)
        with ThreadPoolExecutor(1, "engine", torch.set_num_threads, (self.threads,)) as thread:
            await loop.run_in_executor(thread, functools.partial(self.llm.runner.capture,
                                                                 lagging=True))
            done = loop.run_in_executor(thread, self._run)
            try:
                yield
            finally:
                self.send(("stop", None))
                await done

    def _run(self) -> None:
        self.core.run()
        if self.core.fatal:  # NOTE: the server stops (main exits non-zero)
            os.kill(os.getpid(), signal.SIGTERM)


class Remote:
    """The core in another process (`engine.serve.procs`): commands go down `commands` (a
    request as its id, prompt and parameters: `wire`), written by a thread of this process so
    the event loop never waits on the pipe while the core is busy; its reports come up
    `reports`, read by another, and end with ("end", why it stopped for good, or None)."""

    def __init__(self, commands: Connection, reports: Connection, limits: Limits,
                 snapshot: dict[str, int]):
        self.commands, self.reports = commands, reports
        self.limits, self.snapshot = limits, snapshot
        self.fatal: str | None = None
        self._out: queue.SimpleQueue[tuple[str, Any] | None] = queue.SimpleQueue()
        threading.Thread(target=self._write, name="engine-commands", daemon=True).start()

    def check(self, req: EngineRequest) -> None:
        self.limits.check(req)  # a grammar is checked where the route builds it

    def send(self, cmd: tuple[str, Any]) -> None:
        kind, arg = cmd
        self._out.put((kind, wire(arg)) if kind == "add" else cmd)

    def _write(self) -> None:
        while (cmd := self._out.get()) is not None:
            try:
                self.commands.send(cmd)
            except OSError:  # the core is gone: the report reader says so
                return

    @contextlib.asynccontextmanager
    async def running(self, deliver: Callable[[Report], None]) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        stopping = threading.Event()

        def read() -> None:
            while True:
                try:
                    msg = self.reports.recv()
                except (EOFError, OSError):
                    msg = ("end", "the engine process is gone")
                if isinstance(msg, tuple):
                    self.fatal = msg[1]
                    break
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(deliver, msg)
            if not stopping.is_set():  # the engine ended on its own: so does the server
                log.error("the engine stopped: %s", self.fatal or "no reason given")
                os.kill(os.getpid(), signal.SIGTERM)

        reader = threading.Thread(target=read, name="engine-reports", daemon=True)
        reader.start()
        try:
            yield
        finally:
            stopping.set()
            self.send(("stop", None))
            self._out.put(None)
            await loop.run_in_executor(None, reader.join, 60)


class Engine:
    """The HTTP side of the engine: `running` is the app's lifespan; handlers `submit` and
    `post` aborts; each core report updates the metrics and `snapshot`, then hands each open
    request its items. By default the core runs on a thread over `llm` (`Local`)."""

    def __init__(self, llm: Any = None, threads: int | None = None, link: Link | None = None):
        self.link: Link = link if link is not None else Local(llm, threads)
        self.metrics = Metrics(self.link.limits.step_span)
        self.snapshot: dict[str, int] = {}  # NOTE: replaced whole, never half-updated
        self._live: dict[int, Handle] = {}  # requests whose answer is open
        self._set_snapshot(self.link.snapshot)

    @property
    def fatal(self) -> str | None:
        """Why the engine stopped for good (a lost tensor-parallel peer), if it did."""
        return self.link.fatal

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The core runs; leaving fails the requests still open."""
        try:
            async with self.link.running(self._report):
                yield
        finally:
            self._fail([*self._live], SHUTDOWN)  # never handed over

    def submit(self, h: Handle) -> None:
        """Queues `h`'s request; raises RequestRejected at once when it can never run."""
        self.link.check(h.req)
        self._live[h.req.rid] = h
        self.metrics.prompt_tokens.inc(len(h.req.prompt_ids))
        self.link.send(("add", h.req))

    def post(self, kind: str, h: Handle | None) -> None:
        """`abort` a request (one that ended already needs none), or `stop`, when the engine
        is next between steps."""
        if kind != "abort":
            self.link.send((kind, None))
        elif h is not None and self._live.pop(h.req.rid, None) is not None:
            self.link.send(("abort", h.req.rid))  # NOTE: no more tokens for it either way

    def end_open(self, reason: str = "abort") -> int:
        """Ends every open answer now (the server is shutting down): each request is aborted
        and its reader gets a last item finishing with `reason` (vLLM's for an aborted
        request), so a stream still ends with its final chunk and [DONE], and a whole answer
        comes back with what was generated. Returns how many there were."""
        live, self._live = self._live, {}
        for rid, h in live.items():
            self.link.send(("abort", rid))
            item: Item = ("tokens", [], reason, None, None, None, None, None)
            if h._held:
                item, h._held = merge([*h._held, item]), []
            h.queue.put_nowait(item)
        return len(live)

    def _set_snapshot(self, snapshot: dict[str, int]) -> None:
        self.snapshot = snapshot
        for k in ("running", "kv_pages_free", "kv_pages_total", "kv_pages_cached"):
            getattr(self.metrics, k).set(snapshot[k])

    def _report(self, rep: Report) -> None:
        m, c = self.metrics, rep.counts
        if "steps" in c:
            m.steps.inc(c["steps"])
            m.step_seconds.inc(c["step_seconds"])
        for n in c.get("accepted", ()):
            m.accepted.observe(n)
        if c.get("generated"):
            m.generated.inc(c["generated"])
        for reason, n in c.get("finished", {}).items():
            m.finished.labels(reason).inc(n)
        for k in ("preemptions", "prefix_queries", "prefix_hits", "evicted"):
            if k in c:
                getattr(m, k).inc(c[k])
        for phase, seconds in c.get("phases", {}).items():
            m.phase_seconds.labels(phase).inc(seconds)
        # The state before the tokens: a client that saw its request finish must then see its
        # pages free in /health.
        self._set_snapshot(rep.snapshot)
        for rid, item in rep.items:
            if (h := self._live.get(rid)) is None:
                continue
            if item[0] == "error":
                self._fail([rid], item[1])
                continue
            if item[6] is not None:
                h.req.prompt_logprobs = item[6]
            if item[7] is not None:
                h.req.cached_tokens = item[7]
            if item[2] is None and not h.stream:
                h._held.append(item)  # NOTE: merged once, with the last
                continue
            if item[2] is not None:
                del self._live[rid]
            if h._held:
                item, h._held = merge([*h._held, item]), []
            h.queue.put_nowait(item)

    def _fail(self, rids: list[int], message: str) -> None:
        for rid in rids:
            if (h := self._live.pop(rid, None)) is not None:
                h.queue.put_nowait(("error", message))
