"""Request -> engine inputs: the OpenAI/vLLM sampling fields mapped to SamplingParams, and the prompt checks
(context length, token ids) every generating endpoint makes."""
from __future__ import annotations

import uuid
from typing import Any, Optional

from pagedllm.core.block_hash import check_cache_salt
from pagedllm.core.request import check_priority
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import field_or_none
from pagedllm.sampling_params import SamplingParams, keep_last_tokens


def request_cache_salt(req: Any) -> Optional[str]:
    """The request's prefix-cache salt (vLLM's cache_salt), or a 400 naming the field."""
    salt = field_or_none(req, "cache_salt")
    try:
        check_cache_salt(salt)
    except ValueError as e:
        raise APIError(str(e), param="cache_salt") from None
    return salt


def request_ids(request: Any, prefix: str, given: Optional[str]) -> tuple[str, str]:
    """(the answer's id, the engine's id), as vLLM names them: the answer's is "<prefix>-<base>", the base being
    the X-Request-Id header, else the body's request_id, else a new one. A client's base may be any request's
    (a gateway's trace id, a retry while the first still runs), so the engine's id adds 8 random characters to it,
    as vLLM's engine client does: two requests of one id both run."""
    # an empty header or field names nothing (as vLLM's `given or random_uuid()`): the answer's id is never bare
    base = request.headers.get("x-request-id") or given or None
    if base is None:
        rid = f"{prefix}-{uuid.uuid4().hex}"
        return rid, rid
    rid = f"{prefix}-{base}"
    return rid, f"{rid}-{uuid.uuid4().hex[:8]}"


def data_parallel_rank(request: Any, engine: Any) -> Optional[int]:
    """vLLM's `X-data-parallel-rank` header: the engine core an external router chose for the request (None: the
    server's own balancing); a 400 for a value that is no core's index."""
    value = request.headers.get("x-data-parallel-rank")
    if value is None:
        return None
    num_engines = getattr(engine, "num_engines", 1)
    try:
        rank = int(value)
    except ValueError:
        rank = None
    if rank is None or not 0 <= rank < num_engines:
        raise APIError(f"X-data-parallel-rank must be an engine core's index, an integer in [0, {num_engines}) "
                       f"(--data-parallel-size), got {value!r}.")
    return rank


def request_priority(req: Any, scheduling_policy: str) -> int:
    """The request's priority (vLLM's; null is 0), or a 400 naming the field (not 0 under fcfs)."""
    priority = field_or_none(req, "priority") or 0
    try:
        check_priority(priority, scheduling_policy)
    except ValueError as e:
        raise APIError(str(e), param="priority") from None
    return priority


def build_sampling_params(req: Any, max_tokens: Optional[int], logprobs: Optional[int],
                          prompt_logprobs: Optional[int] = None, defaults: Optional[dict] = None,
                          default_max_tokens: Optional[int] = None) -> SamplingParams:
    """`defaults`: the model's generation-config values (generation_config.py), used only for fields the
    request leaves out; then the OpenAI defaults. `max_tokens` None: the model's default, else
    `default_max_tokens` (None: up to the context length)."""
    defaults = defaults or {}
    if max_tokens is None:
        max_tokens = defaults.get("max_tokens", default_max_tokens)

    # Integers travel to the engine as msgpack int64: anything wider is a client mistake, not a crash.
    best_of = field_or_none(req, "best_of")  # chat and completions have it; other callers may not
    for name, v in (("seed", req.seed), ("top_k", req.top_k), ("min_tokens", req.min_tokens),
                    ("max_tokens", max_tokens), ("n", req.n), ("best_of", best_of),
                    ("prompt_logprobs", req.prompt_logprobs)):
        if isinstance(v, int) and not -(2 ** 63) <= v < 2 ** 63:
            raise APIError(f"{name} is out of range: {v}.", param=name)
    for name, ids in (("stop_token_ids", req.stop_token_ids), ("allowed_token_ids", req.allowed_token_ids)):
        for t in ids or ():
            if not 0 <= t < 2 ** 63:
                raise APIError(f"{name} must be non-negative integers below 2**63, got {t}.", param=name)

    structured_outputs = _structured_outputs(req)
    try:
        return SamplingParams(
            structured_outputs=structured_outputs,
            n=req.n,
            presence_penalty=_or(req.presence_penalty, 0.0),
            frequency_penalty=_or(req.frequency_penalty, 0.0),
            repetition_penalty=_or(req.repetition_penalty, defaults.get("repetition_penalty", 1.0)),
            temperature=_or(req.temperature, defaults.get("temperature", 1.0)),
            top_p=_or(req.top_p, defaults.get("top_p", 1.0)),
            top_k=_or(req.top_k, defaults.get("top_k", 0)),
            min_p=_or(req.min_p, defaults.get("min_p", 0.0)),
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
            best_of=best_of,
            logit_bias=req.logit_bias,
            allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words,
        )
    except (ValueError, TypeError) as e:
        raise APIError(str(e), param=_param_of(str(e)))


def _or(v: Any, default: Any) -> Any:
    return v if v is not None else default


def _structured_outputs(req: Any) -> Any:
    from pagedllm.entrypoints.openai.structured_request import StructuredRequestError, structured_outputs_from_request

    backend = field_or_none(req, "guided_decoding_backend")
    if backend is not None:
        raise APIError("guided_decoding_backend per request is not supported: the server's backend is chosen at "
                       "start with --structured-outputs-config '{\"backend\": ...}'.", param="guided_decoding_backend")
    try:
        return structured_outputs_from_request(req)
    except StructuredRequestError as e:
        raise APIError(str(e), param=e.param) from None


def check_logprob_fields(req: Any, max_logprobs: int, top_name: str, top: Optional[int],
                         vocab_size: Optional[int] = None) -> None:
    """The logprob counts a request may ask for: 0..--max-logprobs, and prompt_logprobs=-1 (the whole vocabulary,
    as vLLM's server takes it) where --max-logprobs covers the vocabulary; no prompt_logprobs when streaming."""
    for name, value in ((top_name, top), ("prompt_logprobs", req.prompt_logprobs)):
        if name == "prompt_logprobs" and value == -1 and vocab_size is not None:
            value = vocab_size  # (the engine turns -1 into this count)
        if value is not None and not 0 <= value <= max_logprobs:
            raise APIError(f"{name} must be between 0 and {max_logprobs} (the server's --max-logprobs), got "
                           f"{value}.", param=name)
    if req.prompt_logprobs is not None and req.stream:
        raise APIError("prompt_logprobs is not available when stream is enabled.", param="prompt_logprobs")
    if req.stream_options is not None and not req.stream:
        raise APIError("stream_options can only be given when stream is true.", param="stream_options")


def _param_of(message: str) -> Optional[str]:
    word = message.split(" ", 1)[0]
    return word if word.replace("_", "").isalpha() and word.islower() else None


def truncate_prompt(ids: list[int], k: Optional[int], max_model_len: int) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last k tokens (left truncation); -1 stands for the model's
    context length; None keeps the whole prompt."""
    check_truncation(k, max_model_len)
    return keep_last_tokens(ids, k, max_model_len)


def check_truncation(k: Optional[int], max_model_len: int) -> None:
    """A 400 naming truncate_prompt_tokens unless it is None, -1 or 1..max_model_len."""
    if k is not None and k != -1 and k < 1:
        raise APIError(f"truncate_prompt_tokens must be -1 (the model's context length) or >= 1, got {k}.",
                       param="truncate_prompt_tokens")
    if k is not None and k > max_model_len:  # as the offline LLM and vLLM: not a silent no-op
        raise APIError(f"truncate_prompt_tokens ({k}) is greater than max_model_len ({max_model_len}); select a "
                       "smaller truncation size (-1: max_model_len).", param="truncate_prompt_tokens")


def context_max_tokens(asked: Optional[int], params: SamplingParams, defaults: Optional[dict]) -> Optional[int]:
    """The max_tokens a request is held to against the context (for check_context_length): its own, or the
    endpoint's fixed default; None where the model's generation-config default filled it in, which, as in vLLM's
    get_max_tokens, is clamped to the room the prompt leaves (the engine clamps it) instead of failing the request."""
    if asked is None and "max_tokens" in (defaults or {}):
        return None
    return params.max_tokens


def check_context_length(num_prompt_tokens: int, max_tokens: Optional[int], max_model_len: int,
                         prompt_field: str = "messages", max_field: str = "max_tokens") -> None:
    """The fields named are the endpoint's (the Responses API's: 'input', 'max_output_tokens')."""
    if max_tokens is None:
        if num_prompt_tokens >= max_model_len:
            raise APIError(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens} tokens in the {prompt_field}, which leaves no room for the completion. "
                f"Please reduce the length of the {prompt_field}.", param=prompt_field)
        return
    total = num_prompt_tokens + max_tokens
    if total > max_model_len:
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested {total} "
            f"tokens ({num_prompt_tokens} in the {prompt_field}, {max_tokens} in the completion). Please reduce the "
            f"length of the {prompt_field} or completion.",
            # a prompt that fills the context alone is the prompt's fault, whatever max_tokens says
            param=prompt_field if num_prompt_tokens >= max_model_len else max_field)


def check_token_ids(ids: list[int], vocab_size: int, field: str = "prompt") -> None:
    """A prompt's token ids (`field`: the request field that carried them, named in the error)."""
    if not ids:
        raise APIError(f"The {field} is empty: give at least one token.", param=field)
    if min(ids) >= 0 and max(ids) < vocab_size:  # in C; the loop below only to name the bad id
        return
    for t in ids:
        if not 0 <= t < vocab_size:
            raise APIError(f"Token id {t} is out of vocabulary (0..{vocab_size - 1}).", param=field)
