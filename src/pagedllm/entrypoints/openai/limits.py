"""Upper bounds on what one request may ask for, checked right after parsing, before any tokenizing or
engine work: each refusal is a 400 that names the field and the limit.

They exist so that one request cannot make the server do unbounded work or hold unbounded memory: a
million `n` fan-out children, a million stop strings scanned on every token, JSON nested ten thousand
levels deep. Token counts are bounded elsewhere (the context length check against max_model_len, and
SamplingParams' logprobs range); the body size by `--max-request-body-bytes`.
"""
from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import field_or_none

MAX_JSON_DEPTH = 64
MAX_N = 256
MAX_PROMPTS = 1024  # prompts in one /v1/completions request
MAX_CHOICES = 1024  # prompts x n
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_MESSAGES = 4096
MAX_BAD_WORDS = 1024  # each is tokenized twice and matched against the output at every step
MAX_BAD_WORD_CHARS = 1024
# A choice constraint's grammar compiles in time that grows faster than its length (xgrammar on 2 CPU cores: 1000
# choices 0.4 s, 4000 2 s, 12000 minutes), on the one grammar thread every structured request waits for.
MAX_GUIDED_CHOICES = 1024


def check_json_depth(data: Any, raw: bytes) -> None:
    """Refuse JSON nested deeper than MAX_JSON_DEPTH (cheap: only walked when the body has that many brackets)."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise too_deep()
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))


def too_deep() -> APIError:
    return APIError(f"The JSON body is nested too deeply: at most {MAX_JSON_DEPTH} levels are allowed.")


def _refuse(field: str, what: str, limit: int, got: int, unit: str = "") -> APIError:
    return APIError(f"'{field}' {what} at most {limit}{unit} (got {got}).", param=field)


def check_request_limits(req: Any) -> None:
    """Limits on the fields a request model has (any endpoint's: fields it lacks are skipped)."""
    n = field_or_none(req, "n")
    if isinstance(n, int) and n > MAX_N:
        raise _refuse("n", "must be", MAX_N, n)
    stop = field_or_none(req, "stop")
    if isinstance(stop, list):
        if len(stop) > MAX_STOP_STRINGS:
            raise _refuse("stop", "may have", MAX_STOP_STRINGS, len(stop), " strings")
        stop = max(stop, key=len, default="")
    if isinstance(stop, str) and len(stop) > MAX_STOP_STRING_CHARS:
        raise APIError(f"'stop' strings may be at most {MAX_STOP_STRING_CHARS} characters long (got {len(stop)}).",
                       param="stop")
    stop_ids = field_or_none(req, "stop_token_ids")
    if stop_ids is not None and len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise _refuse("stop_token_ids", "may have", MAX_STOP_TOKEN_IDS, len(stop_ids), " ids")
    bad_words = field_or_none(req, "bad_words")
    if bad_words is not None:
        if len(bad_words) > MAX_BAD_WORDS:
            raise _refuse("bad_words", "may have", MAX_BAD_WORDS, len(bad_words), " words")
        longest = max((len(w) for w in bad_words), default=0)
        if longest > MAX_BAD_WORD_CHARS:
            raise _refuse("bad_words", "entries may have", MAX_BAD_WORD_CHARS, longest, " characters")
    so = field_or_none(req, "structured_outputs")
    for name, choices in (("guided_choice", field_or_none(req, "guided_choice")),
                          ("structured_outputs.choice", so.get("choice") if isinstance(so, dict) else None)):
        if isinstance(choices, list) and len(choices) > MAX_GUIDED_CHOICES:
            raise APIError(f"'{name}' may have at most {MAX_GUIDED_CHOICES} choices (got {len(choices)}).",
                           param=name.split(".")[0])
    messages = field_or_none(req, "messages")
    if messages is not None and len(messages) > MAX_MESSAGES:
        raise _refuse("messages", "may have", MAX_MESSAGES, len(messages), " messages")
    prompt = field_or_none(req, "prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) > MAX_PROMPTS:
            raise _refuse("prompt", "may have", MAX_PROMPTS, len(prompt), " prompts")
        if isinstance(n, int) and len(prompt) * n > MAX_CHOICES:
            raise APIError(f"'prompt' x 'n' may be at most {MAX_CHOICES} choices (got {len(prompt)} x {n}).",
                           param="n")
