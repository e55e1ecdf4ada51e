"""Kimi K2.5's TypeScript-style tool declaration (`tools_ts_str`), pure Python.

K2.5's tokenizer (`tokenization_kimi.py`, whose encoder lives in `tool_declaration_ts.py`) sorts
the request's tools' keys recursively, turns them into the text below and hands it to the chat
template as `tools_ts_str`; the template declares tools with it, and with compact JSON only when
it is missing or empty. When the encoder fails on a schema it does not support, the tokenizer
falls back to the JSON declaration: `encode_tools` raises ToolDeclarationError then.

    # Tools

    ## functions
    namespace functions {
    // {function description, one `// ` line per line}
    type {name} = (_: {
      // {parameter description}
      // {constraints: `maxLength: 5, minLength: 1`}
      // Default: {default}
      {name}: {type},
      {optional name}?: {type}
    }) => any;
    }

The rules, as the reference encoder applies them:

- Object fields: required ones first, then optional ones (`?`), each group sorted by name; fields
  joined by `,\\n`, two spaces of indent per level; `additionalProperties` adds
  `[k: string]: any` (true), `never` (false) or the schema's type; an object without fields is
  `{}`.
- A schema is read in this order: `$ref` (`#/$defs/Name` gives `Name`, `#` gives `parameters`),
  `anyOf` (`A | B`), `enum` (`"a" | 1 | True | None`: strings quoted, other values as Python
  prints them; values must match a declared `type`), `type` (a list is a union: `string | null`,
  `{}` for object, `Array<any>` for array; `object`; `array`: `Array<item>`, the item on its own
  lines when it has a description or constraints; `integer` is `number`; other names as given),
  `{}` (`any`), `true` (`any`), `false` (`null`); anything else is an error.
- Comments above a field: its description (an empty line stays empty), then its constraints
  sorted by key (`maxLength`, `minLength`, `pattern` for strings; `maximum`, `minimum` for numbers;
  `maxItems`, `minItems` for arrays; values as Python's `str`), then `Default: ` (JSON for strings
  and containers, Python's `repr` for numbers and booleans; a null default is not shown).
- `$defs` (registered when an object holding them is read, before its fields) become
  `interface Name {...}` lines before the function's description, in their insertion order
  (Kimi's key sort makes that alphabetical), each after its own description; a `$ref` to a name
  not registered yet, or of another form, is an error. A self-reference (`#`) declares the
  parameters as `interface parameters {...}` (fields in schema order, without
  `additionalProperties`) and types the function `(_: parameters)`.
- Tools whose `type` is not `function`, or with an empty `function`, are skipped; no function
  left gives "".
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

INDENT = "  "
FIELD_DELIMITER = ",\n"

_CONSTRAINTS = {
    "string": ("maxLength", "minLength", "pattern"),
    "number": ("maximum", "minimum"),
    "integer": ("maximum", "minimum"),
}
_ARRAY_CONSTRAINTS = ("minItems", "maxItems")
_UNION_NAMES = {"string": "string", "number": "number", "integer": "number",
                "boolean": "boolean", "null": "null", "object": "{}", "array": "Array<any>"}


class ToolDeclarationError(ValueError):
    """A tool schema the TypeScript encoder does not support (the template then gets JSON)."""


def _py_str(value: Any) -> str:
    """`str(value)` as Python prints it (`True`, `None`, `1.5`, `['a']`)."""
    return str(value)


def comment(text: Any, indent: str = "") -> str:
    """`text` as `// ` lines at `indent`; empty lines stay empty."""
    if not isinstance(text, str):
        raise ToolDeclarationError(f"a description must be a string, not {type(text).__name__}")
    return "\n".join(f"{indent}// {line}" if line else "" for line in text.split("\n"))


class _Registry:
    """`$defs` seen so far, in insertion order, and whether the schema refers to itself."""

    def __init__(self) -> None:
        self.definitions: dict[str, Any] = {}
        self.self_ref = False

    def add(self, defs: Any) -> None:
        if not defs:
            return
        if not isinstance(defs, Mapping):
            raise ToolDeclarationError("$defs must be an object")
        self.definitions.update(defs)

    def resolve(self, ref: Any) -> str:
        if ref == "#":
            self.self_ref = True
            return "parameters"
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            name = ref.split("/")[-1]
            if name not in self.definitions:
                raise ToolDeclarationError(f"reference not found: {ref}")
            return name
        raise ToolDeclarationError(f"unsupported reference: {ref!r}")


class _Type:
    """One parsed schema: `render(indent)` gives its type text, `docs(indent)` its comments."""

    def __init__(self, schema: Any, constraint_keys: Sequence[str] = (),
                 render: Callable[[str], str] = lambda indent: "any") -> None:
        schema = schema if isinstance(schema, Mapping) else {}
        self.description = schema.get("description", "")
        self.constraints = {k: v for k, v in schema.items() if k in constraint_keys}
        self.render = render

    def docs(self, indent: str) -> str:
        lines = []
        if self.description:
            lines.append(comment(self.description, indent))
        if self.constraints:
            pairs = ", ".join(f"{k}: {_py_str(v)}" for k, v in sorted(self.constraints.items()))
            lines.append(f"{indent}// {pairs}")
        return "".join(line + "\n" for line in lines)


class _Field:
    def __init__(self, name: str, type_: _Type, optional: bool, default: Any) -> None:
        self.name, self.type, self.optional, self.default = name, type_, optional, default

    def render(self, indent: str) -> str:
        out = self.type.docs(indent)
        if self.default is not None:
            d = self.default
            shown = (repr(d) if isinstance(d, int | float | bool)
                     else json.dumps(d, ensure_ascii=False))
            out += f"{indent}// Default: {shown}\n"
        mark = "?" if self.optional else ""
        return f"{out}{indent}{self.name}{mark}: {self.type.render(indent)}"


class _Object(_Type):
    def __init__(self, schema: Any, registry: _Registry) -> None:
        super().__init__(schema, render=self._render)
        self.fields: list[_Field] = []
        self.additional: Any = None
        if not schema:
            return
        if not isinstance(schema, Mapping):
            raise ToolDeclarationError(f"an object schema must be an object, not {schema!r}")
        if "$defs" in schema:
            registry.add(schema["$defs"])
        extra = schema.get("additionalProperties")
        self.additional = _parse(extra, registry) if isinstance(extra, Mapping) else extra
        if "properties" not in schema:
            return
        props = schema["properties"]
        try:
            required = set(schema.get("required", []))
        except TypeError as e:
            raise ToolDeclarationError("required must be a list of names") from e
        if not isinstance(props, Mapping):
            raise ToolDeclarationError("properties must be an object")
        self.fields = [
            _Field(name, _parse(prop, registry), name not in required,
                   prop.get("default") if isinstance(prop, Mapping) else None)
            for name, prop in props.items()
        ]

    def field_lines(self, indent: str, ordered: bool = True) -> list[str]:
        fields = self.fields
        if ordered:
            fields = (sorted((f for f in fields if not f.optional), key=lambda f: f.name)
                      + sorted((f for f in fields if f.optional), key=lambda f: f.name))
        return [f.render(indent) for f in fields]

    def _render(self, indent: str) -> str:
        inner = indent + INDENT
        lines = self.field_lines(inner)
        if self.additional is not None:
            if self.additional is True:
                extra = "any"
            elif self.additional is False:
                extra = "never"
            elif isinstance(self.additional, _Type):
                extra = self.additional.render(inner)
            else:
                raise ToolDeclarationError(f"unknown additionalProperties: {self.additional!r}")
            lines.append(f"{inner}[k: string]: {extra}")
        if not lines:
            return "{}"
        return "{\n" + FIELD_DELIMITER.join(lines) + "\n" + indent + "}"


def _array(schema: Mapping[str, Any], registry: _Registry) -> _Type:
    items = schema.get("items")
    item = _parse(items, registry) if items else _Type({})

    def render(indent: str) -> str:
        inner = indent + INDENT
        docs = item.docs(inner)
        if docs:
            return f"Array<\n{docs}{inner}{item.render(inner)}\n{indent}>"
        # NOTE: an item without comments is rendered at the array's own indent (as the
        # reference does), so an object item's fields sit one level shallower than above
        return f"Array<{item.render(indent)}>"

    return _Type(schema, _ARRAY_CONSTRAINTS, render)


def _enum(schema: Mapping[str, Any]) -> _Type:
    values = schema["enum"]
    if not isinstance(values, list | tuple):
        raise ToolDeclarationError("enum must be a list")
    if "type" in schema:
        typ = schema["type"]
        if isinstance(typ, list):
            if len(typ) == 2 and "null" in typ:
                typ = typ[0] if typ[0] != "null" else typ[1]
            elif len(typ) == 1:
                typ = typ[0]
            else:
                raise ToolDeclarationError(f"enum type {typ} is not supported")
        checks = {"string": lambda v: isinstance(v, str),
                  "number": lambda v: isinstance(v, int | float),
                  "integer": lambda v: isinstance(v, int),
                  "boolean": lambda v: isinstance(v, bool)}
        check = checks.get(typ) if isinstance(typ, str) else None
        for v in values:
            if v is not None and check is not None and not check(v):
                raise ToolDeclarationError(f"enum value {v!r} is not a {typ}")
    text = " | ".join(f'"{v}"' if isinstance(v, str) else _py_str(v) for v in values)
    return _Type(schema, render=lambda indent: text)


def _parse(schema: Any, registry: _Registry) -> _Type:
    if isinstance(schema, bool):
        name = "any" if schema else "null"
        return _Type({}, render=lambda indent: name)
    if not isinstance(schema, Mapping):
        raise ToolDeclarationError(f"invalid JSON schema: {schema!r}")
    if "$ref" in schema:
        name = registry.resolve(schema["$ref"])
        return _Type(schema, render=lambda indent: name)
    if "anyOf" in schema:
        branches = schema["anyOf"]
        if not isinstance(branches, list | tuple):
            raise ToolDeclarationError("anyOf must be a list")
        types = [_parse(t, registry) for t in branches]
        return _Type(schema, render=lambda indent: " | ".join(t.render(indent) for t in types))
    if "enum" in schema:
        return _enum(schema)
    if "type" in schema:
        typ = schema["type"]
        if isinstance(typ, list):
            try:
                text = " | ".join(_UNION_NAMES[t] for t in typ)
            except (KeyError, TypeError) as e:
                raise ToolDeclarationError(f"unsupported type union {typ!r}") from e
            return _Type(schema, render=lambda indent: text)
        if typ == "object":
            return _Object(schema, registry)
        if typ == "array":
            return _array(schema, registry)
        if not isinstance(typ, str):
            raise ToolDeclarationError(f"unsupported type {typ!r}")
        name = "number" if typ == "integer" else typ
        return _Type(schema, _CONSTRAINTS.get(typ, ()), lambda indent: name)
    if not schema:
        return _Type({})
    raise ToolDeclarationError(f"invalid JSON schema object: {dict(schema)!r}")


def encode_function(function: Mapping[str, Any]) -> str:
    """One function's declaration: its `$defs` interfaces, description and `type` line."""
    registry = _Registry()
    params = _Object(function.get("parameters") or {}, registry)
    interfaces = []
    # NOTE: decided before the $defs are read: a `#` found only inside them does not count
    self_ref = registry.self_ref
    if self_ref:
        body = FIELD_DELIMITER.join(params.field_lines(INDENT, ordered=False))
        interfaces.append("interface parameters {" + (f"\n{body}\n" if body else "") + "}")
    for name, schema in dict(registry.definitions).items():
        if not isinstance(schema, Mapping):
            raise ToolDeclarationError(f"$defs.{name} must be an object")
        described = schema.get("description", "")
        head = comment(described) + "\n" if described else ""
        interfaces.append(f"{head}interface {name} {_parse(schema, registry).render('')}")
    name = function.get("name", "function")
    arg = "parameters" if self_ref else params.render("")
    description = function.get("description")
    parts = ["\n".join(interfaces), comment(description) if description else "",
             f"type {name} = (_: {arg}) => any;"]
    return "\n".join(p for p in parts if p)


def encode_tools(tools: Sequence[Mapping[str, Any]] | None) -> str:
    """`tools_ts_str` of OpenAI-style tools (pass them key-sorted, as Kimi's tokenizer does);
    raises ToolDeclarationError on a schema the reference encoder rejects."""
    if not tools:
        return ""
    functions = []
    try:
        for tool in tools:
            if not isinstance(tool, Mapping) or tool.get("type") != "function":
                continue
            function = tool.get("function") or {}
            if function:
                if not isinstance(function, Mapping):
                    raise ToolDeclarationError("a tool's function must be an object")
                functions.append(encode_function(function))
    except RecursionError as e:
        raise ToolDeclarationError("tool schema nested too deeply") from e
    if not functions:
        return ""
    return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(functions) + "\n}\n"


def tools_ts_str(tools: Sequence[Mapping[str, Any]] | None) -> str | None:
    """What Kimi's tokenizer passes the template: the declaration, or None when the encoder
    rejects the tools (the template then declares them as JSON)."""
    try:
        return encode_tools(tools)
    except ToolDeclarationError:
        return None
