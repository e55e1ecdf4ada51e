"""Routes, admission and streaming: `GET /v1/models`, `POST /v1/completions` and
`/v1/chat/completions` (`stream`: server-sent events ending in `data: [DONE]`), `GET /health`,
`GET /metrics`. `max_tokens` defaults to 16 for completions, the context's rest for chat. Chat
answers are read by `engine.toolcalls.OutputStream` (Kimi's tool calls and reasoning)."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from engine.llm import LLM
from engine.scheduler import RequestRejected
from engine.serve import protocol as api
from engine.serve.worker import ClientGone, Engine, Handle
from engine.tokenizer import TokenizerError
from engine.toolcalls import OutputDelta, OutputStream

log = logging.getLogger("engine.serve")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
Body = api.CompletionRequest | api.ChatRequest


class Server:
    """HTTP-side state: the engine, the served name, admission."""

    def __init__(self, llm: LLM, served_model_name: str, max_queue: int = 256,
                 threads: int | None = None):
        self.llm, self.name, self.max_queue = llm, served_model_name, max_queue
        self.engine = Engine(llm, threads)
        self.created = int(time.time())
        self.active = 0  # requests submitted and not yet closed (event-loop thread only)
        self.engine.metrics.queue_depth.set_function(lambda: max(self.engine.snapshot["waiting"],
                                                                 self.waiting))

    @property
    def waiting(self) -> int:  # handed to the engine, not running yet
        return self.active - self.engine.snapshot["running"]

    async def admit(self, body: Body) -> tuple[list[int], Handle, OutputStream | None]:
        """The prompt's token ids, checked against the context, the request handed to the engine
        (or why it cannot run), and the reader of its answer (None without a tokenizer)."""
        if body.model is not None and body.model != self.name:
            raise api.error(404, f"The model '{body.model}' does not exist; this server serves "
                                 f"'{self.name}'", "model", "model_not_found")
        tok, chat = self.llm.tokenizer, isinstance(body, api.ChatRequest)
        param, prompt, kw = (("messages", *body.template_inputs()) if chat
                             else ("prompt", body.one_prompt(), {}))
        if tok is None and (chat or isinstance(prompt, str) or body.stop):
            raise api.bad("stop" if body.stop else param, "this model has no tokenizer: send "
                                                          "token ids and no stop strings")
        try:
            ids = (list(prompt) if not chat and isinstance(prompt, list) else await
                   run_in_threadpool(tok.apply_chat_template if chat else tok.encode, prompt, **kw))
        except TokenizerError as e:
            raise api.bad(param, str(e)) from e
        n, limit = len(ids), self.llm.max_model_len
        if n + 1 > limit:
            raise api.bad(param, f"{param} has {n} tokens, but this model's context limit is "
                                 f"{limit} tokens (prompt plus at least one new token)",
                          "context_length_exceeded")
        want, what = body.max_tokens, "max_tokens"
        if chat and body.max_completion_tokens is not None:
            want, what = body.max_completion_tokens, "max_completion_tokens"
        if want is not None and want > limit - n:
            raise api.bad(what, f"{what} is {want}, but the context limit is {limit} tokens and "
                                f"the {param} has {n}: at most {limit - n} new tokens fit",
                          "context_length_exceeded")
        params = body.sampling_params(want or min(limit if chat else COMPLETIONS_DEFAULT_MAX_TOKENS,
                                                   limit - n))
        out = OutputStream(tok, ids, params.stop, **body.parsing() if chat else {}) if tok else None
        if self.waiting >= self.max_queue:
            raise api.error(503, f"the server is busy: {self.waiting} requests are already "
                                 f"waiting (--max-queue {self.max_queue}); retry later", None,
                            "queue_full", "server_error", headers={"Retry-After": "1"})
        h = Handle(self.llm.make_request(ids, params), stream=body.stream)
        try:
            self.engine.submit(h)
        except RequestRejected as e:
            raise api.bad(param, f"request rejected: {e} ({param}: {len(ids)} tokens, "
                                 f"max_tokens: {params.max_new_tokens})") from e
        self.active += 1
        return ids, h, out

    def close(self, h: Handle) -> None:
        """Ends the HTTP side of a request once, aborting it if it still runs (the engine loop
        frees its pages; it ignores a finished request)."""
        if not h.closed:
            h.closed = True
            self.active -= 1
            self.engine.post("abort", h)

    async def text(self, h: Handle, http: Request, out: OutputStream | None
                   ) -> AsyncIterator[tuple[OutputDelta, str | None, int]]:
        """`(new part of the answer, finish reason or None, tokens so far)` as the request runs
        (`out.result()` is then the whole answer)."""
        n = 0
        try:
            while True:
                item = await h.next(http)
                if item[0] == "error":
                    raise api.error(500, str(item[1]), None, "engine_error", "server_error")
                _, new, reason, text_end = item
                n += len(new)
                if reason is not None:
                    last = out.end(new, text_end) if out else OutputDelta()
                    yield last, out.finish_reason(reason) if out else reason, n
                    return
                if piece := out.push(new) if out else None:
                    yield piece, None, n
        finally:
            self.close(h)


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


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def build_app(llm: LLM, served_model_name: str, max_queue: int = 256,
              threads: int | None = None) -> FastAPI:
    srv = Server(llm, served_model_name, max_queue, threads)

    app = FastAPI(title="kimi-spec", lifespan=lambda _: srv.engine.running())
    app.state.server = srv
    # 499 (nginx's "client closed request"): nobody reads it, the count stays honest.
    app.add_exception_handler(ClientGone, lambda _, e: Response(status_code=499))

    @app.exception_handler(HTTPException)  # ours carry OpenAI's body; Starlette's get one too
    async def _error(_: Request, e: HTTPException) -> JSONResponse:
        body = e.detail if isinstance(e.detail, dict) else api.error(
            e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None
        ).detail
        return JSONResponse(body, e.status_code, e.headers)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(api.error(500, f"internal error: {type(exc).__name__}: {exc}", None,
                                      "internal_error", "server_error").detail, 500)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": srv.name, "max_model_len": llm.max_model_len,
                "active": srv.active, **srv.engine.snapshot}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": srv.name, "object": "model", "created": srv.created, "owned_by": "kimi-spec",
            "max_model_len": llm.max_model_len}]}

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def respond(http: Request) -> Response:
        chat = http.url.path.endswith("/chat/completions")
        body = api.parse(await http.body(), api.ChatRequest if chat else api.CompletionRequest)
        ids, h, out = await srv.admit(body)
        kind = "chat.completion" + (".chunk" if body.stream else "") if chat else "text_completion"
        head = dict(id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", object=kind,
                    created=int(time.time()), model=srv.name)

        def obj(choices: list[Any], n: int | None = None) -> dict[str, Any]:
            """A response or chunk; `usage` once known (null in earlier chunks, when asked)."""
            out = {**head, "choices": choices}
            if n is not None or body.include_usage:
                out["usage"] = None if n is None else {
                    "prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}
            return out

        def choice(fields: dict[str, Any], reason: str | None, role: str | None = None) -> Any:
            c = {"index": 0, "logprobs": None, "finish_reason": reason}
            if not chat:
                return {**c, "text": fields.get("content") or ""}
            # role and content always; reasoning and tool calls only when the model made some
            set_ = {k: v for k, v in fields.items() if v is not None}
            msg = {"role": role, "content": None, **set_}
            return {**c, "delta" if body.stream else "message": msg}

        if not body.stream:
            *_, (_, reason, n) = [p async for p in srv.text(h, http, out)]
            fields = out.result().to_openai() if out else {}
            return JSONResponse(obj([choice(fields, reason, "assistant")], n))

        async def events() -> AsyncIterator[str]:
            try:
                if chat:
                    yield _sse(obj([choice({"content": ""}, None, "assistant")]))
                async for piece, reason, n in srv.text(h, http, out):
                    if piece:
                        yield _sse(obj([choice(piece.to_openai(), None)]))
                    if reason is not None:
                        yield _sse(obj([choice({}, reason)]))
                        if body.include_usage:
                            yield _sse(obj([], n))
                yield "data: [DONE]\n\n"
            except HTTPException as e:
                yield _sse(e.detail)
            except ClientGone:
                pass

        return _SSEResponse(events(), lambda: srv.close(h))

    srv.engine.metrics.instrument(app)
    return app
