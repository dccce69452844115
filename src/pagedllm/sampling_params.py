"""SamplingParams: how one request picks its tokens. Names and defaults follow vLLM.

Invariant: a constructed SamplingParams is valid; every user mistake raises ValueError with a
sentence that names the field and what is allowed.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional, Union

from pagedllm.sampling_constraints import normalize_allowed_token_ids, normalize_bad_words, normalize_logit_bias
from pagedllm.structured_output.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5
PER_REQUEST_LOGITS_PROCESSORS = "vLLM V1 does not support per request user provided logits processors."


class RequestOutputKind(Enum):
    """vLLM's names (and values) for SamplingParams.output_kind; pagedllm keeps the kind as its string."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


_KIND_NAMES = {RequestOutputKind.CUMULATIVE: "cumulative", RequestOutputKind.DELTA: "delta",
               RequestOutputKind.FINAL_ONLY: "final_only"}


@dataclass
class SamplingParams:
    n: int = 1
    best_of: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # "cumulative" | "delta" | "final_only", or vLLM's RequestOutputKind (kept as its string). LLM.generate returns
    # final outputs whatever it says, as vLLM's offline LLM does.
    output_kind: str = "cumulative"
    # Filled by the engine, not the user: the model's extra end-of-sequence ids (e.g. <|eot_id|>).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # Token constraints (sampling_constraints.py): bias added to the logits (OpenAI's logit_bias), the only ids
    # that may be sampled, and words never to generate (tokenized by the frontend into bad_words_token_ids).
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    # The output must match a JSON schema / regex / choice / grammar (structured_output/); a dict is converted.
    structured_outputs: Optional[StructuredOutputsParams] = None
    guided_decoding: Optional[StructuredOutputsParams] = field(default=None, repr=False)  # vLLM's older name
    # The offline LLM keeps only the prompt's last k tokens (-1: max_model_len), as vLLM (the server takes the
    # request field of that name instead); the engine core never reads it.
    truncate_prompt_tokens: Optional[int] = None
    # Internal (pooling/): a pooling request: "last" | "mean" | "cls" pooling of its prompt's final hidden states, or
    # "all" (every token's, through the model's head), reported when the prompt is computed; its one sampled token is
    # dropped.
    pooling: Optional[str] = None
    # vLLM's extra_args: data for custom logits processors / plugins; pagedllm runs none, so it is carried only.
    extra_args: Optional[dict[str, Any]] = None
    # vLLM's per-request logits processors: accepted here as vLLM's SamplingParams does, refused when the request is
    # added (LLM.generate), with vLLM V1's ValueError; custom processors are not run by this engine.
    logits_processors: Optional[list[Any]] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}.")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple, set)):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}.")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.output_kind, RequestOutputKind):
            self.output_kind = _KIND_NAMES[self.output_kind]
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        # (not a field: best_of left unset follows n, also in a clone or a copy checked after `sp.n = 4`)
        self._best_of_from_n = self.best_of is None
        if self.best_of is None:
            self.best_of = self.n
        self.logit_bias = normalize_logit_bias(self.logit_bias)
        self.allowed_token_ids = normalize_allowed_token_ids(self.allowed_token_ids)
        self.bad_words = normalize_bad_words(self.bad_words)
        self._resolve_structured_outputs()
        self._validate()
        self.all_stop_token_ids = set(self.stop_token_ids) | set(self.all_stop_token_ids)

    def _validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        def is_int(v) -> bool:  # plain ints first: the ABC check costs a few microseconds per call
            return type(v) is int or (isinstance(v, numbers.Integral) and not isinstance(v, bool))

        for name in ("ignore_eos", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output"):
            v = getattr(self, name)
            if type(v) is not bool and not (type(v).__module__ == "numpy" and "bool" in type(v).__name__):
                # ("no" would be truthy; numpy's booleans are fine)
                bad(f"{name} must be True or False, got {v!r}.")

        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
                     "min_p"):
            v = getattr(self, name)
            if type(v) is not float and (not isinstance(v, numbers.Real) or isinstance(v, bool)) \
                    or not math.isfinite(v):
                bad(f"{name} must be a finite number, got {v!r}.")
            setattr(self, name, float(v))
        for name in ("n", "top_k", "min_tokens"):
            if not is_int(getattr(self, name)):
                bad(f"{name} must be an integer, got {getattr(self, name)!r}.")
            setattr(self, name, int(getattr(self, name)))
        for name in ("best_of", "max_tokens", "logprobs", "prompt_logprobs", "seed", "truncate_prompt_tokens"):
            v = getattr(self, name)
            if v is not None and not is_int(v):
                bad(f"{name} must be an integer or None, got {v!r}.")
            if v is not None:
                setattr(self, name, int(v))

        if self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}.")
        if self.best_of < self.n:
            bad(f"best_of must be >= n, got best_of={self.best_of} and n={self.n}.")
        if self.best_of > self.n:  # as vLLM V1: sampling best_of candidates and returning n is not built yet
            bad(f"best_of > n is not supported yet (got best_of={self.best_of}, n={self.n}).")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not self.repetition_penalty > 0.0:
            bad(f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}.")
        if self.temperature < 0.0:
            bad(f"temperature must be >= 0 (0 means greedy), got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}.")
        if self.top_k < 0:
            bad(f"top_k must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}.")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}.")
        if self.min_tokens < 0:
            bad(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens}).")
        # -1: every token of the vocabulary (vLLM). The upper bound is the engine's --max-logprobs, checked when
        # the request is added (where the vocabulary's size is known).
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and v < -1:
                bad(f"{name} must be an integer >= 0, or -1 for the whole vocabulary, got {v!r}.")
        k = self.truncate_prompt_tokens
        if k is not None and (k == 0 or k < -1):
            bad(f"truncate_prompt_tokens must be -1 (the model's context length) or >= 1, got {k}.")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            bad("stop must be a non-empty string or a list of non-empty strings.")
        if self.stop and not self.detokenize:
            bad("stop strings need detokenize=True (use stop_token_ids to stop on ids without text).")
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be a list of non-negative integers.")
        if self.output_kind not in ("cumulative", "delta", "final_only"):
            bad(f"output_kind must be 'cumulative', 'delta' or 'final_only' (or a RequestOutputKind), got "
                f"{self.output_kind!r}.")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            bad(f"extra_args must be a dict or None, got {type(self.extra_args).__name__}.")
        if self.pooling is not None:
            if self.pooling not in ("last", "mean", "cls", "all"):
                bad(f"pooling must be 'last', 'mean', 'cls' or 'all', got {self.pooling!r}.")
            if self.n != 1 or self.max_tokens != 1 or self.prompt_logprobs is not None:
                bad("an embedding request (pooling) takes n=1, max_tokens=1 and no prompt_logprobs.")

    def _resolve_structured_outputs(self) -> None:
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("Give structured_outputs or its old name guided_decoding, not both.")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @classmethod
    def from_optional(cls, **kwargs: Any) -> "SamplingParams":
        """vLLM's constructor of that name, for callers that forward every option they were given: None for a field
        that takes no None (temperature, n, stop, ...) means its default; where None has a meaning of its own
        (max_tokens: up to the context; seed: unseeded) it is kept. An unknown name is a TypeError, as in cls()."""
        from dataclasses import MISSING, fields

        plain = {f.name for f in fields(cls) if f.init and "Optional" not in str(f.type)
                 and (f.default_factory is not MISSING or f.default not in (MISSING, None))}
        return cls(**{k: v for k, v in kwargs.items() if not (v is None and k in plain)})

    def clone(self, **changes) -> "SamplingParams":
        from dataclasses import replace

        if getattr(self, "_best_of_from_n", False) and "best_of" not in changes:
            changes["best_of"] = None  # derived from n: it follows a new n
        return replace(self, **changes)

    def checked(self) -> "SamplingParams":
        """A normalized, validated copy of these params as they are now. vLLM's own examples set fields after
        construction (`sp = llm.get_default_sampling_params(); sp.max_tokens = 64`), which __post_init__ never
        saw: a stop string, stop_token_ids, a logit_bias or structured_outputs dict set so would be ignored or
        fail deep in the engine, and a bad value would pass unchecked."""
        return self.clone(all_stop_token_ids=set())  # (recomputed from stop_token_ids; the engine adds its own)


def keep_last_tokens(ids: list[int], k: Optional[int], max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens on a prompt's ids (k checked already): its last k tokens (left truncation);
    -1 stands for the model's context length; None keeps the whole prompt."""
    if k is None:
        return ids
    if k == -1:
        k = max_model_len
    return ids[-k:] if len(ids) > k else ids


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams for `LLM.beam_search`, plus transformers' `early_stopping` (True, False or
    "never"; default False as in transformers). Scores are transformers': a finished beam's cumulative logprob
    divided by (its generated length ** length_penalty)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: Union[bool, str] = False

    def __post_init__(self) -> None:
        def is_int(v) -> bool:
            return isinstance(v, numbers.Integral) and not isinstance(v, bool)

        if not is_int(self.beam_width) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}.")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}.")
        if not isinstance(self.temperature, numbers.Real) or self.temperature != 0:
            raise ValueError("Beam search ranks beams by the model's own log-probabilities: temperature must be 0 "
                             f"(got {self.temperature!r}).")
        if (not isinstance(self.length_penalty, numbers.Real) or isinstance(self.length_penalty, bool)
                or not math.isfinite(self.length_penalty)):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}.")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}.")
