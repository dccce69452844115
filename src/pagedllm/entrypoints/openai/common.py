"""Pieces every endpoint shares: OpenAI-style errors, body parsing, model check, sampling params,
the context-length check, logprob formatting, disconnect watching and merging several output streams."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any, AsyncIterator, Optional, TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from pagedllm.sampling_params import SamplingParams

T = TypeVar("T", bound=BaseModel)

_json = msgspec.json.Encoder()


def dumps(obj: Any) -> bytes:
    return _json.encode(obj)


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
    first = errors[0]
    # Drop FastAPI's "body" and pydantic's union-branch tags ("str", "list[int]", ...) from the location.
    loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body" and not _is_type_tag(p))
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


async def parse_body(request: Request, model: type[T]) -> T:
    raw = await request.body()
    try:
        data = json.loads(raw) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError("We could not parse the JSON body of your request: it is not valid JSON.")
    if not isinstance(data, dict):
        raise APIError("The request body must be a JSON object.")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise format_validation_error(e)


class ServerState:
    """What the endpoints need: the engine, the served model names, the tokenizer."""

    def __init__(self, engine: Any, served_model_names: list[str], metrics: Any = None,
                 api_key: Optional[str] = None) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.metrics = metrics
        self.api_key = api_key
        self.created = int(time.time())

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_model(self, name: Optional[str]) -> str:
        if name is None or name == "" or name in self.served_model_names:
            return self.model_name
        raise APIError(f"The model `{name}` does not exist.", status=404, param="model", code="model_not_found")


def build_sampling_params(req: Any, max_tokens: Optional[int], logprobs: Optional[int],
                          prompt_logprobs: Optional[int] = None) -> SamplingParams:
    def opt(v: Any, default: Any) -> Any:
        return default if v is None else v

    # Integers travel to the engine as msgpack int64: anything wider is a client mistake, not a crash.
    for name in ("seed", "top_k", "min_tokens", "max_tokens", "n"):
        v = getattr(req, name, None) if name != "max_tokens" else max_tokens
        if isinstance(v, int) and not -(2 ** 63) <= v < 2 ** 63:
            raise APIError(f"{name} is out of range: {v}.", param=name)
    for t in req.stop_token_ids or []:
        if not 0 <= t < 2 ** 63:
            raise APIError(f"stop_token_ids must be non-negative integers below 2**63, got {t}.",
                           param="stop_token_ids")

    try:
        return SamplingParams(
            n=req.n,
            presence_penalty=opt(req.presence_penalty, 0.0),
            frequency_penalty=opt(req.frequency_penalty, 0.0),
            repetition_penalty=opt(req.repetition_penalty, 1.0),
            temperature=opt(req.temperature, 1.0),
            top_p=opt(req.top_p, 1.0),
            top_k=opt(req.top_k, 0),
            min_p=opt(req.min_p, 0.0),
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )
    except (ValueError, TypeError) as e:
        raise APIError(str(e), param=_param_of(str(e)))


def _param_of(message: str) -> Optional[str]:
    word = message.split(" ", 1)[0]
    return word if word.replace("_", "").isalpha() and word.islower() else None


def check_context_length(num_prompt_tokens: int, max_tokens: Optional[int], max_model_len: int) -> None:
    if max_tokens is None:
        if num_prompt_tokens >= max_model_len:
            raise APIError(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens} tokens in the messages, which leaves no room for the completion. "
                "Please reduce the length of the messages.", param="messages")
        return
    total = num_prompt_tokens + max_tokens
    if total > max_model_len:
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested {total} "
            f"tokens ({num_prompt_tokens} in the messages, {max_tokens} in the completion). Please reduce the "
            "length of the messages or completion.", param="max_tokens")


def check_token_ids(ids: list[int], vocab_size: int) -> None:
    if not ids:
        raise APIError("The prompt is empty: give at least one token.", param="prompt")
    for t in ids:
        if not 0 <= t < vocab_size:
            raise APIError(f"Token id {t} is out of vocabulary (0..{vocab_size - 1}).", param="prompt")


# ---- logprobs -------------------------------------------------------------------------------------


def token_str(tokenizer: Any, token_id: int, lp: Any = None) -> str:
    s = getattr(lp, "decoded_token", None)
    if s is None:
        s = tokenizer.decode([token_id])
    return s


def iter_logprobs(tokenizer: Any, token_ids: list[int], logprobs: Optional[list[dict]]):
    """Yield (token_str, logprob, [(top_str, top_logprob), ...] by rank) per generated position."""
    if not logprobs:
        return
    for tid, entry in zip(token_ids, logprobs):
        chosen = entry.get(tid) if entry else None
        lp = float(chosen.logprob) if chosen is not None else float("-inf")
        tops = []
        for top_id, top in sorted((entry or {}).items(), key=lambda kv: getattr(kv[1], "rank", 0) or 0):
            tops.append((token_str(tokenizer, top_id, top), float(top.logprob), getattr(top, "rank", None)))
        yield token_str(tokenizer, tid, chosen), lp, tops


def safe_float(x: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number.
    return x if x > -9999.0 else -9999.0


# ---- disconnects and stream merging ------------------------------------------------------------------


def start_disconnect_watch(request: Request, engine: Any, request_ids: list[str]) -> asyncio.Task:
    """Until the returned task is cancelled, a client disconnect aborts `request_ids` at once (their KV
    blocks are freed in the engine's next loop turn, and their generate() raises ClientDisconnected)."""

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message.get("type") == "http.disconnect":
                for rid in request_ids:
                    engine.abort_nowait(rid)
                return

    return asyncio.get_running_loop().create_task(watch())


async def merge_streams(gens: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several async iterators, yielding (which, item) as items arrive."""
    if len(gens) == 1:
        async for item in gens[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, gen: AsyncIterator[Any]) -> None:
        try:
            async for item in gen:
                await queue.put((i, item))
            await queue.put((i, done))
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            await queue.put((i, e))

    tasks = [asyncio.get_running_loop().create_task(pump(i, g)) for i, g in enumerate(gens)]
    remaining = len(gens)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for g in gens:
            aclose = getattr(g, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()


# ---- prompts ------------------------------------------------------------------------------------------


def message_text(content: Any) -> str:
    """OpenAI content is a string or a list of parts; only text parts are supported."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        kind = part.get("type")
        if kind == "text":
            texts.append(str(part.get("text", "")))
        else:
            raise APIError(f"Message content of type {kind!r} is not supported yet; only 'text' parts are.",
                           param="messages")
    return "\n".join(texts)


def render_chat(tokenizer: Any, messages: list[Any], add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template: Optional[str] = None,
                chat_template_kwargs: Optional[dict] = None, add_special_tokens: bool = False
                ) -> tuple[str, list[int]]:
    if not messages:
        raise APIError("'messages' must contain at least one message.", param="messages")
    conv = []
    for msg in messages:
        item = {"role": msg.role, "content": message_text(msg.content)}
        if msg.name:
            item["name"] = msg.name
        conv.append(item)
    if continue_final_message and add_generation_prompt:
        raise APIError("continue_final_message and add_generation_prompt cannot both be true.",
                       param="continue_final_message")
    try:
        text = tokenizer.apply_chat_template(
            conv, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, chat_template=chat_template,
            **(chat_template_kwargs or {}))
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - template errors come from the request (roles, kwargs)
        raise APIError(f"Could not apply the chat template: {e}", param="messages")
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return text, list(ids)
