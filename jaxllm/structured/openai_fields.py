"""OpenAI's request fields → `StructuredOutputsParams`, and forced tool calls → OpenAI `tool_calls`.

Pure translation, no HTTP: the server calls `output_constraint(request)` on its parsed request
(any object with the OpenAI field names), and turns a `RequestFieldError` into a 400 naming `param`.

- `response_format`: `{"type": "text"}`, `{"type": "json_object"}` (with a `"schema"`, as
  instructor's JSON_SCHEMA mode and some providers send it: that schema),
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`.
- `structured_outputs` (vLLM's extra field): the keys of `StructuredOutputsParams`; vLLM's older
  `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` and `guided_whitespace_pattern`
  fields mean the same.
- `tools` + `tool_choice`: a named function (`{"type": "function", "function": {"name"}}`)
  constrains the output to that function's arguments (JSON valid against its `parameters`);
  `"required"` to a JSON array of `{"name", "parameters"}` calls of the given functions (one call
  when `parallel_tool_calls` is false). `"none"` and `"auto"` (the default when tools are given)
  constrain nothing: under `"auto"` the model decides, and the server's tool-call parser reads its
  calls back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxllm.sampling_params import StructuredOutputsParams

STRUCTURED_OUTPUTS_KEYS = ("json", "json_object", "regex", "choice", "grammar", "whitespace_pattern")
# vLLM's deprecated request fields → the structured_outputs key each stands for
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "guided_whitespace_pattern": "whitespace_pattern",
}


class RequestFieldError(ValueError):
    """A bad structured-output field of an HTTP request; `param` names it (OpenAI's error `param`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class OutputConstraint:
    params: StructuredOutputsParams | None  # what to constrain the output to (None: nothing)
    tool_call: ForcedToolCall | None  # set when the output is a forced tool call, to be read back as one


def output_constraint(request) -> OutputConstraint:
    """The constraint a request asks for through `response_format`, `structured_outputs` or forced `tools`."""
    given = []
    if (fmt := _response_format(getattr(request, "response_format", None))) is not None:
        given.append(("response_format", fmt))
    if (so := getattr(request, "structured_outputs", None)) is not None:
        given.append(("structured_outputs", _structured_outputs(so)))
    named = [field for field in GUIDED_FIELDS if getattr(request, field, None) is not None]
    guided = {GUIDED_FIELDS[field]: getattr(request, field) for field in named}
    if guided:
        first = named[0]
        if set(guided) == {"whitespace_pattern"} and given:  # vLLM's whitespace option for another constraint
            name, params = given[-1]
            given[-1] = (name, _with_whitespace(params, guided["whitespace_pattern"], first))
        else:
            given.append((first, _params(first, **guided)))
    if (call := forced_tool_call(request)) is not None:
        given.append(("tool_choice", call.constraint))
    if len(given) > 1:
        names = " and ".join(name for name, _ in given)
        raise RequestFieldError(f"only one output constraint per request: got {names}", given[1][0])
    return OutputConstraint(given[0][1] if given else None, call)


def _response_format(fmt: Any) -> StructuredOutputsParams | None:
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        schema = fmt.get("schema")
        if schema is not None:
            if not isinstance(schema, dict):
                raise RequestFieldError("response_format.schema must be a JSON schema object", "response_format.schema")
            return _params("response_format.schema", json=schema)
        return _params("response_format", json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise RequestFieldError(
                "response_format json_schema needs a 'json_schema' object with a 'schema' object",
                "response_format.json_schema",
            )
        return _params("response_format.json_schema.schema", json=spec["schema"])
    raise RequestFieldError(
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", "response_format.type"
    )


def _structured_outputs(fields: Any) -> StructuredOutputsParams:
    if not isinstance(fields, dict):
        raise RequestFieldError("structured_outputs must be an object", "structured_outputs")
    unknown = sorted(set(fields) - set(STRUCTURED_OUTPUTS_KEYS))
    if unknown:
        raise RequestFieldError(
            f"structured_outputs: unsupported key(s) {', '.join(unknown)}; supported: "
            f"{', '.join(STRUCTURED_OUTPUTS_KEYS)}",
            f"structured_outputs.{unknown[0]}",
        )
    return _params("structured_outputs", **fields)


def _with_whitespace(params: StructuredOutputsParams, pattern: Any, param: str) -> StructuredOutputsParams:
    fields = {params.kind: getattr(params, params.kind), "whitespace_pattern": pattern}
    return _params(param, **fields)


def _params(param: str, **fields) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as e:
        raise RequestFieldError(str(e), param) from None


# ---- forced tool calls ------------------------------------------------------------------------


@dataclass
class ForcedToolCall:
    """The tool call a request forces: the function (None: any of them) and the constraint on the output.

    The server reads the output back as OpenAI `tool_calls` (entrypoints/openai/tool_parsers/forced.py).
    """

    named: str | None  # the function tool_choice names, or None for "required" (any of the tools)
    constraint: StructuredOutputsParams


def forced_tool_call(request) -> ForcedToolCall | None:
    """The call `tools` + `tool_choice` force, or None when they force nothing."""
    tools, choice = getattr(request, "tools", None), getattr(request, "tool_choice", None)
    if choice == "none" or (choice is None and not tools):
        return None
    functions = _functions(tools)
    if choice is None or choice == "auto":
        return None  # the model decides; a tool-call parser reads its calls back
    if choice == "required":
        calls = [
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", "parameters"],
                "properties": {"name": {"const": name}, "parameters": schema},
            }
            for name, schema in functions.items()
        ]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if getattr(request, "parallel_tool_calls", True) is False:
            array["maxItems"] = 1
        return ForcedToolCall(None, _params("tools", json=array))
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise RequestFieldError(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
    if name not in functions:
        raise RequestFieldError(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
    return ForcedToolCall(name, _params("tools", json=functions[name]))


def tool_names(request) -> list[str]:
    """The names of the request's function tools (checked as `forced_tool_call` checks them)."""
    return list(_functions(getattr(request, "tools", None)))


def _functions(tools: Any) -> dict[str, dict]:
    """name → parameters schema of each function tool."""
    if not isinstance(tools, list) or not tools:
        raise RequestFieldError("tool_choice needs a non-empty 'tools' list", "tools")
    functions = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestFieldError(
                "each tool must be {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}", f"tools.{i}"
            )
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise RequestFieldError("a function's parameters must be a JSON schema object", f"tools.{i}")
        functions[function["name"]] = parameters
    return functions
