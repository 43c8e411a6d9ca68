"""Errors as OpenAI returns them: `{"error": {"message", "type", "param", "code"}}` with the HTTP status.

Everything a request can get wrong becomes an `OpenAIError` (or a pydantic ValidationError,
translated here) and a 4xx; the app's last-resort handler turns anything else into a 500
of the same shape, so a client never sees a bare traceback or a hung connection.
"""

from __future__ import annotations

import json
import re
from http import HTTPStatus
from typing import TypeVar

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)

TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class OpenAIError(Exception):
    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code

    def body(self) -> dict:
        kind = TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    def sse(self) -> str:
        """The error as a server-sent event, for failures after a stream has started."""
        return f"data: {json.dumps(self.body())}\n\n"


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(message, status=400, param=param, code="invalid_value" if param else None)


def not_supported(param: str) -> OpenAIError:
    return OpenAIError(
        f"'{param}' is not supported yet by this server", status=400, param=param, code="unsupported_parameter"
    )


def from_validation_error(e: ValidationError) -> OpenAIError:
    """The first schema problem, naming the field as OpenAI does (`messages.0.role`)."""
    first = e.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return OpenAIError(f"the request body is not valid JSON: {first['msg']}", code="invalid_json")
    loc = [str(p) for p in first["loc"] if not _is_union_branch(p)]
    param = ".".join(loc) or None
    message = f"{param}: {first['msg']}" if param else first["msg"]
    if first["type"] == "missing":
        message = f"'{param}' is a required property"
    return OpenAIError(
        message, param=param, code="missing_required_parameter" if first["type"] == "missing" else "invalid_type"
    )


def _is_union_branch(part) -> bool:
    """pydantic names union members in error locations (`str`, `list[int]`); they are not fields."""
    return isinstance(part, str) and bool(re.fullmatch(r"[a-z]+\[.*\]|str|int|float|bool|function-\w+.*", part))


def from_value_error(e: ValueError) -> OpenAIError:
    """A ValueError from SamplingParams or the engine's checks: `SamplingParams.top_p must be ...` → param top_p."""
    message = str(e)
    match = re.match(r"SamplingParams\.(\w+) (.*)", message)
    if match:
        return bad_request(f"{match[1]} {match[2]}", param=match[1])
    return bad_request(message)


def parse_request(model: type[M], body: bytes) -> M:
    if not body:
        raise OpenAIError("the request body is empty; send a JSON object", code="invalid_json")
    try:
        return model.model_validate_json(body, strict=True)
    except ValidationError as e:
        raise from_validation_error(e) from None


def status_error(status: int, message: str | None = None) -> OpenAIError:
    return OpenAIError(message or HTTPStatus(status).phrase, status=status)
