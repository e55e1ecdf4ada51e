"""Anthropic's Messages API on the chat path: `POST /v1/messages` (also `?beta=true`, as Claude
Code sends it; `stream`: Anthropic's server-sent events) and `POST /v1/messages/count_tokens`.

A Messages body becomes the chat route's request (`protocol.ChatRequest`, `to_chat`), admitted,
constrained, run and read by the same `Server.admit`, `Server.constrain`, `Server.text` and
`engine.toolcalls.OutputStream`; only the shapes differ:
- `system` (a string or text blocks) is the first message; a user turn's `tool_result` blocks
  (a string or text blocks; `is_error` prefixes "Error: ") are tool messages, its text blocks
  one user message; an assistant turn's `tool_use` blocks are its tool calls, its `thinking`
  its reasoning (`redacted_thinking` and signatures are dropped); several text blocks are
  joined by newlines; a user turn's `image` blocks (base64 sources) are image parts of its
  message, where the model has a vision tower. `document` blocks, server tools and a final
  assistant turn (a prefill) are refused with a 400 naming them. `cache_control` is accepted
  anywhere and changes nothing (the engine has a prefix cache of its own).
- `tools` are functions (`input_schema` their parameters, a top-level `$schema` dropped);
  `tool_choice` `auto`, `any` (the chat route's "required": a grammar), `tool` (a named
  function, forced the same way) or `none`; `disable_parallel_tool_use` is
  `parallel_tool_calls` false.
- `thinking` `enabled` (or `adaptive`) is Kimi's thinking mode (`chat_template_kwargs`
  `{"thinking": true}`), `disabled` or none its instant mode; `budget_tokens` is accepted and
  not enforced (`max_tokens` bounds the reasoning too). Reasoning the model writes is always
  read, and returned as `thinking` blocks whose `signature` is "".
- `max_tokens` (required) is clamped to what the context leaves after the prompt (Claude Code
  asks for 32,000), where the chat route refuses; `stop_sequences` are stop strings.
- `stop_reason`: `max_tokens`, `tool_use`, `stop_sequence` (with the string in
  `stop_sequence`) or `end_turn`. `usage.input_tokens` counts the prompt tokens not read from
  the prefix cache, `cache_read_input_tokens` those that were (Anthropic's split), and
  `count_tokens` the prompt's tokens through the same template: a request's `input_tokens`
  when nothing was cached.
- A tool call's block is sent once its arguments are complete, and only when they are a JSON
  object (Anthropic's `input`); a call whose arguments are not is dropped, as the parser drops
  a malformed call. Text and thinking stream as they come.

Errors on these routes have Anthropic's shape (`error_body`, applied by the app's handlers and
`Guard` through `reshape`) with the chat route's status codes and limits; an error after a
stream began is an `error` event."""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from engine.config import SamplingParams, StopString, Temperature, TopP, error_parts
from engine.serve import protocol as api
from engine.serve.worker import ClientGone, Handle
from engine.tokenizer import TokenizerError
from engine.toolcalls import OutputDelta, OutputStream, ParsedOutput, ToolCallDelta

log = logging.getLogger("engine.serve")
MESSAGES_PATH = "/v1/messages"
# Anthropic's error type of each status (its docs: other 4xx are invalid_request_error).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
               529: "overloaded_error"}
# Why a field of Anthropic's API is refused (extra_forbidden names it; this says why).
UNSUPPORTED = {
    "mcp_servers": "MCP servers are not supported: declare their tools in tools",
    "container": "containers (server-side code execution) are not supported",
    "output_format": "structured outputs are not supported",
    "betas": "send betas in the anthropic-beta header (accepted, and changes nothing)",
}


def owns(path: str) -> bool:
    """Whether `path` is one of these routes (whose errors take Anthropic's shape)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_body(status: int, detail: Any) -> dict[str, Any]:
    """Anthropic's error body of an error whose `detail` is OpenAI's (`protocol.error`), the
    field at fault named in the message."""
    err = detail.get("error") if isinstance(detail, dict) else None
    if not isinstance(err, dict):
        err = {"message": str(detail)}
    message, param = str(err.get("message") or ""), err.get("param")
    if param and param not in message:
        message = f"{param}: {message}"
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def reshape(path: str, status: int, body: Any) -> Any:
    """`body` (OpenAI's error body), in Anthropic's shape when `path` is one of these routes."""
    return error_body(status, body) if owns(path) else body


# ---- the request -------------------------------------------------------------------------------


class ToolChoice(api._Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("name is given exactly when type is 'tool'")
        return self


class ToolDef(api._Strict):
    """A client tool. Server tools (a `type` such as `web_search_20250305`) are refused."""

    type: str | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: Any = None
    strict: bool | None = None

    @field_validator("type")
    @classmethod
    def _client_tool(cls, v: Any) -> Any:
        if v not in (None, "custom"):
            raise ValueError(f"{v!r} is a server tool, which this server does not run: only "
                             f"client tools (name, description, input_schema) are supported")
        return v

    def as_function(self) -> dict[str, Any]:
        """The chat route's tool (`$schema` names a dialect; no template or grammar needs it)."""
        schema = {k: v for k, v in self.input_schema.items() if k != "$schema"}
        fn = {"name": self.name, "parameters": schema}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


class Thinking(api._Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: api.Positive | None = None
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _budget_when_enabled(self) -> Thinking:
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("budget_tokens is required when type is 'enabled'")
        return self


class MessageParam(api._Strict):
    role: Literal["user", "assistant"]
    # NOTE: blocks are read by `_Turns`, which names the block at fault
    content: str | list[dict[str, Any]]


class CountTokensRequest(api._Strict):
    """`/v1/messages/count_tokens`: what shapes the prompt."""

    model: str | None = None
    messages: Annotated[list[MessageParam], Field(min_length=1, max_length=api.MAX_MESSAGES)]
    system: str | list[dict[str, Any]] | None = None
    tools: Annotated[list[ToolDef], Field(max_length=api.MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    # NOTE: accepted as sent (Claude Code and the SDK send some): they change nothing here
    metadata: dict[str, Any] | None = None
    service_tier: Any = None
    cache_control: Any = None
    context_management: Any = None
    inference_geo: Any = None
    speed: Any = None
    diagnostics: Any = None
    output_config: dict[str, Any] | None = None

    @field_validator("output_config")
    @classmethod
    def _effort_only(cls, v: Any) -> Any:
        if v is not None and (extra := sorted(set(v) - {"effort"})):
            raise ValueError(f"{', '.join(extra)}: not supported (only effort, which is "
                             f"accepted and changes nothing)")
        return v

    @property
    def thinks(self) -> bool:
        return self.thinking is not None and self.thinking.type != "disabled"

    def chat_fields(self) -> dict[str, Any]:
        """The chat request's fields of what shapes the prompt and its reading."""
        out: dict[str, Any] = {"model": self.model, "messages": _Turns().of(self),
                               "chat_template_kwargs": {"thinking": self.thinks}}
        if self.tools:
            out["tools"] = [t.as_function() for t in self.tools]
        choice = self.tool_choice
        if choice is not None:
            out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
                choice.type) or {"type": "function", "function": {"name": choice.name}}
            if choice.disable_parallel_tool_use:
                out["parallel_tool_calls"] = False
        return out


class MessagesRequest(CountTokensRequest):
    """`/v1/messages`. `top_k` 0 is no top-k."""

    max_tokens: api.Positive
    stop_sequences: Annotated[list[StopString], Field(max_length=api.MAX_STOP)] | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    stream: bool = False

    @field_validator("stop_sequences", mode="before")
    @classmethod
    def _few_stops(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) > api.MAX_STOP:
            raise ValueError(f"{len(v)} stop sequences; this server takes at most "
                             f"{api.MAX_STOP}")
        return v


class ChatOfMessages(api.ChatRequest):
    """The chat request of a Messages body: no max_tokens (so `Server.admit` takes the
    context's rest, which `sampling_params` then clamps to the body's `max_tokens`), and the
    model's reasoning read whatever the thinking mode (a template may think regardless)."""

    _cap: int | None = PrivateAttr(None)

    def sampling_params(self, max_new_tokens: int) -> SamplingParams:
        cap = self._cap
        return super().sampling_params(max_new_tokens if cap is None else min(cap,
                                                                               max_new_tokens))

    def parsing(self) -> dict[str, Any]:
        return {**super().parsing(), "reasoning": True}


# Chat field -> the Messages field a chat request's error is about.
_FIELD_NAMES = {"stop": "stop_sequences", "parallel_tool_calls": "tool_choice",
                "chat_template_kwargs": "thinking"}


def to_chat(body: CountTokensRequest) -> ChatOfMessages:
    """The chat request of `body` (a 400 naming the Messages field when it is not one)."""
    fields = body.chat_fields()
    if isinstance(body, MessagesRequest):
        fields |= {"temperature": body.temperature, "top_p": body.top_p,
                   "top_k": body.top_k or -1, "stream": body.stream}
        if body.stop_sequences:
            fields["stop"] = body.stop_sequences
    try:
        chat = ChatOfMessages.model_validate(fields)
    except ValidationError as e:
        err, text = error_parts(e)
        param = str(err["loc"][0]) if err["loc"] else None
        param = _FIELD_NAMES.get(param or "", param)
        raise api.bad(param, text) from e
    if isinstance(body, MessagesRequest):
        chat._cap = body.max_tokens
    return chat


def parse_as(model: type[CountTokensRequest]) -> Any:
    """A parser of `Server.read_as` for `model`: `protocol.parse`, unknown fields explained
    for this API."""
    def parse(raw: bytes, limit: int = api.MAX_BODY_BYTES) -> CountTokensRequest:
        return api.parse(raw, model, limit, UNSUPPORTED)
    return parse


def _param(at: str) -> str:
    """The body field a block at `at` (`system.0`, `messages.3.content.1`) is in."""
    return at.split(".", 1)[0]


class _Turns:
    """A Messages conversation as the chat template's messages; a 400 naming the block that
    cannot be one."""

    def of(self, body: CountTokensRequest) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if body.system:
            text = self.texts(body.system, "system", ("text",))
            out.append({"role": "system", "content": text})
        for i, m in enumerate(body.messages):
            blocks = self.blocks(m.content, f"messages.{i}.content")
            out += (self.user if m.role == "user" else self.assistant)(blocks, f"messages.{i}")
        if body.messages[-1].role == "assistant":
            raise api.bad("messages", f"messages.{len(body.messages) - 1}: the conversation "
                                      f"ends with an assistant turn (a prefill), which this "
                                      f"server does not continue: end with a user turn")
        return out

    @staticmethod
    def blocks(content: str | list[dict[str, Any]], where: str) -> list[tuple[str, dict]]:
        """`(where, block)` of each block, each checked to have a type."""
        if isinstance(content, str):
            return [(where, {"type": "text", "text": content})]
        out = []
        for j, b in enumerate(content):
            if not isinstance(b.get("type"), str):
                raise api.bad(_param(where), f"{where}.{j}: a content block needs a type")
            out.append((f"{where}.{j}", b))
        return out

    def texts(self, content: str | list[dict[str, Any]], where: str,
              kinds: Sequence[str]) -> str:
        """The text of `content`, whose blocks must be text blocks."""
        parts = []
        for at, b in self.blocks(content, where):
            if b["type"] not in kinds:
                self.refuse(at, b, "text")
            parts.append(self.text(at, b))
        return "\n".join(parts)

    @staticmethod
    def text(at: str, b: dict[str, Any], key: str = "text") -> str:
        if not isinstance(b.get(key), str):
            raise api.bad(_param(at), f"{at}.{key}: a string is required")
        return b[key]

    @staticmethod
    def refuse(at: str, b: dict[str, Any], allowed: str) -> None:
        kind = b["type"]
        why = f"{allowed} blocks are allowed here"
        raise api.bad(_param(at), f"{at}: {kind!r} blocks are not supported ({why})")

    def user(self, blocks: list[tuple[str, dict]], where: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        parts: list[dict[str, Any]] = []  # text (adjacent blocks joined by newlines) and images

        def flush() -> None:
            if any(p["type"] == "image_url" for p in parts):
                out.append({"role": "user", "content": list(parts)})
            else:
                out.append({"role": "user", "content": "".join(p["text"] for p in parts)})
            parts.clear()

        for at, b in blocks:
            if b["type"] == "text":
                text = self.text(at, b)
                if parts and parts[-1]["type"] == "text":
                    parts[-1] = {"type": "text", "text": parts[-1]["text"] + "\n" + text}
                else:
                    parts.append({"type": "text", "text": text})
            elif b["type"] == "image":
                parts.append({"type": "image_url", "image_url": {"url": self.image(at, b)}})
            elif b["type"] == "tool_result":
                if parts:
                    flush()
                out.append(self.tool_result(at, b))
            else:
                self.refuse(at, b, "text, image and tool_result")
        if parts or not out:
            flush()
        return out

    @staticmethod
    def image(at: str, b: dict[str, Any]) -> str:
        """An image block's source as a URL: base64 data as a `data:` URL (a `url` source is
        passed on, and refused unless fetching is on)."""
        src = b.get("source")
        kind = src.get("type") if isinstance(src, dict) else None
        if kind == "base64" and isinstance(src.get("data"), str):
            return f"data:{src.get('media_type') or 'image/png'};base64,{src['data']}"
        if kind == "url" and isinstance(src.get("url"), str):
            return src["url"]
        raise api.bad(_param(at), f"{at}.source: an image needs a base64 source (type, "
                                  f"media_type, data)")

    def tool_result(self, at: str, b: dict[str, Any]) -> dict[str, Any]:
        content = b.get("content", "")
        if not isinstance(content, str | list):
            raise api.bad("messages", f"{at}.content: a string or a list of text blocks is "
                                      f"required")
        text = self.texts(content, f"{at}.content", ("text",))
        if b.get("is_error") is True:
            text = f"Error: {text}" if text else "Error"
        return {"role": "tool", "tool_call_id": self.text(at, b, "tool_use_id"),
                "content": text}

    def assistant(self, blocks: list[tuple[str, dict]], where: str) -> list[dict[str, Any]]:
        texts, thoughts, calls = [], [], []
        for at, b in blocks:
            kind = b["type"]
            if kind == "text":
                texts.append(self.text(at, b))
            elif kind == "thinking":
                thoughts.append(self.text(at, b, "thinking"))
            elif kind == "redacted_thinking":
                continue
            elif kind == "tool_use":
                if not isinstance(b.get("input"), dict):
                    raise api.bad("messages", f"{at}.input: an object is required")
                calls.append({"id": self.text(at, b, "id"), "type": "function", "function": {
                    "name": self.text(at, b, "name"),
                    "arguments": json.dumps(b["input"], ensure_ascii=False)}})
            else:
                self.refuse(at, b, "text, thinking and tool_use")
        msg: dict[str, Any] = {"role": "assistant",
                               "content": "\n".join(texts) if texts or not calls else None}
        if calls:
            msg["tool_calls"] = calls
        if thoughts:
            msg["reasoning_content"] = "\n".join(thoughts)
        return [msg]


# ---- the answer --------------------------------------------------------------------------------


def tool_input(arguments: str) -> dict[str, Any] | None:
    """A call's arguments as Anthropic's `input` (a JSON object), None when they are not one."""
    try:
        value = json.loads(arguments.strip() or "{}")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def content_blocks(r: ParsedOutput) -> list[dict[str, Any]]:
    """A whole answer's content: its thinking, its text, its tool calls (those with an object
    for input)."""
    out: list[dict[str, Any]] = []
    if r.reasoning:
        out.append({"type": "thinking", "thinking": r.reasoning, "signature": ""})
    if r.content:
        out.append({"type": "text", "text": r.content})
    for c in r.tool_calls:
        if (args := tool_input(c.arguments)) is None:
            log.info("a tool call of %s was dropped: its arguments are not a JSON object",
                     c.name)
            continue
        out.append({"type": "tool_use", "id": c.id, "name": c.name, "input": args})
    return out


def _event(name: str, data: dict[str, Any]) -> str:
    return (f"event: {name}\ndata: "
            f"{json.dumps({'type': name, **data}, ensure_ascii=False, separators=(',', ':'))}\n\n")


class StreamedBlocks:
    """Anthropic's content-block events of an answer as it streams: a block opens when its kind
    of text starts (a thinking block ends with an empty `signature_delta`); a tool call's block
    is sent whole once the call is complete (a later call or other text began, or the answer
    ended), and only when its arguments are a JSON object (as `content_blocks`)."""

    def __init__(self) -> None:
        self.count = 0  # blocks opened
        self.tool_uses = 0
        self.open: str | None = None
        self.call: list[Any] | None = None  # [index, id, name, arguments so far]

    def feed(self, d: OutputDelta) -> list[str]:
        ev: list[str] = []
        if d.reasoning:
            ev += self._flush() + self._into("thinking", {"thinking": "", "signature": ""})
            ev.append(self._delta({"type": "thinking_delta", "thinking": d.reasoning}))
        if d.content:
            ev += self._flush() + self._into("text", {"text": ""})
            ev.append(self._delta({"type": "text_delta", "text": d.content}))
        for c in d.tool_calls:
            ev += self._piece(c)
        return ev

    def end(self) -> list[str]:
        return self._flush() + self._close()

    def _piece(self, c: ToolCallDelta) -> list[str]:
        if self.call is not None and self.call[0] == c.index:
            self.call[3] += c.arguments
            return []
        ev = self._flush()
        self.call = [c.index, c.id or "", c.name or "", c.arguments]
        return ev

    def _flush(self) -> list[str]:
        if self.call is None:
            return []
        _, cid, name, arguments = self.call
        self.call = None
        if tool_input(arguments) is None:
            log.info("a tool call of %s was dropped: its arguments are not a JSON object", name)
            return []
        self.tool_uses += 1
        ev = self._into("tool_use", {"id": cid, "name": name, "input": {}}, again=True)
        ev.append(self._delta({"type": "input_json_delta",
                               "partial_json": arguments.strip() or "{}"}))
        return ev + self._close()

    def _into(self, kind: str, fields: dict[str, Any], again: bool = False) -> list[str]:
        if self.open == kind and not again:
            return []
        ev = self._close()
        self.open = kind
        self.count += 1
        return ev + [_event("content_block_start", {
            "index": self.count - 1, "content_block": {"type": kind, **fields}})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", {"index": self.count - 1, "delta": delta})

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        ev = []
        if self.open == "thinking":
            ev.append(self._delta({"type": "signature_delta", "signature": ""}))
        self.open = None
        return ev + [_event("content_block_stop", {"index": self.count - 1})]


class _Watched:
    """The answer's reader as `Server.text` drives it, noting the output's ids and where a stop
    string cut its text (which stop sequence matched is read from them)."""

    def __init__(self, out: OutputStream):
        self.out, self.ids, self.cut = out, [], None

    def push(self, ids: Sequence[int], pieces: Sequence[str] | None = None) -> OutputDelta:
        self.ids += ids
        return self.out.push(ids, pieces)

    def end(self, ids: Sequence[int], text_end: int | None = None,
            pieces: Sequence[str] | None = None) -> OutputDelta:
        self.ids += ids
        self.cut = text_end
        return self.out.end(ids, text_end, pieces)

    def finish_reason(self, reason: str) -> str:
        return self.out.finish_reason(reason)

    def matched(self, tok: Any, stops: Sequence[str]) -> str | None:
        """The stop sequence that cut the text (the one that starts where it was cut)."""
        if self.cut is None:
            return None
        text = tok.decode(self.ids, skip_special_tokens=True)
        return next((s for s in stops if text.startswith(s, self.cut)), None)


def stop_reason(reason: str | None, tool_uses: int, stop: str | None
                ) -> tuple[str, str | None]:
    """Anthropic's `stop_reason` and `stop_sequence` of a finish (`Server.text`'s)."""
    if reason == "length":
        return "max_tokens", None
    if tool_uses:
        return "tool_use", None
    if stop is not None:
        return "stop_sequence", stop
    return "end_turn", None


def usage(h: Handle, prompt: int, generated: int) -> dict[str, int]:
    """Anthropic's usage: input_tokens are the prompt's tokens not read from the prefix cache
    (known once the request's first tokens came: `Request.cached_tokens`)."""
    cached = min(max(getattr(h.req, "cached_tokens", 0) or 0, 0), prompt)
    return {"input_tokens": prompt - cached, "output_tokens": generated,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


# ---- the routes --------------------------------------------------------------------------------


def register(app: FastAPI, srv: Any) -> None:
    """Adds the Messages routes to `app`, served by `srv` (its `engine.serve.app.Server`, whose
    guard and error handlers cover them, in Anthropic's shape: `reshape`)."""

    @app.post(MESSAGES_PATH)
    async def messages(http: Request) -> Response:
        body = await srv.read_as(http, parse_as(MessagesRequest))
        assert isinstance(body, MessagesRequest)
        chat = to_chat(body)
        ids, [h], [out] = await srv.admit(chat)
        assert out is not None  # a chat request needs a tokenizer (`admit` checked)
        watched, tok = _Watched(out), srv.model.tokenizer
        limit = api.ToolLimit(chat.parallel_tool_calls)
        gen = srv.text(h, http, watched)  # type: ignore[arg-type]
        head = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                "model": srv.name}
        stops = body.stop_sequences or []

        if not body.stream:
            reason, n = None, 0
            try:
                async with contextlib.aclosing(gen) as items:
                    async for _, finish, count, _ in items:
                        reason, n = finish, count
            finally:
                srv.close(h)
            blocks = content_blocks(limit.result(out.result()))
            why, stop = stop_reason(reason, sum(b["type"] == "tool_use" for b in blocks),
                                    watched.matched(tok, stops))
            return JSONResponse({**head, "content": blocks, "stop_reason": why,
                                 "stop_sequence": stop, "usage": usage(h, len(ids), n)})

        async def events() -> AsyncIterator[str]:
            blocks = StreamedBlocks()
            try:
                yield _event("message_start", {"message": {
                    **head, "content": [], "stop_reason": None, "stop_sequence": None,
                    "usage": usage(h, len(ids), 0)}})
                yield _event("ping", {})
                reason, n = None, 0
                async with contextlib.aclosing(gen) as items:
                    async for piece, finish, count, _ in items:
                        reason, n = finish, count
                        for ev in blocks.feed(limit.delta(piece)):
                            yield ev
                for ev in blocks.end():
                    yield ev
                why, stop = stop_reason(reason, blocks.tool_uses, watched.matched(tok, stops))
                yield _event("message_delta", {"delta": {"stop_reason": why,
                                                         "stop_sequence": stop},
                                               "usage": usage(h, len(ids), n)})
                yield _event("message_stop", {})
            except HTTPException as e:
                # the error as an event: the stream ends there, as Anthropic's does
                yield _event("error", {"error": error_body(e.status_code, e.detail)["error"]})
            except ClientGone:
                pass

        return api.SSEResponse(events(), lambda: srv.close(h))

    @app.post(MESSAGES_PATH + "/count_tokens")
    async def count_tokens(http: Request) -> dict[str, int]:
        """The prompt's tokens as `/v1/messages` would feed the engine."""
        body = await srv.read_as(http, parse_as(CountTokensRequest))
        chat = to_chat(body)
        srv.check_model(chat.model)
        tok = srv.tokenizer("messages")
        srv.check_bytes("messages", chat.content_bytes())
        messages, kw = chat.template_inputs()
        try:
            ids = await run_in_threadpool(tok.apply_chat_template, messages, **kw)
        except TokenizerError as e:
            raise api.bad("messages", str(e)) from e
        return {"input_tokens": len(ids)}
