"""SpeculativeConfig: vLLM's `speculative_config` dict (LLM kwarg) / `--speculative-config` JSON, validated once.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    {"method": "draft_model", "model": "path/or.gguf", "num_speculative_tokens": 5}

Pure Python (no torch): the scheduler reads num_speculative_tokens and disable_by_batch_size from it.
"""
from __future__ import annotations

import json
import numbers
from dataclasses import dataclass
from typing import Any, Optional

METHODS = ("ngram", "draft_model")
_UNSUPPORTED_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "suffix")
# Default of disable_by_batch_size: speculation is skipped in steps with more running requests than this.
# Measured on the device: docs/benchmarks.md, "Batch cost" (spec_decode.py batch / sweep).
DEFAULT_DISABLE_BY_BATCH_SIZE = 16
_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
         "disable_by_batch_size", "draft_load_format", "draft_dtype", "draft_tensor_parallel_size",
         "quantization"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: Optional[str] = None  # draft model path (draft_model)
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    # Steps with more running requests than this do not speculate (None: never turned off).
    disable_by_batch_size: Optional[int] = DEFAULT_DISABLE_BY_BATCH_SIZE
    draft_load_format: str = "auto"
    quantization: Optional[str] = None  # the draft's quantization method (None: from its checkpoint)

    @classmethod
    def from_user(cls, value: Any) -> Optional["SpeculativeConfig"]:
        """Parse a dict, a JSON string, or None. Raises ValueError naming what to change."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config must be a JSON object, e.g. "
                                 f"'{{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}': {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (or a JSON object), got {type(value).__name__}.")
        unknown = set(value) - _KEYS
        if unknown:
            raise ValueError(f"Unknown speculative_config key(s): {', '.join(sorted(unknown))}; "
                             f"known keys: {', '.join(sorted(_KEYS))}.")
        return cls._build(dict(value))

    @classmethod
    def _build(cls, d: dict) -> "SpeculativeConfig":
        method = d.get("method")
        model = d.get("model")
        if model is not None and not isinstance(model, str):  # (a list or number would fail deep in the loader)
            raise ValueError(f"speculative_config 'model' must be a path or repo id (a string), got {model!r}.")
        if method is None:
            method = "draft_model" if model else None
        if method in ("[ngram]", "ngram"):
            method = "ngram"
        if method == "draft" or method == "draft_model":
            method = "draft_model"
        if method in _UNSUPPORTED_METHODS:
            raise ValueError(f"speculative_config method {method!r} is not supported yet by pagedllm; "
                             f"use one of {', '.join(METHODS)}.")
        if method not in METHODS:
            raise ValueError(f"speculative_config needs 'method': one of {', '.join(METHODS)} (got {method!r}).")
        k = _int(d, "num_speculative_tokens", None)
        if k is None:
            raise ValueError("speculative_config needs 'num_speculative_tokens' (an integer >= 1).")
        if k < 1:
            raise ValueError(f"speculative_config num_speculative_tokens must be >= 1, got {k}.")
        if k > 32:
            raise ValueError(f"speculative_config num_speculative_tokens must be <= 32, got {k}.")
        lo, hi = _int(d, "prompt_lookup_min", None), _int(d, "prompt_lookup_max", None)
        if method == "ngram":
            # vLLM's rule: one given -> the other equals it.
            if lo is None and hi is None:  # (a one-token match proposes too: more steps verify, fewer in all)
                lo, hi = 1, 4
            lo = hi if lo is None else lo
            hi = lo if hi is None else hi
            if lo < 1:
                raise ValueError(f"speculative_config prompt_lookup_min must be >= 1, got {lo}.")
            if hi < lo:
                raise ValueError(f"speculative_config prompt_lookup_max ({hi}) must be >= prompt_lookup_min ({lo}).")
            if d.get("model"):
                raise ValueError("speculative_config method 'ngram' takes no 'model'; use method 'draft_model'.")
        else:
            if not d.get("model"):
                raise ValueError("speculative_config method 'draft_model' needs 'model': the draft model's path "
                                 "(any path --model accepts, a .gguf file included).")
            if lo is not None or hi is not None:
                raise ValueError("prompt_lookup_min / prompt_lookup_max only apply to method 'ngram'.")
            lo, hi = 2, 4
        tp = _int(d, "draft_tensor_parallel_size", 1)
        if tp != 1:
            raise ValueError("speculative_config draft_tensor_parallel_size must be 1.")
        if d.get("quantization") is not None and not isinstance(d.get("quantization"), str):
            raise ValueError("speculative_config 'quantization' must be a method name (e.g. \"gptq\").")
        if d.get("draft_dtype") not in (None, "auto"):
            raise ValueError("speculative_config 'draft_dtype': the draft model runs in the target's dtype; "
                             "leave it out.")
        disable = _int(d, "disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
        if disable is not None:
            if disable < 1:
                raise ValueError(f"speculative_config disable_by_batch_size must be >= 1 (or null), got {disable}.")
        fmt = d.get("draft_load_format", "auto")
        if fmt not in ("auto", "safetensors", "gguf", "dummy"):
            raise ValueError(f"speculative_config draft_load_format must be auto, safetensors, gguf or dummy, "
                             f"got {fmt!r}.")
        return cls(method=method, num_speculative_tokens=k, model=d.get("model"), prompt_lookup_max=hi,
                   prompt_lookup_min=lo, disable_by_batch_size=disable, draft_load_format=fmt,
                   quantization=d.get("quantization"))


def _int(d: dict, key: str, default: Optional[int]) -> Optional[int]:
    v = d.get(key, default)
    if v is None:
        return None
    if not isinstance(v, numbers.Integral) or isinstance(v, bool):
        raise ValueError(f"speculative_config {key} must be an integer, got {v!r}.")
    return int(v)
