"""OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`), the
API of Codex CLI and the OpenAI Agents SDK, served by the chat route's engine path: a body
(`ResponsesRequest`) becomes an `api.ChatRequest` (`chat_request`) that `Server.admit` templates,
constrains and submits, and the answer is read by the same `OutputStream` and `Server.text`;
only the shapes differ.

Input. `input` is a text (one user message) or a list of items: messages (role user, system,
developer (a system message) or assistant; content a text or `input_text` / `output_text` /
`refusal` parts), `function_call` items (an assistant's tool calls, with the message before
them), `function_call_output` items (tool messages) and `reasoning` items given back (the text
of their `content`, else of their `summary`, becomes the next assistant turn's
`reasoning_content`); `instructions` is a first system message. `tools` are flat function
tools; `tool_choice` and `parallel_tool_calls` are the chat route's; `text.format` is its
`response_format`. `reasoning.effort` switches Kimi's thinking as `chat_template_kwargs`
`{"thinking": ...}` does on the chat route: "none" and "minimal" off, any other effort on, no
effort the template's default.

Output. Items in the order the answer made them: `reasoning` (the text as one `reasoning_text`
content part; `summary` empty: the model writes no summary), `message` (one `output_text`
part), `function_call` (`call_id` the id the model wrote, as chat's tool call ids). `status`
"incomplete" with `incomplete_details.reason` "max_output_tokens" when the answer ran out of
tokens (no reason when the server ended it, shutting down).
`usage.output_tokens_details.reasoning_tokens` counts the reasoning text's tokens (encoded
again: the engine does not tag the tokens it makes); `cached_tokens` is the engine's
prefix-cache hit (`Request.cached_tokens`). With `stream`, the SSE events of OpenAI's API
(`event:` and `data:` lines, each with its `sequence_number`, no `[DONE]`), built by the same
`Output` as the whole answer, so both agree; an engine failure mid-stream is a
`response.failed` event.

Storage. With `store` (the default) a finished response is kept in this process's memory, the
last MAX_STORED of them within MAX_STORED_CHARS (least recently used out first), for
`GET /v1/responses/{id}` and for `previous_response_id`, whose conversation (its input items,
with those of the responses before it, and its output items) goes before the new input; its
`instructions` and `tools` do not carry over (OpenAI's rule). An unknown or evicted id is a 404.

Accepted and ignored: `metadata` (returned), `user`, `safety_identifier`, `prompt_cache_key`,
`client_metadata`, `truncation` (the context is never cut: a conversation too long for it is a
400), `reasoning.summary`, `include` "reasoning.encrypted_content" (the reasoning text travels
in the clear, in `content`), `service_tier` "auto" / "default", `text.verbosity`.
Extensions, as on the chat route: `top_k`, `seed`."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, TypeAdapter, ValidationError, field_validator, model_validator
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from engine.config import Seed, Temperature, TopK, TopP, error_parts
from engine.serve import protocol as api
from engine.serve.worker import ClientGone
from engine.toolcalls import OutputDelta

MAX_STORED = 1000  # responses kept for `previous_response_id` and GET
# ... and the characters of their conversations and bodies, all together (a chain's history is
# counted in each of its responses, so this bounds the memory whatever they share)
MAX_STORED_CHARS = 256 << 20
# Effort values that switch thinking off; any other effort switches it on.
EFFORTS_OFF = ("none", "minimal")
# The chat request's fields by their names here (for errors `Server.admit` raises).
RENAMED = {"messages": "input", "max_completion_tokens": "max_output_tokens",
           "max_tokens": "max_output_tokens", "response_format": "text",
           "chat_template_kwargs": "reasoning"}
# Why a field other APIs have is refused here.
REFUSED = {
    "messages": "the Responses API takes input (a text or a list of items)",
    "max_tokens": "send max_output_tokens",
    "max_completion_tokens": "send max_output_tokens",
    "response_format": "send text.format",
    "reasoning_effort": "send reasoning.effort",
    "n": "a response has one answer",
    "stop": "not a Responses API parameter",
    "conversation": "conversations are not supported: send previous_response_id",
    "prompt": "stored prompts are not supported",
    "max_tool_calls": "not supported: the answer holds the calls the model writes",
    "top_logprobs": "log-probabilities are not supported on this route",
    "background": "background responses are not supported",
}


# ---- the request -------------------------------------------------------------------------------


class TextPart(api._Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # output_text given back
    logprobs: list[Any] | None = None


class RefusalPart(api._Strict):
    type: Literal["refusal"]
    refusal: str


class ImagePart(api._Strict):
    """An image as a `data:` URL (`image_url`); `detail` is accepted and ignored."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


Part = Annotated[TextPart | RefusalPart | ImagePart, Field(discriminator="type")]


class MessageItem(api._Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]
    id: str | None = None
    status: str | None = None
    phase: str | None = None

    @property
    def text(self) -> str:
        c = self.content
        return c if isinstance(c, str) else "".join(
            p.text if isinstance(p, TextPart) else p.refusal for p in c
            if not isinstance(p, ImagePart))

    @property
    def chat_content(self) -> str | list[dict[str, Any]]:
        """The chat message's content: the text, or with images its parts in order (an
        `input_image` as an `image_url` part; one without `image_url` is kept as given, so the
        chat route names it)."""
        c = self.content
        if isinstance(c, str) or not any(isinstance(p, ImagePart) for p in c):
            return self.text
        return [{"type": "image_url", "image_url": {"url": p.image_url}}
                if isinstance(p, ImagePart) and p.image_url is not None
                else {"type": "image_url", "image_url": None} if isinstance(p, ImagePart)
                else {"type": "text", "text": p.text if isinstance(p, TextPart) else p.refusal}
                for p in c]


class FunctionCallItem(api._Strict):
    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    arguments: str
    id: str | None = None
    status: str | None = None
    namespace: str | None = None


class FunctionOutputItem(api._Strict):
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None


class ReasoningText(api._Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(api._Strict):
    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.content or self.summary)


Item = Annotated[MessageItem | FunctionCallItem | FunctionOutputItem | ReasoningItem,
                 Field(discriminator="type")]
ITEMS = TypeAdapter(list[Item])


class FunctionTool(api._Strict):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^\S{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(api._Strict):
    type: Literal["function"]
    name: str


class JsonSchemaText(api._Strict):
    type: Literal["json_schema"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    # NOTE: `schema` by its alias, as api.JsonSchemaFormat has it
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class PlainText(api._Strict):
    type: Literal["text", "json_object"]


class TextConfig(api._Strict):
    format: Annotated[JsonSchemaText | PlainText, Field(discriminator="type")] | None = None
    # NOTE: a hint of style, not a rule (Codex CLI may send any): accepted and ignored
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(api._Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(api._Strict):
    include_obfuscation: bool | None = None


class ResponsesRequest(api._Strict):
    """A `POST /v1/responses` body (see the module docstring)."""

    model: str | None = None
    input: str | Annotated[list[Item], Field(min_length=1, max_length=api.MAX_MESSAGES)]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=api.MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: api.Positive | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool = True
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    client_metadata: dict[str, str] | None = None  # Codex CLI's
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[Literal["reasoning.encrypted_content"]] | None = None
    service_tier: Literal["auto", "default"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _typed_items(cls, v: Any) -> Any:
        # NOTE: a message may leave out its type (OpenAI's "easy" input message); the items'
        # union is told apart by it.
        items = v.get("input") if isinstance(v, dict) else None
        if isinstance(items, list) and any(isinstance(x, dict) and "type" not in x
                                           for x in items):
            v = {**v, "input": [{"type": "message", **x} if isinstance(x, dict) and "type" not in x
                                else x for x in items]}
        return v

    @field_validator("tools", mode="before")
    @classmethod
    def _functions_only(cls, v: Any) -> Any:
        # NOTE: before the tools' own checks, whose errors would name a built-in tool's fields.
        for i, t in enumerate(v if isinstance(v, list) else []):
            if isinstance(t, dict) and t.get("type") != "function":
                raise ValueError(f"tools.{i} is of type {t.get('type')!r}: this server runs "
                                 f"function tools only (the client runs them)")
        return v

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, v: Any, info: Any) -> Any:
        return api.only_when_streaming(v, info)

    def items(self) -> list[Any]:
        """The input as items."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def thinking(self) -> bool | None:
        effort = self.reasoning.effort if self.reasoning else None
        return None if effort is None else effort not in EFFORTS_OFF

    def chat_request(self, items: list[Any]) -> api.ChatRequest:
        """The chat request of this body over the conversation `items`; a 400 naming this
        body's field when the chat route would refuse it."""
        system = [] if self.instructions is None else [{"role": "system",
                                                         "content": self.instructions}]
        fmt = self.text.format if self.text else None
        choice = self.tool_choice
        fields: dict[str, Any] = {
            "model": self.model, "messages": system + messages(items),
            "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed, "stream": self.stream,
            "tools": None if self.tools is None else [
                {"type": "function", "function": t.model_dump(exclude={"type"}, by_alias=True,
                                                               exclude_unset=True)}
                for t in self.tools],
            "tool_choice": ({"type": "function", "function": {"name": choice.name}}
                            if isinstance(choice, FunctionChoice) else choice),
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": None if fmt is None else {"type": fmt.type} if isinstance(
                fmt, PlainText) else {"type": "json_schema", "json_schema": fmt.model_dump(
                    exclude={"type"}, by_alias=True, exclude_unset=True)},
            "chat_template_kwargs": None if self.thinking() is None else {
                "thinking": self.thinking()},
        }
        try:
            return api.ChatRequest.model_validate({k: v for k, v in fields.items()
                                                   if v is not None})
        except ValidationError as e:
            err, text = error_parts(e)
            param = str(err["loc"][0]) if err["loc"] else None
            raise api.bad(RENAMED.get(param, param), _renamed_text(text)) from e


def messages(items: list[Any]) -> list[dict[str, Any]]:
    """Chat messages of Responses items: an assistant's message and the function calls after
    it are one assistant message (its `tool_calls`), the text of a reasoning item the
    `reasoning_content` of the assistant turn after it."""
    out: list[dict[str, Any]] = []
    reasoning: str | None = None
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning = item.text
        elif isinstance(item, FunctionOutputItem):
            text = item.output if isinstance(item.output, str) else "".join(
                p.text for p in item.output)
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": text})
        elif isinstance(item, MessageItem) and item.role != "assistant":
            out.append({"role": "system" if item.role == "developer" else item.role,
                        "content": item.chat_content})
        else:
            call = isinstance(item, FunctionCallItem)
            if not (call and out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": "" if call else item.text})
                if reasoning is not None:
                    out[-1]["reasoning_content"], reasoning = reasoning, None
            if call:
                out[-1].setdefault("tool_calls", []).append({
                    "id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}})
    return out


def _renamed_text(text: str) -> str:
    """An error's text with the chat request's field names as this API names them."""
    return re.sub(r"\b(" + "|".join(RENAMED) + r")\b", lambda m: RENAMED[m[1]], text)


def renamed(e: HTTPException) -> HTTPException:
    """A chat route's error (`Server.admit`) naming this API's fields."""
    err = e.detail.get("error") if isinstance(e.detail, dict) else None
    if not isinstance(err, dict):
        return e
    param = err.get("param")
    return api.error(e.status_code, _renamed_text(str(err.get("message"))),
                     RENAMED.get(param, param), err.get("code"), err.get("type"), e.headers)


parse_body = functools.partial(api.parse, model=ResponsesRequest, reasons=REFUSED)


# ---- the output --------------------------------------------------------------------------------


class Output:
    """The output items of an answer, built from its parsed pieces (`feed`, then `finish`),
    and the stream events that build them, in order (without their sequence numbers)."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item still growing
        self.calls: dict[int, dict[str, Any]] = {}  # function calls by the parser's index
        self.index: dict[str, int] = {}  # items' output_index by id

    def feed(self, d: OutputDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if d.reasoning:
            item = self._item("reasoning", events)
            item["content"][0]["text"] += d.reasoning
            events.append(self._at(item, "response.reasoning_text.delta", content_index=0,
                                   delta=d.reasoning))
        if d.content:
            item = self._item("message", events)
            item["content"][0]["text"] += d.content
            events.append(self._at(item, "response.output_text.delta", content_index=0,
                                   delta=d.content, logprobs=[]))
        for c in d.tool_calls:
            if c.index not in self.calls:
                self.calls[c.index] = self._item("function_call", events, c.id or "",
                                                 c.name or "")
            item = self.calls[c.index]
            if c.arguments:
                item["arguments"] += c.arguments
                events.append(self._at(item, "response.function_call_arguments.delta",
                                       delta=c.arguments))
        return events

    def finish(self, incomplete: bool) -> list[dict[str, Any]]:
        """Closes the last item ("incomplete" when the answer was cut); an answer of nothing
        is one empty message."""
        events: list[dict[str, Any]] = []
        if not self.items:
            self._item("message", events)
        self._close(events, "incomplete" if incomplete else "completed")
        return events

    @property
    def reasoning(self) -> str:
        return "".join(i["content"][0]["text"] for i in self.items if i["type"] == "reasoning")

    def _at(self, item: dict[str, Any], kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "item_id": item["id"], "output_index": self.index[item["id"]],
                **fields}

    def _item(self, kind: str, events: list[dict[str, Any]], call_id: str = "",
              name: str = "") -> dict[str, Any]:
        """The open item if it is of `kind` (a function call's never is: each call is new),
        else a new one."""
        if self.open is not None and self.open["type"] == kind != "function_call":
            return self.open
        self._close(events, "completed")
        prefix, fields = {
            "reasoning": ("rs", {"summary": [], "content": []}),
            "message": ("msg", {"role": "assistant", "content": []}),
            "function_call": ("fc", {"call_id": call_id, "name": name, "arguments": ""}),
        }[kind]
        item = {"id": f"{prefix}_{uuid.uuid4().hex}", "type": kind, "status": "in_progress",
                **fields}
        self.index[item["id"]] = len(self.items)
        self.items.append(item)
        self.open = item
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                       "item": _copy(item)})
        part = {"reasoning": {"type": "reasoning_text", "text": ""},
                "message": {"type": "output_text", "text": "", "annotations": []}}.get(kind)
        if part is not None:
            item["content"].append(part)
            events.append(self._at(item, "response.content_part.added", content_index=0,
                                   part=_copy(part)))
        return item

    def _close(self, events: list[dict[str, Any]], status: str) -> None:
        item, self.open = self.open, None
        if item is None:
            return
        if item["type"] == "function_call":
            events.append(self._at(item, "response.function_call_arguments.done",
                                   arguments=item["arguments"]))
        else:
            part = item["content"][0]
            kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
            events.append(self._at(item, f"response.{kind}.done", content_index=0,
                                   text=part["text"], **({} if item["type"] == "reasoning"
                                                         else {"logprobs": []})))
            events.append(self._at(item, "response.content_part.done", content_index=0,
                                   part=_copy(part)))
        item["status"] = status
        events.append({"type": "response.output_item.done",
                       "output_index": self.index[item["id"]], "item": _copy(item)})


def _copy(obj: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(obj))


# ---- storage -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Stored:
    response: dict[str, Any]
    conversation: list[Any]  # its input items (after those of the responses before it), output
    chars: int


class Store:
    """Finished responses by id, the least recently used dropped past `capacity` responses or
    `budget` characters (of their conversations and bodies, counted once per response)."""

    def __init__(self, capacity: int = MAX_STORED, budget: int = MAX_STORED_CHARS):
        self.capacity, self.budget = capacity, budget
        self.kept: OrderedDict[str, Stored] = OrderedDict()
        self.chars = 0

    def get(self, rid: str, param: str | None = None) -> Stored:
        """The response `rid` (now the most recently used), or a 404 naming `param`."""
        if (s := self.kept.get(rid)) is None:
            raise api.error(404, f"{param + ': ' if param else ''}there is no stored response "
                                 f"{rid!r}: it was never stored (store false), was deleted, or "
                                 f"was dropped (this server keeps its last {self.capacity} "
                                 f"responses, in memory)", param,
                            "previous_response_not_found" if param else "not_found")
        self.kept.move_to_end(rid)
        return s

    def put(self, response: dict[str, Any], conversation: list[Any]) -> None:
        chars = len(json.dumps(response)) + sum(len(x.model_dump_json()) for x in conversation)
        if chars > self.budget:
            return
        self.kept[response["id"]] = Stored(response, conversation, chars)
        self.chars += chars
        while len(self.kept) > self.capacity or self.chars > self.budget:
            self.chars -= self.kept.popitem(last=False)[1].chars

    def delete(self, rid: str) -> None:
        self.chars -= self.kept.pop(self.get(rid).response["id"]).chars


# ---- the routes --------------------------------------------------------------------------------


def register(app: FastAPI, srv: Any, store: Store | None = None) -> Store:
    """Adds the Responses routes to `app`, served by `srv` (its `engine.serve.app.Server`, whose
    guard and error handlers cover them); returns the store of responses they keep."""
    store = store if store is not None else Store()

    @app.post("/v1/responses")
    async def create(http: Request) -> Response:
        body = await srv.read_as(http, parse_body)
        before = ([] if body.previous_response_id is None else
                  store.get(body.previous_response_id, "previous_response_id").conversation)
        conversation = [*before, *body.items()]
        chat = body.chat_request(conversation)
        try:
            ids, (h,), (out,) = await srv.admit(chat)
        except HTTPException as e:
            raise renamed(e) from None
        limit = api.ToolLimit(body.parallel_tool_calls)
        built = Output()
        rid, created = f"resp_{uuid.uuid4().hex}", int(time.time())

        def response(status: str, usage: dict[str, Any] | None = None,
                     error: dict[str, Any] | None = None, reason: str | None = None
                     ) -> dict[str, Any]:
            """The response object; `reason`: why an incomplete one ended (the engine's)."""
            fmt = body.text.format if body.text else None
            return {
                "id": rid, "object": "response", "created_at": created, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None,
                "error": error, "background": False,
                "incomplete_details": {"reason": "max_output_tokens" if reason == "length"
                                       else None} if status == "incomplete" else None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "metadata": body.metadata or {}, "model": srv.name,
                "output": [_copy(i) for i in built.items] if status != "in_progress" else [],
                "parallel_tool_calls": body.parallel_tool_calls is not False,
                "previous_response_id": body.previous_response_id,
                "reasoning": {"effort": body.reasoning.effort if body.reasoning else None,
                              "summary": body.reasoning.summary if body.reasoning else None},
                "store": body.store, "temperature": chat.temperature, "top_p": chat.top_p,
                "text": {"format": fmt.model_dump(by_alias=True, exclude_unset=True)
                         if fmt else {"type": "text"}},
                "tool_choice": (body.tool_choice.model_dump() if isinstance(
                    body.tool_choice, FunctionChoice) else body.tool_choice or "auto"),
                "tools": [t.model_dump(exclude_unset=True) | {"type": "function"}
                          for t in body.tools or []],
                "truncation": body.truncation or "disabled", "usage": usage,
                "user": body.user,
            }

        async def finished(reason: str | None, n: int) -> dict[str, Any]:
            """The response once the answer ended (stored when asked)."""
            reasoning = built.reasoning
            thought = len(await run_in_threadpool(srv.model.tokenizer.encode, reasoning)
                          ) if reasoning and srv.model.tokenizer else 0
            usage = {"input_tokens": len(ids), "output_tokens": n, "total_tokens": len(ids) + n,
                     "input_tokens_details": {"cached_tokens": h.req.cached_tokens},
                     "output_tokens_details": {"reasoning_tokens": min(thought, n)}}
            # NOTE: an answer ended otherwise than by a stop (out of tokens, or aborted as the
            # server shuts down) is incomplete
            done = response("completed" if reason in ("stop", "tool_calls") else "incomplete",
                            usage, reason=reason)
            if body.store:
                store.put(done, [*conversation, *ITEMS.validate_python(done["output"])])
            return done

        gen = srv.text(h, http, out)
        if not body.stream:
            last: tuple[str | None, int] = (None, 0)
            try:
                async with contextlib.aclosing(gen) as items:
                    async for piece, reason, n, _ in items:
                        built.feed(limit.delta(piece))
                        last = reason, n
            finally:
                srv.close(h)
            built.finish(last[0] not in ("stop", "tool_calls"))
            return JSONResponse(await finished(*last))

        async def events() -> AsyncIterator[str]:
            seq = itertools.count()

            def sse(event: dict[str, Any]) -> str:
                event["sequence_number"] = next(seq)
                data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
                return f"event: {event['type']}\ndata: {data}\n\n"

            start = response("in_progress")
            yield sse({"type": "response.created", "response": start})
            yield sse({"type": "response.in_progress", "response": start})
            try:
                last: tuple[str | None, int] = (None, 0)
                async with contextlib.aclosing(gen) as items:
                    async for piece, reason, n, _ in items:
                        for event in built.feed(limit.delta(piece)):
                            yield sse(event)
                        last = reason, n
                for event in built.finish(last[0] not in ("stop", "tool_calls")):
                    yield sse(event)
                done = await finished(*last)
                kind = "completed" if done["status"] == "completed" else "incomplete"
                yield sse({"type": f"response.{kind}", "response": done})
            except HTTPException as e:
                err = e.detail.get("error", {}) if isinstance(e.detail, dict) else {}
                yield sse({"type": "response.failed", "response": response(
                    "failed", error={"code": "server_error", "message": err.get("message")})})
            except ClientGone:
                pass

        return api.SSEResponse(events(), lambda: srv.close(h))

    @app.get("/v1/responses/{rid}")
    async def retrieve(rid: str) -> dict[str, Any]:
        return store.get(rid).response

    @app.delete("/v1/responses/{rid}")
    async def delete(rid: str) -> dict[str, Any]:
        store.delete(rid)
        return {"id": rid, "object": "response.deleted", "deleted": True}

    return store
