"""OpenAI-compatible HTTP server.

    python -m engine.serve --model DIR --draft DIR [--mode tree --budget 16 --max-batch-size 8
        --device cuda --dtype bf16 --max-model-len N --kv-pages N --host 127.0.0.1 --port 8000
        --max-queue 256 --served-model-name NAME]
    torchrun --nproc-per-node N -m engine.serve --tp N ...   (tensor parallel; rank 0 serves)

Endpoints: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (both with
`stream: true` as server-sent events ending in `data: [DONE]`), `GET /health` (JSON with the KV
pool's free pages and the batch/queue sizes) and `GET /metrics` (Prometheus text).

One engine thread owns the scheduler. HTTP handlers never call it: they put submissions and
aborts on a thread-safe inbox and receive tokens on per-request asyncio queues fed through
`loop.call_soon_threadsafe`, so a slow client never delays a step and the scheduler is only ever
touched by one thread.

Request defaults follow OpenAI's, not the offline API's: `temperature` 1.0; `max_tokens` 16 for
completions and the rest of the context for chat (an explicit value that does not fit the context
is an error; a default one is clamped). Extensions: `top_k` (-1 off) and `ignore_eos`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import queue
import signal
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.config import SamplingParams, add_model_args
from engine.llm import LLM
from engine.request import Request as EngineRequest
from engine.scheduler import RequestRejected
from engine.tokenizer import TokenizerError

log = logging.getLogger("engine.serve")

# How often a handler waiting for tokens checks whether its client went away. Streams are also
# cancelled by Starlette on disconnect; this catches non-streaming requests.
DISCONNECT_POLL_S = 0.25
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_STOP_STRINGS = 4
MAX_BODY_BYTES = 16 << 20
# Longer texts are tokenized on a worker thread so the event loop keeps serving streams.
INLINE_ENCODE_CHARS = 8192
# torch.manual_seed accepts exactly this range.
SEED_RANGE = (-(2**63), 2**64 - 1)
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


# ---- errors ------------------------------------------------------------------------------------


class APIError(Exception):
    """An error returned to the client as an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, err_type: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.err_type, self.headers = err_type, headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _bad(param: str | None, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


class ClientGone(Exception):
    """The client closed the connection while its request was in flight."""


# ---- engine thread -----------------------------------------------------------------------------


@dataclass
class Handle:
    """One HTTP request's link to the engine. `queue` receives, in order: ("accepted",) or
    ("rejected", msg); then ("tokens", new_ids, finish_reason | None, text_end) items; or
    ("error", msg) if the engine failed."""

    req: EngineRequest
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[tuple[Any, ...]] = field(default_factory=asyncio.Queue)
    finished: bool = False  # set by the HTTP side once the final item was read
    closed: bool = False
    steps_seen: int = 0  # engine thread only: accept lengths already counted
    _getter: asyncio.Task[tuple[Any, ...]] | None = None
    _checked: float = 0.0

    async def next(self, http: Request | None) -> tuple[Any, ...]:
        """The next item for this request; raises ClientGone if `http`'s client disconnects.

        NOTE: one getter task survives poll timeouts, so an item that arrives just as a poll
        times out is never lost (cancelling a pending `queue.get()` could race with it)."""
        while True:
            # Checked on a clock, not only when idle: tokens may arrive faster than the poll.
            now = time.monotonic()
            if http is not None and now - self._checked >= DISCONNECT_POLL_S:
                self._checked = now
                if await http.is_disconnected():
                    raise ClientGone()
            if self._getter is None:
                self._getter = asyncio.ensure_future(self.queue.get())
            done, _ = await asyncio.wait({self._getter}, timeout=DISCONNECT_POLL_S)
            if done:
                item, self._getter = self._getter.result(), None
                return item

    def cancel_getter(self) -> None:
        if self._getter is not None:
            self._getter.cancel()
            self._getter = None


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine state for /health and /metrics, replaced whole by the engine thread (readers never
    see a half-updated one and never touch the scheduler)."""

    running: int = 0
    waiting: int = 0
    kv_pages_free: int = 0
    kv_pages_total: int = 0
    preemptions: int = 0
    steps: int = 0
    step_seconds: float = 0.0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    accept_hist: tuple[int, ...] = ()  # counts of steps that emitted 1, 2, ... tokens
    accept_sum: int = 0
    phase_seconds: dict[str, float] = field(default_factory=dict)


_STOP = ("stop",)


class Engine:
    """Runs the scheduler on its own thread; every other thread talks to it via `submit`/`abort`."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self.sched = llm.scheduler
        self.max_emit = self.sched.step_span
        self._inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._live: dict[int, Handle] = {}
        self._thread: threading.Thread | None = None
        self.fatal: str | None = None  # why the engine stopped for good (tensor parallelism)
        # counters below are written only by the engine thread
        self._prompt_tokens = 0
        self._generated = 0
        self._steps = 0
        self._step_s = 0.0
        self._finished: Counter[str] = Counter()
        self._accept = [0] * self.max_emit
        self._accept_sum = 0
        self.snapshot = EngineSnapshot()
        self._publish()

    # ---- called from any thread ------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._inbox.put(_STOP)
            self._thread.join(timeout)
            self._thread = None

    def submit(self, handle: Handle) -> None:
        self._inbox.put(("add", handle))

    def abort(self, handle: Handle) -> None:
        self._inbox.put(("abort", handle))

    # ---- engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        from engine.parallel import PeerLost

        while True:
            try:
                if not self._iteration():
                    return
            except PeerLost as e:
                # NOTE: a tensor-parallel peer is gone: no later step can run. Answer everyone,
                # then stop the server (main exits non-zero).
                log.error("%s; shutting down", e)
                self.fatal = str(e)
                self._fail_all(f"engine error: {e}")
                self._publish()
                os.kill(os.getpid(), signal.SIGTERM)
                return
            except Exception as e:  # noqa: BLE001 - the thread must outlive any one failure
                log.exception("engine loop failed; failing every in-flight request")
                self._fail_all(f"engine error: {type(e).__name__}: {e}")
                self._publish()

    def _iteration(self) -> bool:
        """Applies pending commands, then runs one step if there is work; False on stop."""
        # NOTE: block on the inbox only when idle; with work, just drain what is there.
        try:
            cmd = self._inbox.get(block=not self.sched.has_work)
        except queue.Empty:
            cmd = None
        while cmd is not None:
            if cmd is _STOP:
                self._fail_all("the server is shutting down")
                return False
            self._command(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                cmd = None
        if self.sched.has_work:
            self._step()
        self._publish()
        return True

    def _command(self, cmd: tuple[Any, ...]) -> None:
        kind, h = cmd
        if kind == "add":
            try:
                self.sched.add(h.req)
            except (RequestRejected, ValueError) as e:
                self._send(h, ("rejected", str(e)))
                return
            self._live[h.req.rid] = h
            self._prompt_tokens += len(h.req.prompt_ids)
            self._send(h, ("accepted",))
        elif kind == "abort":
            if self._live.pop(h.req.rid, None) is None:
                return  # already finished; its pages are free
            self.sched.abort(h.req)
            self._finished["abort"] += 1

    def _step(self) -> None:
        t0 = time.perf_counter()
        events = self.sched.step()
        self._step_s += time.perf_counter() - t0
        self._steps += 1
        # Publish before handing out tokens: a client that saw its request finish must then
        # see its pages free in /health.
        self._publish()
        for ev in events:
            h = self._live.get(ev.req.rid)
            if h is None:
                continue
            req = ev.req
            for a in req.accept_lengths[h.steps_seen:]:
                self._accept[min(a, self.max_emit) - 1] += 1
                self._accept_sum += a
            h.steps_seen = len(req.accept_lengths)
            self._generated += len(ev.new_ids)
            reason = req.finish_reason if ev.finished else None
            if ev.finished:
                del self._live[req.rid]
                self._finished[reason or "stop"] += 1
            if ev.new_ids or ev.finished:
                self._send(h, ("tokens", list(ev.new_ids), reason, req.text_end))

    def _fail_all(self, message: str) -> None:
        for h in list(self._live.values()):
            with contextlib.suppress(Exception):
                self.sched.abort(h.req)
            self._send(h, ("error", message))
        self._live.clear()
        # Whatever the scheduler still holds has no client left to answer.
        for req in [*self.sched.running, *self.sched.waiting]:
            with contextlib.suppress(Exception):
                self.sched.abort(req)

    @staticmethod
    def _send(h: Handle, item: tuple[Any, ...]) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is gone (shutdown)
            h.loop.call_soon_threadsafe(h.queue.put_nowait, item)

    def _publish(self) -> None:
        s = self.sched
        self.snapshot = EngineSnapshot(
            running=len(s.running), waiting=len(s.waiting), kv_pages_free=s.alloc.num_free,
            kv_pages_total=s.alloc.capacity, preemptions=s.num_preemptions, steps=self._steps,
            step_seconds=self._step_s, prompt_tokens=self._prompt_tokens,
            generated_tokens=self._generated, finished=dict(self._finished),
            accept_hist=tuple(self._accept), accept_sum=self._accept_sum,
            phase_seconds=dict(self.llm.timer.totals))


# ---- request bodies ----------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool | None = None


class _Common(BaseModel):
    # NOTE: strict, so "5" is not silently a max_tokens of 5 and true is not a temperature.
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    user: str | None = None
    # OpenAI parameters the engine does not implement: accepted only at their neutral values.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: bool | int | None = None


class CompletionBody(_Common):
    prompt: str | list[int] | list[str] | list[list[int]] | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatBody(_Common):
    messages: list[dict[str, Any]] | None = None
    max_completion_tokens: int | None = None


_BodyT = TypeVar("_BodyT", bound=_Common)

_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0,), "frequency_penalty": (0,), "logprobs": (False, 0),
    "echo": (False,), "best_of": (1,), "suffix": ("",),
}
_UNION_TYPES = {
    "prompt": "a string, a list of token ids, or a list holding one of those",
    "stop": "a string or a list of strings",
    "logprobs": "a boolean or an integer",
}


def _validation_error(errors: list[Any], body: Any) -> APIError:
    """Turns pydantic's errors into one OpenAI error naming the first offending field."""
    if not errors:
        return _bad(None, "invalid request body")
    # Unknown parameters first: they usually explain the other errors (a misspelt field).
    err = next((e for e in errors if e.get("type") == "extra_forbidden"), errors[0])
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    kind = err.get("type", "")
    if kind == "json_invalid":
        return _bad(None, f"the body is not valid JSON: {err.get('msg')}", "invalid_json")
    if not loc:
        return _bad(None, f"the body must be a JSON object, got {type(body).__name__}",
                    "invalid_type")
    top = loc[0]
    if kind == "extra_forbidden":
        extra = [str(e["loc"][-1]) for e in errors if e.get("type") == "extra_forbidden"]
        return _bad(extra[0], f"Unrecognized request argument(s) supplied: {', '.join(extra)}",
                    "unknown_parameter")
    if kind == "missing":
        return _bad(".".join(loc), f"{'.'.join(loc)} is required", "missing_required_parameter")
    if top in _UNION_TYPES:
        got = body.get(top) if isinstance(body, dict) else None
        return _bad(top, f"invalid type for '{top}': expected {_UNION_TYPES[top]}, got "
                         f"{json.dumps(got)[:80]}", "invalid_type")
    where = ".".join(loc)
    return _bad(where, f"invalid value for '{where}': {err.get('msg')} "
                       f"(got {json.dumps(err.get('input'), default=str)[:80]})", "invalid_type")


async def _parse(http: Request, model: type[_BodyT]) -> _BodyT:
    """The JSON body as `model`, whatever the Content-Type (curl -d sends a form type)."""
    raw = await http.body()
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(413, f"the request body has {len(raw)} bytes; the limit is "
                            f"{MAX_BODY_BYTES}", None, "request_too_large")
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:  # bad JSON, bad UTF-8, absurd nesting
        raise _bad(None, f"the body is not valid JSON: {e}", "invalid_json") from e
    if not isinstance(obj, dict):
        raise _bad(None, f"the body must be a JSON object, got {type(obj).__name__}",
                   "invalid_type")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise _validation_error(e.errors(), obj) from e


# ---- request -> engine request -----------------------------------------------------------------


@dataclass
class Prepared:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    prompt_param: str


class Server:
    """HTTP-side state: the engine, naming, admission limits and request counters."""

    def __init__(self, llm: LLM, served_model_name: str, max_queue: int = 256):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.llm = llm
        self.engine = Engine(llm)
        self.name = served_model_name
        self.max_queue = max_queue
        self.created = int(time.time())
        self.active = 0  # requests submitted and not yet closed (event-loop thread only)
        self.status_counts: Counter[tuple[str, int]] = Counter()

    # ---- validation --------------------------------------------------------------------------

    def _common(self, body: _Common) -> tuple[dict[str, Any], bool, bool]:
        if body.model is not None and body.model != self.name:
            raise APIError(404, f"The model '{body.model}' does not exist; this server serves "
                                f"'{self.name}'", "model", "model_not_found")
        if body.n is not None and body.n != 1:
            raise _bad("n", f"n must be 1 (one choice per request), got {body.n}")
        for name, ok in _NEUTRAL.items():
            v = getattr(body, name, None)
            if v is not None and v not in ok:
                raise _bad(name, f"{name}={v!r} is not supported by this server",
                           "unsupported_parameter")
        stream = bool(body.stream)
        if body.stream_options is not None and not stream:
            raise _bad("stream_options", "stream_options is only allowed when stream is true")
        include_usage = bool(stream and body.stream_options and body.stream_options.include_usage)
        temperature = 1.0 if body.temperature is None else body.temperature
        if not (math.isfinite(temperature) and temperature >= 0):
            raise _bad("temperature", f"temperature must be >= 0, got {temperature}")
        top_p = 1.0 if body.top_p is None else body.top_p
        if not (math.isfinite(top_p) and 0 < top_p <= 1):
            raise _bad("top_p", f"top_p must be in (0, 1], got {top_p}")
        top_k = -1 if body.top_k is None else body.top_k
        if top_k < -1:
            raise _bad("top_k", f"top_k must be -1 (off) or >= 0, got {top_k}")
        if body.seed is not None and not SEED_RANGE[0] <= body.seed <= SEED_RANGE[1]:
            raise _bad("seed", f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], "
                               f"got {body.seed}")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise _bad("stop", f"at most {MAX_STOP_STRINGS} stop sequences, got {len(stop)}")
        if any(s == "" for s in stop):
            raise _bad("stop", "stop sequences must be non-empty strings")
        if stop and self.llm.tokenizer is None:
            raise _bad("stop", "stop strings need a tokenizer; the model has none")
        kw = dict(temperature=float(temperature), top_p=float(top_p), top_k=top_k,
                  seed=body.seed, ignore_eos=bool(body.ignore_eos), stop=tuple(stop))
        return kw, stream, include_usage

    def _max_tokens(self, prompt_ids: list[int], prompt_param: str, max_tokens: int | None,
                    max_param: str, default: int | None) -> int:
        """Checks the prompt against the context and returns the max_new_tokens to use."""
        n, limit = len(prompt_ids), self.llm.max_model_len
        if n == 0:
            raise _bad(prompt_param, f"{prompt_param} is empty")
        if n + 1 > limit:
            raise _bad(prompt_param, f"{prompt_param} has {n} tokens, but this model's context "
                                     f"limit is {limit} tokens (prompt plus at least one new "
                                     f"token)", "context_length_exceeded")
        room = limit - n
        if max_tokens is None:
            max_tokens = min(default or room, room)
        elif max_tokens < 1:
            raise _bad(max_param, f"{max_param} must be >= 1, got {max_tokens}")
        elif max_tokens > room:
            raise _bad(max_param, f"{max_param} is {max_tokens}, but the context limit is "
                                  f"{limit} tokens and the {prompt_param} has {n}: at most "
                                  f"{room} new tokens fit", "context_length_exceeded")
        return max_tokens

    async def prepare_completion(self, body: CompletionBody) -> Prepared:
        kw, stream, include_usage = self._common(body)
        prompt = body.prompt
        if prompt is None:
            raise _bad("prompt", "prompt is required", "missing_required_parameter")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise _bad("prompt", f"only one prompt per request is supported, got a list of "
                                     f"{len(prompt)}")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if self.llm.tokenizer is None:
                raise _bad("prompt", "this model has no tokenizer; send token ids")
            encode = self.llm.tokenizer.encode
            ids = (encode(prompt) if len(prompt) <= INLINE_ENCODE_CHARS
                   else await run_in_threadpool(encode, prompt))
        else:
            ids = list(prompt)
        kw["max_new_tokens"] = self._max_tokens(ids, "prompt", body.max_tokens, "max_tokens",
                                                COMPLETIONS_DEFAULT_MAX_TOKENS)
        return Prepared(ids, self._params(kw), stream, include_usage, "prompt")

    async def prepare_chat(self, body: ChatBody) -> Prepared:
        kw, stream, include_usage = self._common(body)
        if body.messages is None:
            raise _bad("messages", "messages is required", "missing_required_parameter")
        if not body.messages:
            raise _bad("messages", "messages must be a non-empty list")
        if self.llm.tokenizer is None:
            raise _bad("messages", "this model has no tokenizer, so chat is unavailable")
        template = self.llm.tokenizer.apply_chat_template
        try:
            ids = await run_in_threadpool(template, body.messages)
        except TokenizerError as e:
            raise _bad("messages", str(e)) from e
        if body.max_completion_tokens is not None:
            max_tokens, max_param = body.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, max_param = body.max_tokens, "max_tokens"
        kw["max_new_tokens"] = self._max_tokens(ids, "messages", max_tokens, max_param, None)
        return Prepared(ids, self._params(kw), stream, include_usage, "messages")

    @staticmethod
    def _params(kw: dict[str, Any]) -> SamplingParams:
        try:
            return SamplingParams(**kw)
        except ValueError as e:
            raise _bad(None, str(e)) from e

    # ---- engine round trip -------------------------------------------------------------------

    async def start(self, prep: Prepared, http: Request) -> Handle:
        """Submits the request and waits for the engine to accept it; raises APIError."""
        waiting = self.active - self.engine.snapshot.running
        if waiting >= self.max_queue:
            raise APIError(503, f"the server is busy: {waiting} requests are already waiting "
                                f"(--max-queue {self.max_queue}); retry later", None,
                           "queue_full", "server_error", headers={"Retry-After": "1"})
        req = self.llm.make_request(prep.prompt_ids, prep.params)
        h = Handle(req, asyncio.get_running_loop())
        self.active += 1
        self.engine.submit(h)
        try:
            item = await h.next(http)
        except BaseException:
            self.close(h)
            raise
        if item[0] == "accepted":
            return h
        h.finished = True
        self.close(h)
        if item[0] == "rejected":
            raise _bad(prep.prompt_param, f"request rejected: {item[1]} ({prep.prompt_param}: "
                                          f"{len(prep.prompt_ids)} tokens, max_tokens: "
                                          f"{prep.params.max_new_tokens})")
        raise APIError(500, str(item[1]), None, "engine_error", "server_error")

    def close(self, h: Handle) -> None:
        """Ends the HTTP side of a request once; a request that did not finish is aborted (by the
        engine thread, which frees its pages)."""
        if h.closed:
            return
        h.closed = True
        self.active -= 1
        h.cancel_getter()
        if not h.finished:
            self.engine.abort(h)

    def final_text(self, ids: list[int], text_end: int | None) -> str:
        text = self.llm.decode(ids)
        return text if text_end is None else text[:text_end]

    async def collect(self, h: Handle, http: Request) -> tuple[list[int], str, str]:
        """Waits for the whole answer; returns (ids, text, finish_reason)."""
        ids: list[int] = []
        try:
            while True:
                item = await h.next(http)
                if item[0] == "error":
                    h.finished = True
                    raise APIError(500, str(item[1]), None, "engine_error", "server_error")
                _, new, reason, text_end = item
                ids += new
                if reason is not None:
                    h.finished = True
                    return ids, self.final_text(ids, text_end), reason
        finally:
            self.close(h)

    async def stream(self, h: Handle, http: Request, prep: Prepared,
                     chunk: Callable[[str | None, str | None], dict[str, Any]],
                     usage_chunk: Callable[[dict[str, int]], dict[str, Any]],
                     first: dict[str, Any] | None) -> AsyncIterator[str]:
        """SSE lines for one request. Text is decoded incrementally; with stop strings, the last
        (longest stop - 1) characters are held back until the next tokens show they do not start
        a stop string, so no text past a stop string ever leaves."""
        dec = (self.llm.tokenizer.stream_decoder(skip_special_tokens=True)
               if self.llm.tokenizer else None)
        hold = max((len(s) for s in prep.params.stop), default=1) - 1
        ids: list[int] = []
        text, sent = "", 0
        try:
            if first is not None:
                yield _sse(first)
            while True:
                item = await h.next(http)
                if item[0] == "error":
                    h.finished = True
                    yield _sse(APIError(500, str(item[1]), None, "engine_error",
                                        "server_error").body())
                    break
                _, new, reason, text_end = item
                ids += new
                if reason is None:
                    if dec is not None:
                        text += dec.push(new)
                    end = len(text) - hold
                    if end > sent:
                        yield _sse(chunk(text[sent:end], None))
                        sent = end
                    continue
                h.finished = True
                # The final text comes from one decode of all ids, exactly as without
                # streaming; what was sent is a prefix of it (see the docstring).
                full = self.final_text(ids, text_end)
                if len(full) > sent:
                    yield _sse(chunk(full[sent:], None))
                yield _sse(chunk(None, reason))
                if prep.include_usage:
                    yield _sse(usage_chunk(_usage(len(prep.prompt_ids), len(ids))))
                break
            yield "data: [DONE]\n\n"
        except ClientGone:
            pass
        finally:
            self.close(h)


def _envelope(rid: str, created: int, model: str, kind: str, prep: Any) -> Any:
    """The OpenAI response object builder shared by completions and chat: `(choices, usage)`
    -> the object; usage appears on non-streamed responses, on the final streamed chunk, and on
    every streamed chunk (as null) when the client asked for usage."""

    def obj(choices: list[dict[str, Any]], usage: dict[str, int] | None) -> dict[str, Any]:
        o: dict[str, Any] = {"id": rid, "object": kind, "created": created, "model": model,
                             "choices": choices}
        if usage is not None or not prep.stream or prep.include_usage:
            o["usage"] = usage
        return o

    return obj


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _SSEResponse(StreamingResponse):
    """A stream whose request is closed however the response ends, even when the client leaves
    before the body generator has started (its `finally` would then never run)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _CountStatus:
    """Counts responses by endpoint and status. A plain ASGI wrapper: Starlette's
    BaseHTTPMiddleware would interpose on streams and delay disconnect detection."""

    def __init__(self, app: ASGIApp, counts: Counter[tuple[str, int]]):
        self.app, self.counts = app, counts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else "other"

        async def counting_send(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                self.counts[(endpoint, int(msg["status"]))] += 1
            await send(msg)

        await self.app(scope, receive, counting_send)


# ---- metrics -----------------------------------------------------------------------------------


def _metrics_text(srv: Server) -> str:
    s = srv.engine.snapshot
    out: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        for labels, v in samples:
            out.append(f"{name}{labels} {v:g}" if isinstance(v, float) else f"{name}{labels} {v}")

    by_status = sorted(srv.status_counts.items())
    metric("kimi_requests_total", "counter", "HTTP responses by endpoint and status code.",
           [(f'{{endpoint="{e}",status="{c}"}}', n) for (e, c), n in by_status])
    metric("kimi_requests_finished_total", "counter",
           "Engine requests finished, by reason (stop, length, abort).",
           [(f'{{reason="{r}"}}', n) for r, n in sorted(s.finished.items())])
    metric("kimi_prompt_tokens_total", "counter", "Prompt tokens of accepted requests.",
           [("", s.prompt_tokens)])
    metric("kimi_generation_tokens_total", "counter", "Generated tokens.",
           [("", s.generated_tokens)])
    metric("kimi_preemptions_total", "counter", "Requests preempted for KV pages.",
           [("", s.preemptions)])
    metric("kimi_queue_depth", "gauge", "Requests waiting for a batch slot.",
           [("", max(s.waiting, srv.active - s.running))])
    metric("kimi_running_requests", "gauge", "Requests in the running batch.", [("", s.running)])
    metric("kimi_kv_pages_free", "gauge", "Free KV cache pages.", [("", s.kv_pages_free)])
    metric("kimi_kv_pages_total", "gauge", "Usable KV cache pages.", [("", s.kv_pages_total)])
    cum, buckets = 0, []
    for i, n in enumerate(s.accept_hist):
        cum += n
        buckets.append((f'_bucket{{le="{i + 1}"}}', cum))
    buckets += [('_bucket{le="+Inf"}', cum), ("_sum", s.accept_sum), ("_count", cum)]
    metric("kimi_accepted_tokens_per_step", "histogram",
           "Tokens emitted per request per speculative step (accepted drafts + 1).", buckets)
    metric("kimi_engine_steps_total", "counter", "Scheduler steps.", [("", s.steps)])
    metric("kimi_engine_step_seconds_total", "counter",
           "Wall time inside scheduler steps (prefill, scheduling and spec steps).",
           [("", float(s.step_seconds))])
    metric("kimi_step_phase_seconds_total", "counter", "Wall time per spec-step phase.",
           [(f'{{phase="{p}"}}', float(t)) for p, t in sorted(s.phase_seconds.items())])
    return "\n".join(out) + "\n"


# ---- app ---------------------------------------------------------------------------------------


def build_app(llm: LLM, served_model_name: str, max_queue: int = 256) -> FastAPI:
    srv = Server(llm, served_model_name, max_queue)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        srv.engine.start()
        try:
            yield
        finally:
            srv.engine.stop()

    app = FastAPI(title="kimi-spec", lifespan=lifespan)
    app.state.server = srv

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(list(exc.errors()), exc.body).response()

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, exc: ClientGone) -> Response:
        # Nobody reads this; 499 (nginx's "client closed request") keeps the count honest.
        return Response(status_code=499)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return APIError(exc.status_code, str(exc.detail), None, code).response()

    @app.exception_handler(Exception)
    async def _internal(http: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        # NOTE: this handler runs outside _CountStatus, so count its response here.
        path = http.url.path
        srv.status_counts[(path if path in ENDPOINTS else "other", 500)] += 1
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}", None,
                        "internal_error", "server_error").response()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        s = srv.engine.snapshot
        return {"status": "ok", "model": srv.name, "max_model_len": llm.max_model_len,
                "running": s.running, "waiting": s.waiting, "active": srv.active,
                "kv_pages_free": s.kv_pages_free, "kv_pages_total": s.kv_pages_total,
                "preemptions": s.preemptions}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(_metrics_text(srv),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": srv.name, "object": "model", "created": srv.created, "owned_by": "kimi-spec",
            "max_model_len": llm.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(http: Request) -> Response:
        prep = await srv.prepare_completion(await _parse(http, CompletionBody))
        h = await srv.start(prep, http)
        obj = _envelope(f"cmpl-{uuid.uuid4().hex}", int(time.time()), srv.name,
                        "text_completion", prep)

        if prep.stream:
            def chunk(text: str | None, reason: str | None) -> dict[str, Any]:
                return obj([{"index": 0, "text": text or "", "logprobs": None,
                             "finish_reason": reason}], None)

            return _SSEResponse(
                srv.stream(h, http, prep, chunk, lambda u: obj([], u), None),
                lambda: srv.close(h))
        ids, text, reason = await srv.collect(h, http)
        return JSONResponse(obj([{"index": 0, "text": text, "logprobs": None,
                                  "finish_reason": reason}],
                                _usage(len(prep.prompt_ids), len(ids))))

    @app.post("/v1/chat/completions")
    async def chat(http: Request) -> Response:
        prep = await srv.prepare_chat(await _parse(http, ChatBody))
        h = await srv.start(prep, http)
        obj = _envelope(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), srv.name,
                        "chat.completion.chunk" if prep.stream else "chat.completion", prep)

        if prep.stream:
            def chunk(text: str | None, reason: str | None) -> dict[str, Any]:
                delta = {} if text is None else {"content": text}
                return obj([{"index": 0, "delta": delta, "logprobs": None,
                             "finish_reason": reason}], None)

            first = obj([{
                "index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}], None)
            return _SSEResponse(
                srv.stream(h, http, prep, chunk, lambda u: obj([], u), first),
                lambda: srv.close(h))
        ids, text, reason = await srv.collect(h, http)
        return JSONResponse(obj([{
            "index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": reason}], _usage(len(prep.prompt_ids), len(ids))))

    # Outside the exception handlers, so their error responses are counted too.
    app.add_middleware(_CountStatus, counts=srv.status_counts)
    return app


# ---- command line ------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m engine.serve",
                                description="OpenAI-compatible server for Kimi models with "
                                            "speculative decoding")
    add_model_args(p)
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default=None,
                   help="float32 / bfloat16 / float16 (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context limit (default: the model's max_position_embeddings)")
    p.add_argument("--kv-pages", type=int, default=None,
                   help="KV pool pages (default: enough for every batch slot at full context)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests allowed to wait for a batch slot before 503")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the model directory's name)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks: run under torchrun --nproc-per-node N; rank 0 "
                        "serves HTTP")
    p.add_argument("--tp-timeout", type=float, default=30.0,
                   help="seconds without a heartbeat from a peer rank before exiting")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))
    args = p.parse_args(argv)
    if args.max_queue < 1:
        p.error(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.port < 0 or args.port > 65535:
        p.error(f"--port must be in [0, 65535], got {args.port}")
    if args.tp < 1:
        p.error(f"--tp must be >= 1, got {args.tp}")
    return args


def main(argv: list[str] | None = None) -> None:
    import torch
    import uvicorn

    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    llm = LLM(args.model, args.draft, mode=args.mode, budget=args.budget,
              max_batch_size=args.max_batch_size, device=device, dtype=dtype,
              page_size=args.page_size, max_model_len=args.max_model_len,
              kv_pages=args.kv_pages, progress=True, tp=args.tp, tp_timeout=args.tp_timeout,
              budget_policy=args.budget_policy)
    if not llm.is_leader:
        # Tensor-parallel ranks > 0 serve nothing: they run rank 0's model calls until it stops.
        from engine.parallel import PeerLost

        try:
            llm.close()
        except PeerLost as e:
            log.error("%s", e)
            sys.exit(1)
        return
    name = args.served_model_name or llm.model_dir.resolve().name
    app = build_app(llm, name, args.max_queue)
    log.info("serving %r on http://%s:%d (max_model_len %d, %d KV pages)", name, args.host,
             args.port, llm.max_model_len, llm.scheduler.alloc.capacity)
    try:
        # A bounded graceful shutdown: open streams must not keep the process alive.
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=5)
    finally:
        llm.close()
    fatal = app.state.server.engine.fatal
    if fatal:
        log.error("stopped: %s", fatal)
        sys.exit(1)


if __name__ == "__main__":
    main()
