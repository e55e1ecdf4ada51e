"""The OpenAI API's bodies as pydantic models: requests with every range and rule declared on
the fields (sampling fields reuse `engine.config`'s types), and the error body.
Request defaults follow OpenAI's (`temperature` 1.0); extensions: `top_k` (-1 off), `ignore_eos`
and vLLM's `chat_template_kwargs` and `reasoning_content`; parameters the engine does not
implement are accepted at their neutral values (`presence_penalty` 0, `suffix` "", ...) and
refused, naming the field, at any other. `logit_bias`, `logprobs` (chat: with `top_logprobs`;
completions: a count, with `echo`), `response_format` (`json_object`, `json_schema`) and
`tool_choice` "required" or a named function reach the engine as `SamplingParams` (the last
two as a grammar the app builds: `engine.grammar`). `n` (up to MAX_N) and
`parallel_tool_calls` are served by the app (engine.serve.app); `/tokenize` and `/detokenize`
take vLLM's bodies (TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest).
What every route's answer uses, whichever API it speaks: `ToolLimit` (`parallel_tool_calls`
false) and `SSEResponse` (a stream that closes its requests however it ends)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal, TypeVar

from fastapi import HTTPException
from fastapi.responses import StreamingResponse
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from starlette.types import Receive, Scope, Send

from engine.config import (
    MAX_LOGIT_BIAS,
    MAX_TOP_LOGPROBS,
    LogitBias,
    SamplingParams,
    Seed,
    StopString,
    Temperature,
    TopK,
    TopLogprobs,
    TopP,
    error_parts,
)
from engine.toolcalls import OutputDelta, ParsedOutput

MAX_BODY_BYTES = 16 << 20  # the default of `--max-body-bytes`
# Bounds on what a body may make the server template and tokenize (checked while parsing, before
# any of that work): OpenAI's own limits are lower (2,048 messages, 128 tools).
MAX_MESSAGES = 4096
MAX_TOOLS = 256
MAX_STOP = 4
MAX_N = 8  # choices per request (`n`): each is its own request in the engine
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound on the completions route's `logprobs`
# The parser's work grows with a body's JSON values, not its bytes (16 MB of `{}` take seconds,
# holding the interpreter lock the whole time). Before parsing, a body's commas plus its braces
# and brackets weighted by what building a container costs (8 commas' worth), counted over the
# raw bytes, inside strings too, must stay under this: about half a second of parsing at most,
# far above what a conversation filling the context, its tools or its token ids need.
MAX_JSON_COST = 1 << 19
Positive = Annotated[int, Field(ge=1)]


def _neutral(v: float) -> float:
    if v != 0:
        raise ValueError(f"{v} is not supported: this server applies no penalties (only 0, "
                         f"which changes nothing, is accepted)")
    return v


# A parameter the engine does not implement, accepted only at the value that changes nothing.
Neutral = Annotated[float, AfterValidator(_neutral)]
Text = Annotated[str, Field(min_length=1)]
Ids = Annotated[list[int], Field(min_length=1)]
BodyT = TypeVar("BodyT", bound=BaseModel)


def error(status: int, message: str, param: str | None = None, code: str | None = None,
          kind: str = "invalid_request_error", headers: dict[str, str] | None = None
          ) -> HTTPException:
    """An HTTP error whose `detail` is OpenAI's error body (the app sends it as the body)."""
    return HTTPException(status, {"error": {"message": message, "type": kind, "param": param,
                                            "code": code}}, headers)


def bad(param: str | None, message: str, code: str = "invalid_value") -> HTTPException:
    return error(400, message, param, code)


def too_large(size: int | str, limit: int) -> HTTPException:
    return error(413, f"the request body has {size} bytes; the limit is {limit} "
                      f"(--max-body-bytes)", None, "request_too_large")


def json_cost(raw: bytes) -> int:
    """An upper bound on the parsing work of `raw` (see MAX_JSON_COST), from byte counts alone."""
    return raw.count(b",") + 8 * (raw.count(b"{") + raw.count(b"["))


def parse(raw: bytes, model: type[BodyT], limit: int = MAX_BODY_BYTES,
          reasons: dict[str, str] | None = None) -> BodyT:
    """A JSON body (the app admits only `application/json`) as `model`; a pydantic error becomes
    a 400 naming the field (`engine.config.error_parts`), an unknown one with why it is refused
    (`reasons`, by default the OpenAI routes' UNSUPPORTED)."""
    if len(raw) > limit:
        raise too_large(len(raw), limit)
    if (cost := json_cost(raw)) > MAX_JSON_COST:
        raise error(413, f"the request body holds too many JSON values: {cost:,} (commas, and "
                         f"objects and arrays counted as 8); the limit is {MAX_JSON_COST:,}",
                    None, "request_too_large")
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        err, text = error_parts(e)
        code = {"extra_forbidden": "unknown_parameter", "json_invalid": "invalid_json",
                "missing": "missing_required_parameter"}.get(err["type"], "invalid_value")
        param = str(err["loc"][0]) if err["loc"] else None
        if code == "unknown_parameter" and len(err["loc"]) == 1:
            why = (UNSUPPORTED if reasons is None else reasons).get(param)
            text += f": {why or 'not a parameter this server supports'}"
        raise bad(param, text, code) from e


# Why a field OpenAI's API has is refused (extra_forbidden names it; this says why).
UNSUPPORTED = {
    "functions": "deprecated by OpenAI and not supported here: send tools",
    "function_call": "deprecated by OpenAI and not supported here: send tool_choice",
    "parallel_tool_calls": "only the chat route has tool calls",
    "response_format": "only the chat route takes a response_format",
    "top_logprobs": "the completions route takes logprobs as a count (0 to 5)",
    "echo": "only the completions route echoes its prompt",
    "tools": "only the chat route takes tools",
    "tool_choice": "only the chat route takes tools",
    "audio": "this server generates text only",
    "modalities": "this server generates text only",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "store": "this server stores nothing",
    "metadata": "this server stores nothing",
    "reasoning_effort": "not supported: Kimi's thinking is switched by chat_template_kwargs "
                        "{\"thinking\": false}",
    "service_tier": "this server has one tier",
    "continue_final_message": "not supported: the prompt always ends with the template's "
                              "generation prompt or its last message",
}


def only_when_streaming(v: Any, info: ValidationInfo) -> Any:
    """A body's `stream_options` validator: allowed only beside `stream: true`."""
    if v is not None and not info.data.get("stream"):
        raise ValueError("stream_options is only allowed when stream is true")
    return v


class _Strict(BaseModel):
    # NOTE: strict, so "5" is not silently a max_tokens of 5 and true is not a temperature.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Request(_Strict):
    model: str | None = None
    max_tokens: Positive | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    seed: Seed | None = None
    # NOTE: each choice is one engine request: seed + i for choice i (engine.serve.app)
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    presence_penalty: Neutral | None = None
    frequency_penalty: Neutral | None = None
    # token id (a decimal string, as JSON keys are) -> bias, at most MAX_LOGIT_BIAS of them
    # (`_bias_shape`); ids past the vocabulary are refused with the request's limits
    # (`engine.request.Limits`), which know it
    logit_bias: dict[str, LogitBias] | None = None
    # vLLM's: requests share cached prefixes only with the same salt (set it per tenant, at the
    # trust boundary: a proxy, not the client)
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, v: Any) -> Any:
        # NOTE: before the union's own checks, whose errors name a union member, not the rule.
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"{len(v)} stop strings; this server takes at most {MAX_STOP} "
                             f"(OpenAI's limit)")
        if v is not None and not (isinstance(v, str) and v or isinstance(v, list) and all(
                isinstance(x, str) and x for x in v)):
            raise ValueError("must be a non-empty string or a list of non-empty strings")
        return v

    @field_validator("n", mode="before")
    @classmethod
    def _n_choices(cls, v: Any) -> Any:
        if type(v) is int and v > MAX_N:
            raise ValueError(f"n is {v}; this server generates at most {MAX_N} choices per "
                             f"request")
        return v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_shape(cls, v: Any) -> Any:
        # NOTE: before the entries' own checks, so the count and the keys are named first.
        if isinstance(v, dict):
            if len(v) > MAX_LOGIT_BIAS:
                raise ValueError(f"{len(v)} entries; at most {MAX_LOGIT_BIAS} tokens may be "
                                 f"biased (OpenAI's limit)")
            bad = next((k for k in v if not (k.isascii() and k.isdigit() and len(k) <= 18)),
                       None)
            if bad is not None:
                raise ValueError(f"key {bad!r} is not a token id (a non-negative integer)")
        return v

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, v: Any, info: ValidationInfo) -> Any:
        return only_when_streaming(v, info)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """How many most likely tokens to report beside each new token, and beside each prompt
        token (None: no log-probabilities)."""
        return None, None

    def sampling_params(self, max_new_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        same = self.model_dump(include={"temperature", "top_p", "top_k", "seed", "ignore_eos"})
        bias = tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items()))
        logprobs, prompt_logprobs = self.logprob_counts()
        return SamplingParams(**same, max_new_tokens=max_new_tokens, stop=tuple(stop),
                              logit_bias=bias, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs, cache_salt=self.cache_salt)


class CompletionRequest(_Request):
    prompt: Text | Ids | Annotated[list[Text] | list[Ids], Field(min_length=1, max_length=1)]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    best_of: Positive | None = None
    suffix: Literal[""] | None = None

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return self.logprobs, self.logprobs if self.echo else None

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v: Any, info: ValidationInfo) -> Any:
        n = info.data.get("n", 1)
        if v is not None and v != n:
            raise ValueError(f"best_of is {v}, but this server returns every choice it "
                             f"generates (no ranking by log-probability): best_of must equal n "
                             f"({n}) or be left out")
        return v

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        one = v[0] if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str | list) else v
        if isinstance(v, list) and len(v) > 1 and isinstance(v[0], str | list):
            raise ValueError(f"a list of {len(v)} prompts; this server takes one prompt per "
                             f"request")
        if isinstance(one, str) and one or isinstance(one, list) and one and all(
                type(t) is int for t in one):
            return v
        raise ValueError("must be a non-empty string or a non-empty list of token ids (or a "
                         "list holding one of those)")

    def one_prompt(self) -> str | list[int]:
        p = self.prompt
        return p[0] if isinstance(p, list) and isinstance(p[0], str | list) else p


class FunctionName(_Strict):
    # NOTE: no whitespace, so the call id `functions.{name}:{i}` the model writes parses back.
    name: Annotated[str, Field(pattern=r"^\S{1,64}$")]


class Function(FunctionName):
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: Function


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


# Template variables: names other than the renderer's own parameters.
TemplateKey = Annotated[str, Field(pattern=r"^(?!(?:self|messages|tools|documents|"
                                           r"add_generation_prompt)$)[A-Za-z_]\w*$")]


class JsonSchemaFormat(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    # NOTE: `schema` by its alias: the name would shadow pydantic's own `BaseModel.schema`.
    schema_: dict[str, Any] = Field({}, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given exactly when type is 'json_schema'")
        return self


class ChatRequest(_Request):
    """`tools` reach the chat template; `tool_choice` "none" leaves the answer unparsed;
    "required" or a named function is enforced: the answer is one tool-call section whose calls
    (only that function's) have arguments that validate against their tool's schema (a grammar
    the app builds). `parallel_tool_calls` false allows one call. `response_format`
    `json_object` or `json_schema` is enforced the same way: the answer is that JSON, or,
    beside tools the model may call ("auto"), a tool-call section (not beside a forced call:
    both shape the whole answer). `logprobs` true reports each token's, with `top_logprobs`
    most likely tokens' each."""

    model_config = ConfigDict(regex_engine="python-re")  # TemplateKey looks ahead
    # NOTE: the chat renderer checks the messages (engine.chat), the one place that knows them
    messages: Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Positive | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    chat_template_kwargs: dict[TemplateKey, Any] | None = None

    @field_validator("tool_choice")
    @classmethod
    def _forced_tool_exists(cls, v: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools") or []
        if v == "required" and not tools:
            raise ValueError("tool_choice 'required' needs tools to call")
        name = v.function.name if isinstance(v, NamedToolChoice) else None
        if name is not None and name not in {t.function.name for t in tools}:
            raise ValueError(f"tool_choice names {name!r}, which is not among tools")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_with_logprobs(cls, v: Any, info: ValidationInfo) -> Any:
        if v and not info.data.get("logprobs"):
            raise ValueError(f"top_logprobs ({v}) needs logprobs true (at most "
                             f"{MAX_TOP_LOGPROBS})")
        return v

    @field_validator("response_format")
    @classmethod
    def _one_constraint(cls, v: Any, info: ValidationInfo) -> Any:
        choice = info.data.get("tool_choice")
        if v is not None and v.type != "text" and (
                choice == "required" or isinstance(choice, NamedToolChoice)):
            raise ValueError(f"type {v.type!r} and a forced tool call (tool_choice 'required' "
                             f"or a named function) both shape the whole answer: send one")
        return v

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return (self.top_logprobs or 0) if self.logprobs else None, None

    @property
    def forced_tools(self) -> list[Tool] | None:
        """The tools a forced call may call (tool_choice "required": any; a named function:
        that one), None when no call is forced."""
        choice, tools = self.tool_choice, self.tools or []
        if choice == "required":
            return list(tools)
        if isinstance(choice, NamedToolChoice):
            return [t for t in tools if t.function.name == choice.function.name]
        return None

    @property
    def answer_schema(self) -> dict[str, Any] | None:
        """The JSON schema the answer must match (json_object: any object), None for text."""
        f = self.response_format
        if f is None or f.type == "text":
            return None
        return {"type": "object"} if f.json_schema is None else f.json_schema.schema_

    def content_bytes(self) -> int:
        """UTF-8 bytes of the text content of the messages other than the assistant's (a
        template may cut those, e.g. earlier reasoning): every byte of it reaches the prompt as
        ordinary text, so the prompt has at least this many bytes of it."""
        return _content_bytes(self.messages)

    def template_inputs(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The messages and keyword arguments of `Tokenizer.apply_chat_template`."""
        return _template_inputs(self.messages, self.tools, self.chat_template_kwargs)

    def parsing(self) -> dict[str, Any]:
        """How to read the answer: options of `engine.toolcalls.OutputStream`."""
        choice = self.tool_choice
        return {"tools": bool(self.tools) and choice != "none",
                "only": choice.function.name if isinstance(choice, NamedToolChoice) else None,
                "reasoning": (self.chat_template_kwargs or {}).get("thinking") is not False}



def _content_bytes(messages: list[dict[str, Any]]) -> int:
    n = 0
    for m in messages:
        c = m.get("content") if m.get("role") != "assistant" else None
        parts = [c] if isinstance(c, str) else [p.get("text") for p in c if isinstance(
            p, dict) and p.get("type") == "text"] if isinstance(c, list) else []
        n += sum(len(p.encode("utf-8", "surrogatepass")) for p in parts if isinstance(p, str))
    return n


def _template_inputs(messages: list[dict[str, Any]], tools: list[Tool] | None,
                     kwargs: dict[str, Any] | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    dumped = [t.model_dump(exclude_unset=True) for t in tools or []] or None
    return messages, {"tools": dumped, **(kwargs or {})}


# ---- what the routes' answers share ----------------------------------------------------------


class ToolLimit:
    """`parallel_tool_calls` false: only the call of index 0 (the parser numbers the calls it
    keeps from 0, so that is the first well-formed one) reaches the client; later calls are
    dropped, not turned into content."""

    def __init__(self, parallel: bool | None):
        self.keep = None if parallel is None or parallel else 1

    def delta(self, d: OutputDelta) -> OutputDelta:
        if self.keep is None or not d.tool_calls:
            return d
        return dataclasses.replace(d, tool_calls=tuple(c for c in d.tool_calls
                                                       if c.index < self.keep))

    def result(self, r: ParsedOutput) -> ParsedOutput:
        return r if self.keep is None else dataclasses.replace(r, tool_calls=r.tool_calls[
            :self.keep])


class SSEResponse(StreamingResponse):
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


# ---- /tokenize and /detokenize (vLLM's bodies) -------------------------------------------------


class TokenizeCompletionRequest(_Strict):
    """vLLM's: a text as `/v1/completions` encodes it. This tokenizer adds no special tokens to
    a text, so `add_special_tokens` changes nothing (as with Kimi's tokenizer in vLLM).
    Extension: `return_prompt` echoes the text as `prompt`, as the chat form does."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False
    return_prompt: bool = False


class TokenizeChatRequest(_Strict):
    """vLLM's: a conversation as `/v1/chat/completions` renders and encodes it (the same
    messages, tools and chat_template_kwargs); `add_generation_prompt` false leaves the
    assistant's opening out. Extension: `return_prompt` gives the rendered prompt text, what
    the model is fed (its ids are not that text's plain encoding: special-token strings inside
    the caller's strings stay plain text)."""

    model_config = ConfigDict(regex_engine="python-re")  # TemplateKey looks ahead
    model: str | None = None
    messages: Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_MESSAGES)]
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    chat_template_kwargs: dict[TemplateKey, Any] | None = None
    return_token_strs: bool = False
    return_prompt: bool = False

    def content_bytes(self) -> int:
        return _content_bytes(self.messages)

    def template_inputs(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        messages, kw = _template_inputs(self.messages, self.tools, self.chat_template_kwargs)
        return messages, {"add_generation_prompt": self.add_generation_prompt, **kw}


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def parse_tokenize(raw: bytes, limit: int = MAX_BODY_BYTES
                   ) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """A `/tokenize` body: the chat form when it is an object with `messages`, else the text
    form (whose parse names what is wrong)."""
    chat = False
    if b"messages" in raw and len(raw) <= limit and json_cost(raw) <= MAX_JSON_COST:
        try:
            obj = json.loads(raw)
            chat = isinstance(obj, dict) and "messages" in obj
        except ValueError:
            pass
    return parse(raw, TokenizeChatRequest if chat else TokenizeCompletionRequest, limit)
