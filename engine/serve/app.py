"""Routes, admission and streaming: `GET /v1/models`, `POST /v1/completions` and
`/v1/chat/completions` (`stream`: server-sent events ending in `data: [DONE]`), vLLM's
`POST /tokenize` and `/detokenize`, `GET /health`, `GET /metrics`; OpenAI's Responses API
(`/v1/responses`, `engine.serve.responses`) and Anthropic's Messages API (`/v1/messages`,
`engine.serve.anthropic`) on the same chat path. `max_tokens` defaults to 16
for completions, the context's rest for chat. Chat answers are read by
`engine.toolcalls.OutputStream` (Kimi's tool calls and reasoning).

`n` choices are n engine requests over the same prompt ids (`choice_params`: with a `seed`,
choice i samples with seed + i, as vLLM does; greedy choices are identical); their chunks are
interleaved as they come, each with its `index`; usage counts the prompt once and every
choice's tokens; a client that leaves, or a choice that fails, aborts them all.
`parallel_tool_calls` false keeps the first call the parser returns (its first well-formed
one) and drops the rest, streamed or not (`protocol.ToolLimit`); a forced call (`tool_choice`
"required" or a named function) or a JSON `response_format` is a grammar the engine enforces
(`Server.constrain`, `engine.grammar`), so the answer is well-formed (and then holds one call
without parallel calls). Log-probabilities come in OpenAI's shapes (`chat_logprobs`,
`CompletionLogprobs`), streamed with the chunk that carries their tokens' step (or the
next); `echo` puts the prompt before a completion, with its tokens' log-probabilities when
asked (the first has none).

No one request may hurt another: `Guard` checks the Host, the API key and the body's type before
a route runs; a body is read within `--request-timeout` and `--max-body-bytes`, parsed with its
lists bounded, and a text whose bytes already prove it too long is refused before it is
tokenized; templating and tokenizing run on worker threads; a client that leaves is an abort
(status 499), never an error; `uvicorn_options` bounds connections, idle time and the time to
send the headers."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import ipaddress
import json
import logging
import math
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import h11
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.config import Logprob, SamplingParams, choice_seed
from engine.grammar import (
    GrammarError,
    json_or_tool_call_grammar,
    json_schema_grammar,
    reasoning_prefix,
    tool_call_grammar,
)
from engine.media import (
    Image,
    MediaError,
    expand_placeholders,
    fetch_url,
    load_image_source,
    message_images,
)
from engine.request import RequestRejected
from engine.serve import anthropic, responses
from engine.serve import protocol as api
from engine.serve.options import ServeConfig
from engine.serve.worker import ClientGone, Engine, Handle, ModelInfo
from engine.tokenizer import TokenizerError
from engine.toolcalls import (
    OutputDelta,
    OutputStream,
    ids_open_reasoning,
)

log = logging.getLogger("engine.serve")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
# Routes outside /v1 that need the API key too: vLLM guards only /v1, but these template and
# tokenize whole bodies (and show the chat template's work) for whoever asks.
KEYED_PATHS = frozenset({"/tokenize", "/detokenize"})
Body = api.CompletionRequest | api.ChatRequest
Item = tuple[OutputDelta, str | None, int, list[Logprob] | None]
T = TypeVar("T")


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The sampling of each of `n` choices: `params` with choice i's seed (`choice_seed`), so
    choice i of a seeded request equals a request of n 1 with seed + i."""
    return [params if n == 1 or params.seed is None
            else dataclasses.replace(params, seed=choice_seed(params.seed, i)) for i in range(n)]


async def merged(gens: list[AsyncIterator[Item]]) -> AsyncIterator[tuple[int, Item]]:
    """`(choice index, item)` from every generator as each item comes; leaving early (an error,
    the client gone) cancels the rest, which closes their requests."""
    if len(gens) == 1:
        async with contextlib.aclosing(gens[0]) as only:
            async for item in only:
                yield 0, item
        return
    pending = {asyncio.ensure_future(anext(g)): i for i, g in enumerate(gens)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for t in sorted(done, key=pending.__getitem__):
                i = pending.pop(t)
                try:
                    item = t.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(gens[i]))] = i
                yield i, item
    finally:
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await asyncio.gather(*(g.aclose() for g in gens), return_exceptions=True)


def _longest_token_bytes(tok: Any) -> int:
    """The most UTF-8 bytes one token stands for: a text of B bytes is at least B / this many
    tokens, whatever the tokenizer does with it."""
    ordinary = max(map(len, tok.encoding.token_byte_values()), default=1)
    return max(ordinary, *(len(s.encode()) for s in tok.special_tokens), 1)


class Server:
    """HTTP-side state: what it knows of the model, the engine, the served name, admission."""

    def __init__(self, model: ModelInfo, engine: Engine, served_model_name: str,
                 max_queue: int = 256, config: ServeConfig | None = None):
        self.model, self.name, self.max_queue = model, served_model_name, max_queue
        self.cfg = config or ServeConfig()
        self.token_bytes = _longest_token_bytes(model.tokenizer) if model.tokenizer else 0
        self.engine = engine
        self.created = int(time.time())
        self.active = 0  # requests submitted and not yet closed (event-loop thread only)
        self.engine.metrics.queue_depth.set_function(lambda: max(self.engine.snapshot["waiting"],
                                                                 self.waiting))

    @property
    def waiting(self) -> int:  # handed to the engine, not running yet
        return self.active - self.engine.snapshot["running"]

    async def read(self, http: Request, model: type[T]) -> T:
        """The body, read within `--request-timeout` (else 408) and `--max-body-bytes` (else
        413, without reading past the limit), parsed; a client that leaves raises ClientGone."""
        return await self.read_as(http, functools.partial(api.parse, model=model))

    async def read_as(self, http: Request, parser: Callable[..., T]) -> T:
        """The body as `read` reads it, parsed by `parser(raw, limit=...)`."""
        limit, timeout = self.cfg.max_body_bytes, self.cfg.request_timeout
        size = http.headers.get("content-length", "")
        if size.isdigit() and int(size) > limit:
            raise api.too_large(size, limit)
        raw = bytearray()
        try:
            async with asyncio.timeout(timeout):
                async for chunk in http.stream():
                    raw += chunk
                    if len(raw) > limit:
                        raise api.too_large(f"more than {limit}", limit)
        except TimeoutError:
            raise api.error(408, f"the request body did not arrive within {timeout:g} s "
                                 f"(--request-timeout)", None, "request_timeout",
                            headers={"Connection": "close"}) from None
        except ClientDisconnect:
            raise ClientGone() from None
        return parser(bytes(raw), limit=limit)  # NOTE: bounded work (api.MAX_JSON_COST)

    def tokenizer(self, param: str) -> Any:
        """The tokenizer, or a 400 naming `param` when this model has none."""
        if self.model.tokenizer is None:
            raise api.bad(param, "this model has no tokenizer")
        return self.model.tokenizer

    def check_ranges(self, body: Body) -> None:
        """What the body's own fields cannot know: ranges set by this model."""
        vocab = self.model.vocab_size
        if body.top_k > vocab:
            raise api.bad("top_k", f"top_k is {body.top_k}, but this model's vocabulary has "
                                   f"{vocab} tokens (-1 or 0: no top-k)")

    def check_bytes(self, param: str, nbytes: int) -> None:
        """Refuses, before tokenizing, a text of `nbytes` UTF-8 bytes that cannot fit the
        context however it is tokenized (each token stands for at most `token_bytes` bytes)."""
        limit = self.model.max_model_len
        if self.token_bytes and nbytes > self.token_bytes * (limit - 1):
            raise api.bad(param, f"{param} has {nbytes} bytes of text, at least "
                                 f"{math.ceil(nbytes / self.token_bytes)} tokens, but this "
                                 f"model's context limit is {limit} tokens",
                          "context_length_exceeded")

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise api.error(404, f"The model '{model}' does not exist; this server serves "
                                 f"'{self.name}'", "model", "model_not_found")

    async def admit(self, body: Body
                    ) -> tuple[list[int], list[Handle], list[OutputStream | None]]:
        """The prompt's token ids, checked against the context, the requests of its `n`
        choices handed to the engine (or why they cannot run: then none is), and the readers of
        their answers (None without a tokenizer)."""
        self.check_model(body.model)
        tok, chat = self.model.tokenizer, isinstance(body, api.ChatRequest)
        param, prompt, kw = (("messages", *body.template_inputs()) if chat
                             else ("prompt", body.one_prompt(), {}))
        if tok is None and not chat and (body.echo or body.logprobs is not None):
            raise api.bad("echo" if body.echo else "logprobs", "this model has no tokenizer to "
                                                               "write tokens as text with")
        if tok is None and (chat or isinstance(prompt, str) or body.stop):
            raise api.bad("stop" if body.stop else param, "this model has no tokenizer: send "
                                                          "token ids and no stop strings")
        self.check_ranges(body)
        if chat or isinstance(prompt, str):
            self.check_bytes(param, body.content_bytes() if chat else len(
                prompt.encode("utf-8", "surrogatepass")))
        images = await self.images(param, prompt) if chat else []
        try:
            ids = (list(prompt) if not chat and isinstance(prompt, list) else await
                   run_in_threadpool(tok.apply_chat_template if chat else tok.encode, prompt, **kw))
        except TokenizerError as e:
            raise api.bad(param, str(e)) from e
        ids, placed = self.expand(param, ids, images)
        n, limit = len(ids), self.model.max_model_len
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
        if chat:
            params = await self.constrain(body, ids, params)
        if self.waiting + body.n > self.max_queue:
            raise api.error(503, f"the server is busy: {self.waiting} requests are already "
                                 f"waiting (--max-queue {self.max_queue}); retry later", None,
                            "queue_full", "server_error", headers={"Retry-After": "1"})
        handles: list[Handle] = []
        try:
            for p in choice_params(params, body.n):
                h = Handle(self.model.make_request(ids, p, placed), stream=body.stream)
                self.engine.submit(h)
                self.active += 1
                handles.append(h)
        except RequestRejected as e:
            for h in handles:
                self.close(h)
            if e.param is not None:
                raise api.bad(e.param, f"request rejected: {e}") from e
            raise api.bad(param, f"request rejected: {e} ({param}: {len(ids)} tokens, "
                                 f"max_tokens: {params.max_new_tokens})") from e
        outs = [OutputStream(tok, ids, params.stop, **body.parsing() if chat else {},
                             request_tools=kw.get("tools")) if tok else None for _ in handles]
        return ids, handles, outs

    async def images(self, param: str, messages: list[dict[str, Any]]) -> list[Image]:
        """The images of a conversation's image parts, decoded and preprocessed off the event
        loop: `data:` URLs, and http(s) URLs with `--allow-image-urls` (at most
        `--max-body-bytes` each); a video part, too many images, or a bad image is a 400 naming
        the part."""
        try:
            found = message_images(messages, param)
        except MediaError as e:
            raise api.bad(param, str(e)) from e
        if not found:
            return []
        if self.model.image_pad is None:
            raise api.bad(param, f"{found[0][0]}: this model takes no images (it has no vision "
                                 f"tower)")
        limit = self.cfg.limit_mm_per_prompt
        if limit is not None and len(found) > limit:
            raise api.bad(param, f"{param} holds {len(found)} images; at most {limit} per prompt "
                                 f"(--limit-mm-per-prompt)")
        media, cfg = self.model.media, self.cfg
        fetch = (functools.partial(fetch_url, timeout=cfg.image_fetch_timeout,
                                   max_bytes=cfg.max_body_bytes)
                 if cfg.allow_image_urls else None)
        try:
            return await run_in_threadpool(
                lambda: [load_image_source(src, media, name, fetch=fetch) for name, src in found])
        except MediaError as e:
            raise api.bad(param, str(e)) from e

    def expand(self, param: str, ids: list[int], images: list[Image]
               ) -> tuple[list[int], list[tuple[int, Image]]]:
        """`ids` with each image's placeholder expanded to its tokens, and where each image
        starts (`engine.media.expand_placeholders`)."""
        if not images:
            return ids, []
        assert self.model.image_pad is not None
        try:
            return expand_placeholders(ids, images, self.model.image_pad, param)
        except MediaError as e:
            raise api.bad(param, str(e)) from e

    async def constrain(self, body: api.ChatRequest, ids: list[int], params: SamplingParams
                        ) -> SamplingParams:
        """`params` with the grammar of the body's forced tool call or JSON response format
        (or that answer, or a call of the tools the model may call), after the reasoning of a
        thinking model's prompt, compiled off the event loop; a 400 naming the field when it
        cannot be enforced."""
        tools, schema = body.forced_tools, body.answer_schema
        if tools is None and schema is None:
            return params
        tok, grammars = self.model.tokenizer, self.model.grammars
        param = "tools" if tools is not None else "response_format"
        if grammars is None:
            raise api.bad(param, f"{param}: this model cannot enforce a grammar (it has no "
                                 f"tokenizer)")
        opened = body.parsing()["reasoning"] and ids_open_reasoning(tok, ids)
        reasoning = reasoning_prefix(tok, opened)
        parallel = body.parallel_tool_calls is not False
        if tools is not None:
            grammar = tool_call_grammar(tok, [t.model_dump() for t in tools], parallel,
                                        reasoning)
        elif body.parsing()["tools"]:
            grammar = json_or_tool_call_grammar(tok, schema, [t.model_dump() for t in body.tools],
                                                parallel, reasoning)
        else:
            grammar = json_schema_grammar(schema, reasoning)
        try:
            await run_in_threadpool(grammars.check, grammar)
        except GrammarError as e:
            raise api.bad(param, f"{param}: the schema cannot be enforced: {e}") from e
        return dataclasses.replace(params, grammar=grammar)

    def close(self, h: Handle) -> None:
        """Ends the HTTP side of a request once, aborting it if it still runs (the engine loop
        frees its pages; it ignores a finished request)."""
        if not h.closed:
            h.closed = True
            self.active -= 1
            self.engine.post("abort", h)

    async def text(self, h: Handle, http: Request, out: OutputStream | None
                   ) -> AsyncIterator[Item]:
        """`(new part of the answer, finish reason or None, tokens so far, the new tokens'
        log-probabilities or None)` as the request runs (`out.result()` is then the whole
        answer)."""
        n = 0
        try:
            while True:
                item = await h.next(http)
                if item[0] == "error":
                    raise api.error(500, str(item[1]), None, "engine_error", "server_error")
                _, new, reason, text_end, logprobs, pieces, *_ = item
                n += len(new)
                if reason is not None:
                    last = out.end(new, text_end, pieces) if out else OutputDelta()
                    yield last, out.finish_reason(reason) if out else reason, n, logprobs
                    return
                piece = out.push(new, pieces) if out else None
                if piece or logprobs:
                    yield piece or OutputDelta(), None, n, logprobs
        finally:
            self.close(h)


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def build_app(llm: Any, served_model_name: str, max_queue: int = 256,
              threads: int | None = None, config: ServeConfig | None = None, *,
              model: ModelInfo | None = None, engine: Engine | None = None) -> FastAPI:
    """The app over `llm` (an `engine.llm.LLM`, its engine loop on a thread of this process),
    or over `model` and an `engine` whose core runs elsewhere (`engine.serve.procs`)."""
    if engine is None:
        model, engine = ModelInfo.of(llm), Engine(llm, threads)
    assert model is not None
    srv = Server(model, engine, served_model_name, max_queue, config)

    app = FastAPI(title="kimi-spec", lifespan=lambda _: srv.engine.running())
    app.state.server = srv
    # 499 (nginx's "client closed request"): nobody reads it, the count stays honest.
    @app.exception_handler(ClientGone)
    async def _gone(http: Request, _: ClientGone) -> Response:
        log.info("%s %s: the client left before its answer", http.method, http.url.path)
        return Response(status_code=499)

    @app.exception_handler(HTTPException)  # ours carry OpenAI's body; Starlette's get one too
    async def _error(http: Request, e: HTTPException) -> JSONResponse:
        body = e.detail if isinstance(e.detail, dict) else api.error(
            e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None
        ).detail
        return JSONResponse(anthropic.reshape(http.url.path, e.status_code, body),
                            e.status_code, e.headers)

    @app.exception_handler(Exception)
    async def _internal(http: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        # NOTE: the cause stays in the log: exception text is no client's business.
        return JSONResponse(anthropic.reshape(http.url.path, 500, api.error(
            500, "internal server error (the server log has the cause)", None,
            "internal_error", "server_error").detail), 500)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": srv.name, "max_model_len": model.max_model_len,
                "active": srv.active, **srv.engine.snapshot}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": srv.name, "object": "model", "created": srv.created, "owned_by": "kimi-spec",
            "max_model_len": model.max_model_len}]}

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def respond(http: Request) -> Response:
        chat = http.url.path.endswith("/chat/completions")
        body = await srv.read(http, api.ChatRequest if chat else api.CompletionRequest)
        ids, handles, outs = await srv.admit(body)
        limit = api.ToolLimit(body.parallel_tool_calls if chat else None)
        kind = "chat.completion" + (".chunk" if body.stream else "") if chat else "text_completion"
        head = dict(id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", object=kind,
                    created=int(time.time()), model=srv.name)
        gens = [srv.text(h, http, out) for h, out in zip(handles, outs)]

        def close_all() -> None:
            for h in handles:
                srv.close(h)

        def obj(choices: list[Any], n: int | None = None) -> dict[str, Any]:
            """A response or chunk; `usage` once known (null in earlier chunks, when asked)."""
            out = {**head, "choices": choices}
            if n is not None or body.include_usage:
                # NOTE: the prompt counts once, its cached tokens as choice 0's (the others
                # hit the pages it prefilled)
                out["usage"] = None if n is None else {
                    "prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n,
                    "prompt_tokens_details": {"cached_tokens": handles[0].req.cached_tokens}}
            return out

        tok = model.tokenizer
        # completions: each choice's log-probabilities writer (its text offsets run on)
        offsets = [CompletionLogprobs(tok) for _ in handles] if not chat and tok else []
        echo = not chat and body.echo

        def choice(i: int, fields: dict[str, Any], reason: str | None,
                   role: str | None = None, logprobs: list[Any] | None = None) -> Any:
            lp = None
            if logprobs is not None:
                lp = chat_logprobs(tok, logprobs) if chat else offsets[i](logprobs)
            c = {"index": i, "logprobs": lp, "finish_reason": reason}
            if not chat:
                return {**c, "text": fields.get("content") or ""}
            # role and content always; reasoning and tool calls only when the model made some
            set_ = {k: v for k, v in fields.items() if v is not None}
            msg = {"role": role, "content": None, **set_}
            return {**c, "delta" if body.stream else "message": msg}

        if echo:  # the prompt's text, once (echo needs a tokenizer: `admit` checked)
            prompt = body.one_prompt()
            echoed = prompt if isinstance(prompt, str) else tok.decode(ids,
                                                                       skip_special_tokens=True)

        def prompt_part(i: int) -> tuple[str, list[Any] | None]:
            """An echoed prompt's text, and its tokens' log-probabilities when asked (the
            engine has them once it returned the choice's first tokens)."""
            lps = handles[i].req.prompt_logprobs
            return echoed, None if lps is None else [*zip(ids, lps)]

        if not body.stream:
            last: dict[int, tuple[str | None, int]] = {}
            logprobs: dict[int, list[Any]] = {i: [] for i in range(len(handles))}
            try:
                async with contextlib.aclosing(merged(gens)) as items:
                    async for i, (_, reason, n, lps) in items:
                        last[i] = reason, n
                        logprobs[i] += lps or []
            finally:
                close_all()
            choices = []
            for i, out in enumerate(outs):
                fields = limit.result(out.result()).to_openai() if out else {}
                entries: list[Any] | None = None
                if handles[i].req.logprobs is not None:
                    entries = logprobs[i] if chat else [(x.token, x) for x in logprobs[i]]
                if echo:
                    text, prompt_lps = prompt_part(i)
                    fields = {"content": text + (fields.get("content") or "")}
                    if entries is not None and prompt_lps is not None:
                        entries = prompt_lps + entries
                choices.append(choice(i, fields, last[i][0], "assistant", entries))
            return JSONResponse(obj(choices, sum(n for _, n in last.values())))

        async def events() -> AsyncIterator[str]:
            tokens: dict[int, int] = {}
            pending: dict[int, list[Any]] = {}  # log-probabilities not sent yet, per choice
            echoed: set[int] = set()
            try:
                if chat:
                    for i in range(len(gens)):
                        yield _sse(obj([choice(i, {"content": ""}, None, "assistant")]))
                async with contextlib.aclosing(merged(gens)) as items:
                    async for i, (piece, reason, n, lps) in items:
                        if echo and i not in echoed:
                            echoed.add(i)
                            text, prompt_lps = prompt_part(i)
                            yield _sse(obj([choice(i, {"content": text}, None,
                                                   logprobs=prompt_lps)]))
                        if lps:
                            pending.setdefault(i, []).extend(
                                lps if chat else [(x.token, x) for x in lps])
                        if piece := limit.delta(piece):
                            yield _sse(obj([choice(i, piece.to_openai(), None,
                                                   logprobs=pending.pop(i, None))]))
                        if reason is not None:
                            tokens[i] = n
                            yield _sse(obj([choice(i, {}, reason, logprobs=pending.pop(i, None))]))
                if body.include_usage:
                    yield _sse(obj([], sum(tokens.values())))
                yield "data: [DONE]\n\n"
            except HTTPException as e:
                # the error as an event, then the end: a client's read loop ends as usual
                yield _sse(e.detail)
                yield "data: [DONE]\n\n"
            except ClientGone:
                pass

        return api.SSEResponse(events(), close_all)

    anthropic.register(app, srv)  # /v1/messages, /v1/messages/count_tokens
    responses.register(app, srv)  # /v1/responses

    @app.post("/tokenize")
    async def tokenize(http: Request) -> dict[str, Any]:
        """vLLM's: the ids the completion routes would feed the engine for a text or a
        conversation (`count`, `max_model_len`, `tokens`; `token_strs` with
        `return_token_strs`; extension: `prompt` with `return_prompt`, the rendered text)."""
        body = await srv.read_as(http, api.parse_tokenize)
        srv.check_model(body.model)
        tok = srv.tokenizer(param := "messages" if isinstance(
            body, api.TokenizeChatRequest) else "prompt")
        try:
            if isinstance(body, api.TokenizeChatRequest):
                srv.check_bytes(param, body.content_bytes())
                messages, kw = body.template_inputs()
                images = await srv.images(param, messages)
                ids = await run_in_threadpool(tok.apply_chat_template, messages, **kw)
                ids = srv.expand(param, ids, images)[0]
                text = (await run_in_threadpool(tok.render_chat_template, messages, **kw)
                        if body.return_prompt else None)
            else:
                srv.check_bytes(param, len(body.prompt.encode("utf-8", "surrogatepass")))
                ids, text = await run_in_threadpool(tok.encode, body.prompt), body.prompt
        except TokenizerError as e:
            raise api.bad(param, str(e)) from e
        out: dict[str, Any] = {"count": len(ids), "max_model_len": model.max_model_len,
                               "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = token_strs(tok, ids)
        if body.return_prompt:
            out["prompt"] = text
        return out

    @app.post("/detokenize")
    async def detokenize(http: Request) -> dict[str, Any]:
        """vLLM's: the text of token ids, special tokens written out (`{"prompt": str}`)."""
        body = await srv.read(http, api.DetokenizeRequest)
        srv.check_model(body.model)
        tok = srv.tokenizer("tokens")
        if (bad := next((t for t in body.tokens if not 0 <= t < tok.vocab_size), None)
                ) is not None:
            raise api.bad("tokens", f"tokens holds {bad}, which is not a token id of this "
                                    f"tokenizer (0 to {tok.vocab_size - 1})")
        try:
            return {"prompt": await run_in_threadpool(tok.decode, body.tokens)}
        except TokenizerError as e:
            raise api.bad("tokens", f"tokens: {e}") from e

    cfg = srv.cfg
    hosts, key = allowed_hosts(cfg), cfg.api_key or os.environ.get("KIMI_API_KEY") or None
    if hosts is None and key is None:
        log.warning("listening on %s with no API key (--api-key or KIMI_API_KEY): anyone who "
                    "can reach the port can use the model", cfg.host)
    app.add_middleware(Guard, hosts=hosts, api_key=key, reshape=anthropic.reshape)
    srv.engine.metrics.instrument(app)  # outside the guard: its refusals are counted too
    return app


def _token(tok: Any, token: int) -> tuple[str, list[int]]:
    """A token's text (`token_strs`) and its bytes."""
    return token_strs(tok, [token])[0], list(tok.decode_bytes([token]))


def chat_logprobs(tok: Any, logprobs: list[Logprob]) -> dict[str, Any]:
    """OpenAI's `choices[].logprobs` of a chat answer's tokens: `content`, one entry per token
    (`token`, `logprob`, `bytes`, `top_logprobs`: the same for the most likely tokens)."""
    def entry(token: int, logprob: float) -> dict[str, Any]:
        text, raw = _token(tok, token)
        return {"token": text, "logprob": logprob, "bytes": raw}

    return {"content": [{**entry(x.token, x.logprob),
                         "top_logprobs": [entry(t, v) for t, v in x.top]} for x in logprobs]}


class CompletionLogprobs:
    """OpenAI's completions `logprobs` of a choice's `(token, Logprob or None)` entries (None:
    an echoed prompt's first token, which has none): `tokens`, `token_logprobs`,
    `top_logprobs` (token text -> log-probability) and `text_offset`, each token's offset in
    the choice's text, running on from one call (a streamed chunk) to the next."""

    def __init__(self, tok: Any):
        self.tok, self.offset = tok, 0

    def __call__(self, entries: list[tuple[int, Logprob | None]]) -> dict[str, Any]:
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                     "text_offset": []}
        for token, lp in entries:
            top = lp.top if lp is not None else ()
            text, *names = token_strs(self.tok, [token, *(t for t, _ in top)])
            out["tokens"].append(text)
            out["token_logprobs"].append(None if lp is None else lp.logprob)
            out["top_logprobs"].append(None if lp is None else {
                name: v for name, (_, v) in zip(names, top)})
            out["text_offset"].append(self.offset)
            self.offset += len(self.tok.decode([token], skip_special_tokens=True))
        return out


def token_strs(tok: Any, ids: list[int]) -> list[str]:
    """Each id's text: a special token's name, else its bytes as UTF-8 (bytes of a character
    split across tokens as `\\xNN` escapes)."""
    names = tok.special_names
    return [names[i] if i in names else tok.decode_bytes([i]).decode("utf-8", "backslashreplace")
            for i in ids]


def allowed_hosts(cfg: ServeConfig) -> frozenset[str] | None:
    """The Host names `--allowed-hosts` accepts (None: any). By default a server bound to a
    loopback address answers only to loopback names, so a web page cannot reach it through a
    DNS name rebound to 127.0.0.1."""
    if cfg.allowed_hosts is not None:
        names = {h.strip().lower().strip("[]") for h in cfg.allowed_hosts.split(",")}
        return None if "*" in names else frozenset(names - {""})
    bind = cfg.host.strip("[]").lower()
    try:
        loopback = ipaddress.ip_address(bind).is_loopback
    except ValueError:
        loopback = bind == "localhost"
    return frozenset({*LOOPBACK_NAMES, bind}) if loopback else None


class Guard:
    """ASGI middleware run before any route: the Host header (400), `--api-key` on /v1/*,
    /tokenize and /detokenize (401; as `Authorization: Bearer KEY` or, as Anthropic's clients
    send it, `x-api-key: KEY`),
    and POST bodies of type `application/json` only (415: a page on another site can send a
    text/plain or form body without asking the server first, but not a JSON one). `reshape`
    gives a refusal's body its route's shape (path, status, OpenAI's body)."""

    def __init__(self, app: ASGIApp, hosts: frozenset[str] | None, api_key: str | None,
                 reshape: Callable[[str, int, Any], Any] | None = None):
        self.app, self.hosts, self.reshape = app, hosts, reshape
        self.key = None if api_key is None else api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        problem = self._problem(scope, headers)
        if problem is None:
            return await self.app(scope, receive, send)
        status, message, code, extra = problem
        body = api.error(status, message, None, code).detail
        if self.reshape is not None:
            body = self.reshape(scope["path"], status, body)
        await JSONResponse(body, status, extra)(scope, receive, send)

    def _problem(self, scope: Scope, headers: Headers
                 ) -> tuple[int, str, str, dict[str, str] | None] | None:
        if self.hosts is not None:
            host = headers.get("host", "").lower()
            name = host[1:host.find("]")] if host.startswith("[") else host.rsplit(":", 1)[0]
            if name not in self.hosts:
                return 400, "invalid Host header (--allowed-hosts)", "invalid_host", None
        path = scope["path"]
        if self.key is not None and (path.startswith("/v1/") or path in KEYED_PATHS):
            scheme, _, given = headers.get("authorization", "").partition(" ")
            keys = [given.strip() if scheme.lower() == "bearer" else "",
                    headers.get("x-api-key", "").strip()]
            if not any(k and hmac.compare_digest(k.encode(), self.key) for k in keys):
                return (401, "a valid API key is required: 'Authorization: Bearer KEY' or "
                             "'x-api-key: KEY'", "invalid_api_key",
                        {"WWW-Authenticate": "Bearer"})
        if scope["method"] == "POST":
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            if kind != "application/json":
                return (415, f"the body must be application/json, not {kind or 'untyped'}",
                        "unsupported_media_type", None)
        return None


def uvicorn_options(cfg: ServeConfig) -> dict[str, Any]:
    """uvicorn.Config's keywords for `cfg`'s connection limits."""
    return {"timeout_keep_alive": cfg.timeout_keep_alive,
            "limit_concurrency": cfg.limit_concurrency,
            "http": timed_h11(cfg.request_timeout)}


def timed_h11(seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a clock on the parts it leaves unbounded: the headers of a
    request must arrive within `seconds` of a connection opening or of its first byte (else
    408 and the connection closes), and a body left unread by an early answer (413) within
    `seconds` of that answer. uvicorn bounds only the idle time between requests."""

    class TimedH11(H11Protocol):
        _clock: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._clock is None and self.conn.their_state is h11.IDLE:
                self._arm()  # a new request on a kept-alive connection
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE and (
                    self.cycle is None or not self.cycle.response_complete):
                self._disarm()  # headers in: the app's own clock reads the body

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.conn.their_state is h11.SEND_BODY:  # the rest of a body nobody reads
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._clock = self.loop.call_later(seconds, self._late)

        def _disarm(self) -> None:
            if self._clock is not None:
                self._clock.cancel()
                self._clock = None

        def _late(self) -> None:
            self._clock = None
            if self.transport.is_closing():
                return
            if self.conn.our_state is h11.IDLE and (self.cycle is None
                                                     or self.cycle.response_complete):
                body = json.dumps(api.error(408, f"the request did not arrive within "
                                                 f"{seconds:g} s (--request-timeout)", None,
                                            "request_timeout").detail).encode()
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: "
                                     b"application/json\r\nconnection: close\r\n"
                                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
            self.transport.close()

    return TimedH11
