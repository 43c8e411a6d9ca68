"""Constraint → llguidance grammar text, checked without a tokenizer (cheap: ~1 ms for a JSON schema).

`grammar_text` is what `StructuredOutputsParams` calls at construction, so a bad schema,
regex or grammar is a `ValueError` before anything is queued; the engine later compiles
the same text against the model's tokenizer (see `manager.py`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # in the type stubs only

KINDS = ("json", "json_object", "regex", "choice", "grammar")


def json_options(whitespace_pattern: str | None) -> JsonCompileOptions:
    """Compact JSON (`,` and `:` with no whitespace) unless a whitespace pattern is given.

    Flexible whitespace lets a small model emit whitespace forever, so it is opt-in.
    """
    if whitespace_pattern is None:
        return {"whitespace_flexible": False}
    return {"whitespace_pattern": whitespace_pattern}


def grammar_text(kind: str, spec: Any, whitespace_pattern: str | None = None) -> str:
    """The llguidance grammar for one constraint; raises ValueError naming the problem."""
    import llguidance

    matcher = llguidance.LLMatcher
    if kind == "json":
        schema = _schema(spec)
        text = matcher.grammar_from_json_schema(schema, defaults=json_options(whitespace_pattern))
    elif kind == "json_object":
        text = matcher.grammar_from_json_schema({"type": "object"}, defaults=json_options(whitespace_pattern))
    elif kind == "regex":
        if not isinstance(spec, str):
            raise ValueError(f"regex must be a string, got {type(spec).__name__}")
        text = matcher.grammar_from_regex(spec)
    elif kind == "choice":
        if not isinstance(spec, (list, tuple)) or not spec or not all(isinstance(c, str) and c for c in spec):
            raise ValueError(f"choice must be a non-empty list of non-empty strings, got {spec!r:.200}")
        text = llguidance.grammar_from("choice", json.dumps(list(spec)))
    elif kind == "grammar":
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError("grammar must be a non-empty Lark (or GBNF) grammar string")
        try:
            text = llguidance.grammar_from("grammar", spec)
        except ValueError as e:
            raise ValueError(f"invalid grammar: {e}") from None
    else:
        raise ValueError(f"unknown constraint kind {kind!r}; expected one of {', '.join(KINDS)}")
    error = matcher.validate_grammar(text)
    if error:
        raise ValueError(f"invalid {_what(kind)}: {error.strip()}")
    return text


def _schema(spec: Any) -> dict:
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"a JSON schema must be an object, got {type(spec).__name__}")
    return spec


def _what(kind: str) -> str:
    return {
        "json": "JSON schema",
        "json_object": "JSON object settings",
        "regex": "regex",
        "grammar": "grammar",
        "choice": "choice list",
    }[kind]
