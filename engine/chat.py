"""Chat rendering: a checkpoint's own jinja chat template, rendered as transformers renders it,
then turned into token ids so that only the template's own special tokens become special ids.

Template. `load_chat_template(dir)` reads `chat_template.jinja` when present, else the
`chat_template` entry of `tokenizer_config.json` (a string, or a list of named templates); the
file wins when both exist, as in transformers' `from_pretrained`. A checkpoint without one gets
`FALLBACK_CHAT_TEMPLATE`, the single source of the engine's own rendering of Kimi-K2.5's
format (see its comment).

Rendering (`render_template`; jinja2 only, transformers is not imported) reproduces
`PreTrainedTokenizerBase.apply_chat_template(..., tokenize=False)` of transformers 5: message
keys whose value is None are dropped, every input is rebuilt from plain JSON types, a message's
reasoning is aliased under `reasoning_content` and `thinking`, and the template runs in the same
jinja environment (immutable sandbox, `trim_blocks`, `lstrip_blocks`, loop controls, the
`{% generation %}` tag, a `tojson` filter that does not escape HTML and keeps non-ASCII,
`raise_exception`, `strftime_now`, `namespace`, `dict`). Template variables are `messages`,
`tools`, `documents` (None), `add_generation_prompt`, the checkpoint's named special tokens
(`bos_token`, `eos_token`, ...) and any extra template kwargs (`thinking`, or whatever
`chat_template_kwargs` a request carries), which override the named tokens. `ChatRenderer` adds
what Kimi's own tokenizer adds in its `apply_chat_template` override: tool definitions have
their dict keys sorted recursively before rendering, and a template that reads `tools_ts_str`
(K2.5's) gets the TypeScript-style declaration of the sorted tools under that name
(`engine.tool_declaration`; it replaces a caller's value, as in Kimi's tokenizer), unless the
encoder rejects a schema, when the template falls back to its JSON declaration. Tool-call
`arguments` given as strings are rendered verbatim (vLLM parses them into dicts first; the engine
leaves that to callers).

Special tokens typed by users. Before rendering, every string the caller supplies (message
fields, tool definitions, template kwargs; dict keys too) has each special-token string in it
wrapped in two private-use markers, U+F0000 before and U+F0001 after (any such characters
already in the input are removed first, so a marked token cannot be forged). Wrapping, unlike
replacing, keeps string operations in templates (`'</think>' in content`, `split`) working. The
rendered text is then cut at the markers: a wrapped token is ordinary text; a lone marker (a
template cut a wrapped token apart) is dropped but still separates its two sides, so they cannot
join into a special token; in the rest, each exact special-token string is one special id. All
ordinary text between two real special ids is encoded in one piece, so a user's content encodes
exactly as `Tokenizer.encode(content)` would. Known limits (transformers' own marking has them
too; no Kimi template is affected): a template that slices user strings by position counts the
marker characters, and one that escapes non-ASCII (`tojson(ensure_ascii=True)`) turns the
markers into `\\udb80\\udc00` text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from engine.config import error_text
from engine.tool_declaration import tools_ts_str

CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."
# K2.5's template variable for the TypeScript-style tool declaration (engine.tool_declaration).
TOOLS_TS_KWARG = "tools_ts_str"


class TokenizerError(ValueError):
    """A tokenizer file or a chat request is malformed."""


class Encoder(Protocol):
    """What the renderer needs of a tokenizer (`engine.tokenizer.Tokenizer`)."""

    special_tokens: dict[str, int]
    special_pattern: re.Pattern[str]

    def encode(self, text: str) -> list[int]: ...

MARK_START = "\U000f0000"
MARK_END = "\U000f0001"

# Names under which a message may carry its reasoning; transformers copies the first one set to
# `thinking` and `reasoning_content`, the name chat templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Template variables set by the renderer itself (and jinja's own `self`).
_RESERVED_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "self"})
# The named special tokens transformers passes to every template (its SPECIAL_TOKENS_ATTRIBUTES).
_NAMED_TOKEN_KEYS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)

# The engine's rendering of Kimi's chat format, for checkpoints without a template. It follows
# Kimi-K2.5's template (tests/fixtures/chat/kimi_k25.jinja) for text messages:
# - a first turn `<|im_system|>tool_declare<|im_middle|>{declaration}<|im_end|>` when tools are
#   given: `tools_ts_str` (the TypeScript-style declaration ChatRenderer computes), else the tools
#   as compact JSON; no default system prompt is added;
# - each message `<|im_{opener}|>{name or role}<|im_middle|>{content}<|im_end|>` (tool results
#   open with <|im_system|>); list content is the concatenation of its text parts;
# - assistant tool calls `<|tool_calls_section_begin|><|tool_call_begin|>{id}
#   <|tool_call_argument_begin|>{arguments}<|tool_call_end|>...<|tool_calls_section_end|>` after
#   the content; string arguments are kept verbatim, others rendered with `tojson`;
# - a tool result `## Return of {tool_call_id}\n{content}`;
# - thinking is on unless the `thinking` kwarg is false (K2.5's switch): assistant turns up to
#   the last one without tool calls get `<think></think>` (earlier reasoning is dropped); later
#   ones (the tool-calling turn in progress) get `<think>{reasoning_content}</think>`, or
#   `<think></think>` when thinking is false; the generation prompt
#   `<|im_assistant|>assistant<|im_middle|>` then ends in `<think>`, or `<think></think>` when
#   thinking is false.
# Beyond K2.5 (which renders such input as "None" or fails): a call without an id gets
# `functions.{name}:{n}`, n counting calls so far; a tool result without a tool_call_id is just
# its content; a message whose content is None has empty content.
FALLBACK_CHAT_TEMPLATE = (
    "{%- macro content_text(message) -%}"
    "{%- set c = message.get('content') -%}"
    "{%- if c is string -%}{{ c }}"
    "{%- elif c is not none -%}{%- for part in c -%}{{ part['text'] }}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set ns = namespace(last_plain=-1, calls=0) -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' and not m.get('tool_calls') -%}"
    "{%- set ns.last_plain = loop.index0 -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if tools -%}"
    "<|im_system|>tool_declare<|im_middle|>"
    "{%- if tools_ts_str -%}{{ tools_ts_str }}"
    "{%- else -%}{{ tools | tojson(separators=(',', ':')) }}"
    "{%- endif -%}"
    "<|im_end|>"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- set role = message['role'] -%}"
    "{%- set name = message.get('name') or role -%}"
    "{%- if role == 'user' -%}<|im_user|>{{ name }}<|im_middle|>{{ content_text(message) }}"
    "{%- elif role == 'assistant' -%}<|im_assistant|>{{ name }}<|im_middle|>"
    "{%- if loop.index0 > ns.last_plain and thinking is not false -%}"
    "<think>{{ message.get('reasoning_content') or '' }}</think>"
    "{%- else -%}<think></think>"
    "{%- endif -%}"
    "{{ content_text(message) }}"
    "{%- if message.get('tool_calls') -%}<|tool_calls_section_begin|>"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set fn = call['function'] -%}"
    "<|tool_call_begin|>{{ call.get('id') or 'functions.' ~ fn['name'] ~ ':' ~ ns.calls }}"
    "<|tool_call_argument_begin|>"
    "{%- if fn['arguments'] is string -%}{{ fn['arguments'] }}"
    "{%- else -%}{{ fn['arguments'] | tojson }}{%- endif -%}"
    "<|tool_call_end|>"
    "{%- set ns.calls = ns.calls + 1 -%}"
    "{%- endfor -%}"
    "<|tool_calls_section_end|>"
    "{%- endif -%}"
    "{%- elif role == 'tool' -%}<|im_system|>{{ name }}<|im_middle|>"
    "{%- if message.get('tool_call_id') -%}## Return of {{ message['tool_call_id'] ~ '\\n' }}"
    "{%- endif -%}"
    "{{ content_text(message) }}"
    "{%- else -%}<|im_system|>{{ name }}<|im_middle|>{{ content_text(message) }}"
    "{%- endif -%}"
    "<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is false -%}<think></think>{%- else -%}<think>{%- endif -%}"
    "{%- endif -%}"
)

ChatTemplateSource = str | Mapping[str, str]


# ---------------------------------------------------------------- loading


def load_chat_template(
    path: str | Path, config: Mapping[str, Any] | None = None
) -> ChatTemplateSource | None:
    """The checkpoint's chat template(s) in directory `path`, or None when it ships none.

    `chat_template.jinja` wins over `tokenizer_config.json`'s `chat_template` (as in
    transformers). A config list `[{"name": ..., "template": ...}]` becomes a name -> template
    mapping. `config` is the already-parsed tokenizer_config.json, if the caller has it.
    """
    root = Path(path)
    jinja_file = root / CHAT_TEMPLATE_FILE
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"cannot read {jinja_file}: {e}") from e
    if config is None:
        config_file = root / CONFIG_FILE
        if not config_file.is_file():
            return None
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TokenizerError(f"cannot read {config_file}: {e}") from e
    if not isinstance(config, Mapping):
        return None
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named: dict[str, str] = {}
        for k, entry in enumerate(template):
            if not (isinstance(entry, Mapping) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise TokenizerError(f"{CONFIG_FILE}: chat_template[{k}] must be "
                                     "{'name': str, 'template': str}")
            named[entry["name"]] = entry["template"]
        return named
    if isinstance(template, Mapping) and all(isinstance(v, str) for v in template.values()):
        return dict(template)
    raise TokenizerError(f"{CONFIG_FILE}: chat_template must be a string or named templates")


def named_special_tokens(config: Mapping[str, Any] | None) -> dict[str, str]:
    """`bos_token`, `eos_token`, ... of a tokenizer_config.json, as transformers hands them to
    every template (plain strings; an AddedToken-style dict gives its `content`)."""
    out: dict[str, str] = {}
    for key in _NAMED_TOKEN_KEYS:
        value = (config or {}).get(key)
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def select_template(source: ChatTemplateSource | None, tools: object = None) -> str:
    """One template out of `source`: named ones pick "tool_use" when tools are given, else
    "default" (transformers' rule); None picks the fallback."""
    if source is None:
        return FALLBACK_CHAT_TEMPLATE
    if isinstance(source, str):
        return source
    if tools is not None and "tool_use" in source:
        return source["tool_use"]
    if "default" in source:
        return source["default"]
    raise TokenizerError(f"no default chat template among {sorted(source)}")


# ---------------------------------------------------------------- jinja environment


class _GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}`: marks assistant text for training
    masks; renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Any) -> str:
        return str(caller())


class _TemplateDict:
    """`dict(...)` for templates without exposing the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore attributes, as transformers' does."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore attributes on a namespace: {name!r}"
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """Compiles `source` in transformers' chat-template environment (cached per source)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise TokenizerError(f"chat template does not compile: {e}") from e


# ---------------------------------------------------------------- rendering


def _plain(value: Any) -> Any:
    """A copy of `value` built from JSON-like types only (transformers' `_plain_template_data`);
    anything else becomes a placeholder naming its type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next(
        (message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None
    )
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def render_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    **template_kwargs: Any,
) -> str:
    """Renders exactly what transformers' `apply_chat_template(messages, tools=tools,
    chat_template=template, add_generation_prompt=..., tokenize=False, **template_kwargs)`
    renders (pass the tokenizer's named special tokens in `template_kwargs`).

    Template errors, `raise_exception(...)` and sandbox violations raise TokenizerError.
    """
    chat = [
        _alias_reasoning(_plain({k: v for k, v in m.items() if v is not None})) for m in messages
    ]
    compiled = compile_template(template)
    try:
        return compiled.render(
            messages=chat,
            tools=_plain(list(tools)) if tools is not None else None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **_plain(template_kwargs),
        )
    except jinja2.TemplateError as e:  # includes SecurityError and UndefinedError
        raise TokenizerError(f"chat template: {e}") from e
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise TokenizerError(f"chat template failed: {type(e).__name__}: {e}") from e


def sort_keys_deep(obj: Any) -> Any:
    """`obj` with every dict's keys sorted, recursively (Kimi's tokenizer does this to tools)."""
    if isinstance(obj, Mapping):
        return {k: sort_keys_deep(obj[k]) for k in sorted(obj)}
    if isinstance(obj, list | tuple):
        return [sort_keys_deep(v) for v in obj]
    return obj


# ---------------------------------------------------------------- validation


class _Open(BaseModel):  # keys beyond the declared ones reach the template as given
    model_config = ConfigDict(extra="allow", strict=True)


class Part(_Open):
    """A content part: text, or an image (`engine.media` reads its source, the template
    renders its placeholder)."""

    type: Literal["text", "image_url", "image"]
    text: str | None = None

    @model_validator(mode="after")
    def _text_has_text(self) -> Part:
        if self.type == "text" and self.text is None:
            raise ValueError("a text part needs its text")
        return self


class CalledFunction(_Open):
    name: Annotated[str, Field(min_length=1)]
    arguments: str | dict[str, Any]


class ToolCall(_Open):
    id: str | None = None
    function: CalledFunction


class Message(_Open):
    """One message of an OpenAI-style conversation, as far as the renderer relies on it."""

    role: Literal["system", "user", "assistant", "tool"]
    # NOTE: a string checks as one text part, so a bad value gets one error, not one per type
    content: Annotated[list[Part] | None, BeforeValidator(
        lambda v: [{"type": "text", "text": v}] if isinstance(v, str) else v)] = None
    tool_calls: list[ToolCall] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _content_or_calls(self) -> Message:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls are only allowed on assistant messages")
        if self.content is None and not self.tool_calls:
            raise ValueError("content (a string or a list of text parts) is required "
                             "unless the message has tool_calls")
        return self


Messages = Annotated[list[Message], Field(min_length=1)]
class _Conversation(BaseModel):
    model_config = ConfigDict(strict=True)
    messages: Messages
    tools: list[dict[str, Any]] | None = None


def validate_messages(messages: object, tools: object = None) -> None:
    """Checks the shape of an OpenAI-style conversation and its tools; the error names the
    offending field (`messages.0.role: ...`)."""
    try:
        _Conversation.model_validate({"messages": messages, "tools": tools})
    except ValidationError as e:
        raise TokenizerError(error_text(e)) from e


# ---------------------------------------------------------------- marking and encoding


def mark_specials(obj: Any, pattern: re.Pattern[str]) -> Any:
    """Wraps every special-token string inside the strings of `obj` (recursively, dict keys too)
    in MARK_START/MARK_END; marker characters already present are removed first."""
    if isinstance(obj, str):
        obj = obj.replace(MARK_START, "").replace(MARK_END, "")
        return pattern.sub(lambda m: MARK_START + m.group(0) + MARK_END, obj)
    if isinstance(obj, Mapping):
        return {mark_specials(k, pattern): mark_specials(v, pattern) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [mark_specials(v, pattern) for v in obj]
    return obj


def unmark(text: str) -> str:
    """`text` with every marker character removed (the string the template would have given)."""
    return text.replace(MARK_START, "").replace(MARK_END, "")


class ChatRenderer:
    """Renders conversations with one chat template and encodes them for one tokenizer.

    `template`: the checkpoint's template (a string or name -> template), None for the fallback.
    `special_tokens_map`: the named special tokens the template sees (`bos_token`, ...).
    """

    def __init__(
        self,
        tokenizer: Encoder,
        template: ChatTemplateSource | None = None,
        special_tokens_map: Mapping[str, str] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.special_tokens_map = dict(special_tokens_map or {})
        self._specials_re = tokenizer.special_pattern
        self._markers_re = re.compile(
            f"{MARK_START}({self._specials_re.pattern}){MARK_END}|[{MARK_START}{MARK_END}]"
        )

    def _inputs(
        self, messages: object, tools: object, template_kwargs: Mapping[str, Any]
    ) -> tuple[str, Any, Any, dict[str, Any]]:
        validate_messages(messages, tools)
        clash = _RESERVED_KWARGS & set(template_kwargs)
        if clash:
            raise TokenizerError(f"template kwargs {sorted(clash)} are set by the renderer")
        template = select_template(self.template, tools)
        sorted_tools = sort_keys_deep(tools) if tools is not None else None
        kw = dict(template_kwargs)
        if sorted_tools and TOOLS_TS_KWARG in template:
            declared = tools_ts_str(sorted_tools)
            if declared is not None:  # else the template declares the tools as JSON
                kw[TOOLS_TS_KWARG] = declared
        return template, messages, sorted_tools, kw

    def render(
        self,
        /,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text, exactly as transformers' apply_chat_template(tokenize=False) gives
        it for the same template, messages, key-sorted tools and kwargs."""
        template, msgs, tls, kw = self._inputs(messages, tools, template_kwargs)
        return render_template(template, msgs, tls, add_generation_prompt,
                               **{**self.special_tokens_map, **kw})

    def encode(
        self,
        /,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered prompt: special tokens the template writes become special
        ids; special-token strings inside the caller's strings stay plain text."""
        template, msgs, tls, kw = self._inputs(messages, tools, template_kwargs)
        pattern = self._specials_re
        marked = render_template(
            template,
            mark_specials(msgs, pattern),
            mark_specials(tls, pattern) if tls is not None else None,
            add_generation_prompt,
            **{**self.special_tokens_map, **mark_specials(kw, pattern)},
        )
        return self.encode_rendered(marked)

    def encode_rendered(self, text: str) -> list[int]:
        """Ids of a prompt rendered from marked inputs (see the module docstring)."""
        specials = self.tokenizer.special_tokens
        encode = self.tokenizer.encode
        ids: list[int] = []
        plain: list[str] = []  # ordinary text since the last real special token
        # split() with one group: [template text, marked token or None, template text, ...]
        for k, piece in enumerate(self._markers_re.split(text)):
            if k % 2:
                if piece is not None:
                    plain.append(piece)  # a caller's special-token string: plain text
                continue  # a lone marker: dropped, but the template texts around stay apart
            last = 0
            for m in self._specials_re.finditer(piece):
                plain.append(piece[last : m.start()])
                if any(plain):
                    ids.extend(encode("".join(plain)))
                plain = []
                ids.append(specials[m.group(0)])
                last = m.end()
            plain.append(piece[last:])
        if any(plain):
            ids.extend(encode("".join(plain)))
        return ids
