"""OpenAI-style errors: APIError, the {"error": {...}} body, and validation errors as 400s naming the bad field.

A leaf of entrypoints/openai: every other module there may import it (request bodies are parsed in `body.py`)."""
from __future__ import annotations

import json
import logging
from typing import Any, Optional

import msgspec
from fastapi.responses import Response
from pydantic import ValidationError

_json = msgspec.json.Encoder()


# JSON bytes of obj; the encoder's own method (no Python frame around it: SSE frames call it once per token).
dumps = _json.encode

# --log-error-stack (vLLM's): the stack of every error turned into an error response or in-band stream error.
ERROR_STACK = {"log": False}
_logger = logging.getLogger("pagedllm.api_server")


def log_error_stack(e: BaseException, status: Any = None) -> None:
    if ERROR_STACK["log"]:
        _logger.error("Error response%s: %s: %s", f" ({status})" if status else "", type(e).__name__, e,
                      exc_info=(type(e), e, e.__traceback__))


class APIError(Exception):
    """A client-visible error: mapped to {"error": {...}} with `status`."""

    def __init__(self, message: str, status: int = 400, type_: Optional[str] = None, param: Optional[str] = None,
                 code: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type_ or _default_type(status)
        self.param = param
        self.code = code


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status >= 500:
        return "server_error" if status != 503 else "service_unavailable_error"
    return "invalid_request_error"


def error_body(message: str, status: int, type_: Optional[str] = None, param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type_ or _default_type(status), "param": param,
                      "code": code if code is not None else status}}


def error_response(err: APIError) -> Response:
    return Response(dumps(error_body(err.message, err.status, err.type, err.param, err.code)),
                    status_code=err.status, media_type="application/json")


def format_validation_error(e: ValidationError | Any) -> APIError:
    errors = e.errors() if hasattr(e, "errors") else []
    if not errors:
        return APIError(str(e))
    def field_path(error: dict) -> list[str]:
        # FastAPI's "body" and pydantic's union-branch tags ("str", "list[int]", ...) dropped from the location
        return [str(p) for p in error.get("loc", ()) if p != "body" and not _is_type_tag(p)]

    # A union's branches each report an error; the one that got deepest into the value names what is wrong with it
    # (a prompt of [true] is a list whose item is no integer, more than it is no string).
    first = max(errors, key=lambda error: len(field_path(error)))
    loc = ".".join(field_path(first))
    if first.get("type") == "missing":
        return APIError(f"Missing required parameter: '{loc}'.", param=loc or None)
    if first.get("type") == "json_invalid":
        return APIError("We could not parse the JSON body of your request: it is not valid JSON.")
    got = first.get("input")
    got_s = json.dumps(got)[:80] if _jsonable(got) else repr(got)[:80]
    return APIError(f"Invalid value for '{loc}': {first.get('msg', 'invalid')} (got {got_s}).", param=loc or None)


def _is_type_tag(part: Any) -> bool:
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool", "list", "dict",
                                                               "function-after", "function-plain"})


def _jsonable(x: Any) -> bool:
    try:
        json.dumps(x)
        return True
    except (TypeError, ValueError):
        return False
