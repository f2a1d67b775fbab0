"""Tools an agent can call: plain typed Python functions, each described to the model by a JSON schema
generated from its signature and docstring.

    def add(a: int, b: int) -> int:
        '''Add two integers.

        Args:
            a: the first addend
            b: the second addend
        '''
    tool = Tool.from_function(add)     # tool.schema() is an OpenAI {"type": "function", ...} definition
    tool.call('{"a": 2, "b": 3}')       # "5"

A call never raises into the agent loop: bad arguments and failures come back as text starting with
"error:" so the model can read what went wrong and try again.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object"}
# Small models copy these from the schema into their arguments (Qwen2.5-Coder-0.5B: {"expression": "2*3",
# "required": ["expression"]}); undeclared, they are dropped rather than failing the call.
_SCHEMA_WORDS = frozenset({"required", "additionalProperties", "properties", "type", "title", "description"})
_PYTHON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}


class ToolError(ValueError):
    """A tool's own complaint about its input, shown to the model as `error: <message>`."""


def _json_schema(annotation: Any, where: str) -> dict:
    """The JSON schema of a parameter's type annotation (str, int, float, bool, dict, list[X], Literal,
    X | None)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    if origin is Literal:
        kinds = {type(a) for a in args}
        if len(kinds) != 1 or next(iter(kinds)) not in _JSON_TYPES:
            raise TypeError(f"{where}: Literal values must all be of one JSON type, got {args}")
        return {"type": _JSON_TYPES[next(iter(kinds))], "enum": list(args)}
    if origin in (list, tuple) and args:
        return {"type": "array", "items": _json_schema(args[0], where)}
    if origin in (typing.Union, types.UnionType) and type(None) in args and len(args) == 2:
        return _json_schema(next(a for a in args if a is not type(None)), where)
    raise TypeError(f"{where}: annotate it with str, int, float, bool, dict, list[...], Literal[...] or X | None "
                    f"(got {annotation!r}) so that its JSON schema can be generated")


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """(the description before "Args:", {parameter: its description}) of a Google-style docstring."""
    doc = inspect.cleandoc(doc or "")
    head, _, rest = doc.partition("\nArgs:\n")
    described: dict[str, str] = {}
    name = None
    for line in rest.splitlines():
        match = re.match(r"\s{0,8}(\w+)\s*(?:\([^)]*\))?:\s*(.*)", line)
        if match and line[:1].isspace():
            name, described[match.group(1)] = match.group(1), match.group(2).strip()
        elif not line.strip() or not line[:1].isspace():
            name = None  # a blank line or a new section ends the Args block
        elif name:
            described[name] += " " + line.strip()
    return " ".join(head.split()), described


def _check_value(value: Any, schema: dict, where: str) -> Any:
    """`value` checked against a generated schema (ints are accepted as numbers); raises ToolError."""
    kind = schema.get("type")
    expected = _PYTHON_TYPES.get(kind) if isinstance(kind, str) else None
    if expected is None:  # a schema written elsewhere (an MCP server's) in terms not checked here
        return value
    if not isinstance(value, expected) or (kind in ("integer", "number") and isinstance(value, bool)):
        raise ToolError(f"{where} must be a JSON {kind}, got {json.dumps(value)[:60]}")
    if "enum" in schema and value not in schema["enum"]:
        raise ToolError(f"{where} must be one of {json.dumps(schema['enum'])}, got {json.dumps(value)[:60]}")
    if kind == "array" and isinstance(schema.get("items"), dict):
        return [_check_value(v, schema["items"], f"{where}[{i}]") for i, v in enumerate(value)]
    return value


@dataclass
class Tool:
    """A function the model may call: its name, what it does, its arguments' JSON schema."""

    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object
    fn: Callable[..., Any]

    @classmethod
    def from_function(cls, fn: Callable[..., Any], name: str | None = None) -> Tool:
        """A tool from a typed function; the docstring's first part describes it, its Args section the
        parameters. Parameters without defaults are required."""
        name = name or fn.__name__
        description, described = _docstring_parts(fn.__doc__ or "")
        if not description:
            raise ValueError(f"tool {name!r} has no docstring: write one; it tells the model what the tool does")
        hints = typing.get_type_hints(fn)
        properties, required = {}, []
        for param in inspect.signature(fn).parameters.values():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise TypeError(f"tool {name!r}: *args/**kwargs cannot be described to a model; name each parameter")
            if param.name not in hints:
                raise TypeError(f"tool {name!r}: parameter {param.name!r} has no type annotation")
            schema = _json_schema(hints[param.name], f"tool {name!r} parameter {param.name!r}")
            if param.name in described:
                schema["description"] = described[param.name]
            if param.default is inspect.Parameter.empty:
                required.append(param.name)
            elif param.default is not None:
                schema["default"] = param.default
            properties[param.name] = schema
        parameters = {"type": "object", "properties": properties, "required": required,
                      "additionalProperties": False}
        return cls(name, description, parameters, fn)

    def schema(self) -> dict:
        """The OpenAI tool definition (what `tools=[...]` of a chat completion takes)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def check_arguments(self, arguments: str | dict) -> dict:
        """The call's arguments (JSON text or a dict) checked against the schema; raises ToolError."""
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError as e:
                raise ToolError(f"the arguments are not valid JSON ({e}); send a JSON object") from None
        if not isinstance(arguments, dict):
            raise ToolError(f"the arguments must be a JSON object, got {json.dumps(arguments)[:60]}")
        properties = self.parameters.get("properties", {})
        arguments = {k: v for k, v in arguments.items() if k in properties or k not in _SCHEMA_WORDS}
        unknown = sorted(set(arguments) - set(properties))
        if unknown and self.parameters.get("additionalProperties") is False:
            raise ToolError(f"unknown argument(s) {', '.join(unknown)}; {self.name} takes "
                            f"{', '.join(properties) or 'no arguments'}")
        missing = [p for p in self.parameters.get("required", []) if p not in arguments]
        if missing:
            raise ToolError(f"missing required argument(s): {', '.join(missing)}")
        return {key: _check_value(value, properties.get(key, {}), key) for key, value in arguments.items()}

    def call(self, arguments: str | dict) -> str:
        """Run the tool; its result (or what went wrong, as "error: ...") as text for a `tool` message."""
        try:
            result = self.fn(**self.check_arguments(arguments))
        except ToolError as e:
            return f"error: {e}"
        except Exception as e:  # a tool's failure is the model's information, not the loop's crash
            return f"error: {type(e).__name__}: {e}"
        if isinstance(result, str):
            return result
        return json.dumps(result, ensure_ascii=False, default=str)


def toolset(tools: list[Tool]) -> dict[str, Tool]:
    """Tools by name; two tools of one name are an error (the model could not tell them apart)."""
    named: dict[str, Tool] = {}
    for tool in tools:
        if tool.name in named:
            raise ValueError(f"two tools are named {tool.name!r}; give each tool a unique name")
        named[tool.name] = tool
    return named
