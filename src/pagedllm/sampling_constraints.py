"""Per-request constraints on which tokens may be sampled: logit_bias, allowed_token_ids, bad_words.

Validation and normalization for SamplingParams, the frontend's tokenization of bad words (the engine core has
no tokenizer), and the per-step bad-word rule the sampler applies. Pure Python (no torch).
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Sequence

LOGIT_BIAS_RANGE = 100.0  # OpenAI: each bias is in [-100, 100]
_MAX_ID = 2 ** 63  # ids travel to the engine process as msgpack int64


class FieldError(ValueError):
    """A refusal naming the request field it is about (`param`: the server's 400 names it)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def normalize_logit_bias(bias: Any) -> Optional[dict[int, float]]:
    """{token id (int or its decimal string, as JSON sends it): bias} -> {int: float}; ValueError if malformed."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a mapping of token ids to numbers, got {bias!r}.")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key) if not isinstance(key, bool) else None
        except (TypeError, ValueError):
            token = None
        if token is None or (isinstance(key, float) and not key.is_integer()) or not 0 <= token < _MAX_ID:
            raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}.")
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(f"logit_bias values must be finite numbers, got {value!r} for token {token}.")
        if not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {value} for token {token}.")
        out[token] = float(value)
    return out or None


def normalize_allowed_token_ids(ids: Any) -> Optional[list[int]]:
    if ids is None:
        return None
    if not isinstance(ids, (list, tuple, set)) or not ids:
        raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {ids!r}.")
    if any(not _is_int(t) or not 0 <= t < _MAX_ID for t in ids):
        raise ValueError("allowed_token_ids must be a list of non-negative integers.")
    return sorted({int(t) for t in ids})


def normalize_bad_words(words: Any) -> Optional[list[str]]:
    if words is None:
        return None
    if isinstance(words, str) or not isinstance(words, (list, tuple)):
        raise ValueError(f"bad_words must be a list of strings, got {words!r}.")
    if any(not isinstance(w, str) or not w.strip() for w in words):
        raise ValueError("bad_words must be a list of non-empty strings.")
    return list(words) or None


def check_against_engine(params: Any, vocab_size: int, max_logprobs: int) -> None:
    """What only the engine knows: every constrained id is a real token, and logprobs stay within
    --max-logprobs (-1: up to the vocabulary). A request's logprobs=-1 (the whole vocabulary) counts as the
    vocabulary's size, as in vLLM."""
    for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
        bad = sorted(t for t in ids if t >= vocab_size)
        if bad:
            raise FieldError(f"{name} has token id(s) out of vocabulary (0..{vocab_size - 1}): {bad[:5]}.", name)
    if params.bad_words and not params.bad_words_token_ids:
        raise ValueError("bad_words need a tokenizer to be turned into token ids; this engine was started without "
                         "one (skip_tokenizer_init), so give the banned ids as logit_bias of -100 instead.")
    limit = vocab_size if max_logprobs == -1 else max_logprobs
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k == -1 and limit < vocab_size:
            raise FieldError(f"{name}=-1 (the whole vocabulary: {vocab_size} tokens) is more than this server allows "
                             f"({limit}); start the engine with --max-logprobs -1 (LLM(max_logprobs=-1)) for it.", name)
        if k is not None and k > limit:
            raise FieldError(f"{name}={k} is more than this server allows ({limit}); ask for fewer, or start "
                             f"the engine with a larger --max-logprobs.", name)


def tokenize_bad_words(words: Sequence[str], tokenizer: Any) -> list[list[int]]:
    """Each word's token sequences as it would appear in generated text: alone and after a space (BPE
    vocabularies spell the two differently). Duplicates dropped."""
    seqs: list[list[int]] = []
    for word in words:
        for text in (word.strip(), " " + word.strip()):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in seqs:
                seqs.append(ids)
    return seqs


def banned_by_bad_words(sequences: Sequence[Sequence[int]], output_ids: Sequence[int]) -> list[int]:
    """Tokens this step must not produce: a bad word's last token when the output already ends with the rest
    of it (a one-token word is always banned)."""
    banned = []
    for seq in sequences:
        head = len(seq) - 1
        if head == 0 or (len(output_ids) >= head and list(output_ids[len(output_ids) - head:]) == list(seq[:-1])):
            banned.append(seq[-1])
    return banned


def tokenize_params(params: Any, tokenizer: Any) -> Any:
    """The frontend's step before the engine sees a request: bad words -> their token sequences."""
    if not params.bad_words or params.bad_words_token_ids or tokenizer is None:
        return params
    return params.clone(bad_words_token_ids=tokenize_bad_words(params.bad_words, tokenizer))
