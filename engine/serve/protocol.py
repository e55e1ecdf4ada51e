"""The OpenAI API's bodies as pydantic models: requests with every range and rule declared on
the fields (sampling fields reuse `engine.config`'s types), and the error body.
Request defaults follow OpenAI's (`temperature` 1.0); extensions: `top_k` (-1 off), `ignore_eos`
and vLLM's `chat_template_kwargs` and `reasoning_content`; parameters the engine does not
implement are accepted at their neutral values."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from fastapi import HTTPException
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from engine.config import SamplingParams, Seed, StopString, Temperature, TopK, TopP, error_parts

MAX_BODY_BYTES = 16 << 20
Positive = Annotated[int, Field(ge=1)]
Neutral = Annotated[float, Field(ge=0, le=0)]  # only the value that changes nothing
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


def parse(raw: bytes, model: type[BodyT]) -> BodyT:
    """A JSON body as `model` whatever the Content-Type said (curl -d sends a form type); a
    pydantic error becomes a 400 naming the field (`engine.config.error_parts`)."""
    if len(raw) > MAX_BODY_BYTES:
        raise error(413, f"the request body has {len(raw)} bytes; the limit is {MAX_BODY_BYTES}",
                    None, "request_too_large")
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        err, text = error_parts(e)
        code = {"extra_forbidden": "unknown_parameter", "json_invalid": "invalid_json",
                "missing": "missing_required_parameter"}.get(err["type"], "invalid_value")
        raise bad(str(err["loc"][0]) if err["loc"] else None, text, code) from e


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
    n: Literal[1] = 1
    stop: StopString | Annotated[list[StopString], Field(max_length=4)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    presence_penalty: Neutral | None = None
    frequency_penalty: Neutral | None = None
    logprobs: Literal[False, 0] | None = None

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_new_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        same = self.model_dump(include={"temperature", "top_p", "top_k", "seed", "ignore_eos"})
        return SamplingParams(**same, max_new_tokens=max_new_tokens, stop=tuple(stop))


class CompletionRequest(_Request):
    prompt: Text | Ids | Annotated[list[Text] | list[Ids], Field(min_length=1, max_length=1)]
    echo: Literal[False] = False
    best_of: Literal[1] = 1
    suffix: Literal[""] | None = None

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


class ChatRequest(_Request):
    """`tools` reach the chat template; `tool_choice` "none" leaves the answer unparsed, a named
    function is prompted like "auto" and only its calls are returned (no guided decoding)."""

    model_config = ConfigDict(regex_engine="python-re")  # TemplateKey looks ahead
    # NOTE: the chat renderer checks the messages (engine.chat), the one place that knows them
    messages: Annotated[list[dict[str, Any]], Field(min_length=1)]
    max_completion_tokens: Positive | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto"] | NamedToolChoice | None = None
    chat_template_kwargs: dict[TemplateKey, Any] | None = None

    @field_validator("tool_choice")
    @classmethod
    def _named_tool_exists(cls, v: Any, info: ValidationInfo) -> Any:
        name = v.function.name if isinstance(v, NamedToolChoice) else None
        if name is not None and name not in {t.function.name for t in info.data.get("tools") or []}:
            raise ValueError(f"tool_choice names {name!r}, which is not among tools")
        return v

    def template_inputs(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The messages and keyword arguments of `Tokenizer.apply_chat_template`."""
        tools = [t.model_dump(exclude_unset=True) for t in self.tools or []] or None
        return self.messages, {"tools": tools, **(self.chat_template_kwargs or {})}

    def parsing(self) -> dict[str, Any]:
        """How to read the answer: options of `engine.toolcalls.OutputStream`."""
        choice = self.tool_choice
        return {"tools": bool(self.tools) and choice != "none",
                "only": choice.function.name if isinstance(choice, NamedToolChoice) else None,
                "reasoning": (self.chat_template_kwargs or {}).get("thinking") is not False}

