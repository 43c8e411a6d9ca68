"""The one error style of every configuration check: the field, the limit, the value given."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any


def positive(name: str, value, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def one_of(name: str, value, choices: Iterable) -> None:
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")


def json_object(name: str, value: Any, known: Iterable[str]) -> dict[str, Any]:
    """A config given as a dict or as its flag's JSON text: an object whose fields are all `known` (a copy)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    known = list(known)
    if unknown := sorted(set(value) - set(known)):
        raise ValueError(f"{name}: unknown field(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return dict(value)
