"""A request body -> the endpoint's pydantic model, every failure a 400 naming what is wrong: invalid or
non-finite JSON, too deep, unknown or unsupported fields (`fields.py`), validation errors, the per-request bounds
(`limits.py`). Above errors, fields and limits, which never import it."""
from __future__ import annotations

import asyncio
import json
import re
import sys
from typing import Any, Callable, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from pagedllm.entrypoints.openai import limits
from pagedllm.entrypoints.openai.errors import APIError, format_validation_error
from pagedllm.entrypoints.openai.fields import check_extra_fields

T = TypeVar("T", bound=BaseModel)


class _NotFinite(ValueError):
    pass


def _no_constant(name: str) -> float:
    raise _NotFinite(name)  # NaN / Infinity: Python's json accepts them, JSON does not


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _NotFinite(text[:40])  # 1e400 overflows to infinity
    return value


# One decoder for every body: json.loads with hooks builds a JSONDecoder per call.
_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float)


def _loads(raw: bytes) -> object:
    """json.loads(raw, parse_constant=..., parse_float=...) with the shared decoder: the same bytes -> str step
    (UTF-8, -16 or -32 by json's own detection) and the same errors."""
    return _DECODER.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))


# A \uD800-\uDFFF escape (one half of a UTF-16 surrogate pair: valid in pairs, which json joins into one
# character), or a surrogate's own UTF-8 bytes (which the body's decoding lets through, as json.loads does).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def check_unicode(raw: bytes, data: object) -> None:
    """Refuse strings holding a lone UTF-16 surrogate ("\ud800" is valid JSON): nothing downstream can encode them
    (the tokenizer, the engine's messages). Walks the strings only when the body has such an escape."""
    if not _SURROGATE_ESCAPE.search(raw):
        return
    stack = [data]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError("The request holds a string that is not valid Unicode: a lone UTF-16 surrogate "
                               "(an unpaired \\ud800-\\udfff escape).") from None
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def loads_body(raw: bytes) -> object:
    """The JSON of a request body, every failure a 400 (invalid or non-finite JSON, too deep, not valid Unicode)."""
    try:
        data = _loads(raw) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError("We could not parse the JSON body of your request: it is not valid JSON.")
    except _NotFinite as e:
        raise APIError(f"We could not parse the JSON body of your request: {e} is not a finite JSON number.")
    except ValueError:  # Python's limit on int() of a long digit string (sys.get_int_max_str_digits), e.g. 10**5000
        limit = getattr(sys, "get_int_max_str_digits", lambda: 4300)()
        raise APIError(f"We could not parse the JSON body of your request: it holds an integer with more than {limit} "
                       "digits.")
    except RecursionError:
        raise limits.too_deep()
    check_unicode(raw, data)
    return data


# Bodies from this size on are parsed, tokenized (and their chat template rendered) in a worker thread: a few MB
# of text take the tokenizer seconds, which on the event loop would stall every other client's stream.
OFF_LOOP_BYTES = 64 * 1024


async def parse_body(request: Request, model: type[T]) -> T:
    raw = await request.body()
    if len(raw) < OFF_LOOP_BYTES:
        return _parse(raw, model)
    # a body of megabytes takes the JSON decoder and pydantic a good part of a second: off the event loop, as
    # tokenize_work does for its text, so other clients' streams keep flowing
    return await asyncio.to_thread(_parse, raw, model)


def _parse(raw: bytes, model: type[T]) -> T:
    data = loads_body(raw)
    if not isinstance(data, dict):
        raise APIError("The request body must be a JSON object.")
    limits.check_json_depth(data, raw)
    check_extra_fields(model, data)
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        raise format_validation_error(e)
    limits.check_request_limits(req)
    return req


async def tokenize_work(request: Request, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs): inline for the usual small body (a thread hop costs more than the work), in a thread
    for a large one (OFF_LOOP_BYTES)."""
    if len(await request.body()) < OFF_LOOP_BYTES:  # (starlette keeps the body read by parse_body)
        return fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)


async def render_work(request: Request, req: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """tokenize_work for rendering a chat template: a request's own template (--trust-request-chat-template) can
    loop for seconds whatever the body's size, which on the event loop would stall every other client."""
    if getattr(req, "chat_template", None) is not None:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return await tokenize_work(request, fn, *args, **kwargs)
