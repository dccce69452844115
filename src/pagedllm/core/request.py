"""Request: the one mutable per-request record, owned by the scheduler.

Invariants:
  * all_token_ids == prompt_token_ids + output_token_ids
  * 0 <= num_computed_tokens <= num_tokens; a request needs compute while num_computed_tokens < num_tokens
    (prefill, chunked prefill, recompute after preemption and decode are the same rule: catch up).
  * block_hashes[i] is the chained hash of full block i of all_token_ids (maintained by the KV cache manager).
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> Optional[str]:
        return _FINISH_REASONS.get(self)


# Built once: finish_reason is read for every request in every step.
_FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                   RequestStatus.FINISHED_ABORTED: "abort"}


def check_priority(priority, scheduling_policy: str) -> None:
    """A request's priority: an integer, and not 0 only under priority scheduling (vLLM refuses it too)."""
    if type(priority) is not int:  # (no bools, no floats: vLLM's field is an int)
        raise ValueError(f"priority must be an integer, got {priority!r}.")
    if not -2 ** 63 <= priority < 2 ** 63:  # the wire's msgpack integers are 64-bit
        raise ValueError(f"priority must be in [-2**63, 2**63), got {priority}.")
    if priority != 0 and scheduling_policy != "priority":
        raise ValueError(f"priority={priority} needs priority scheduling: start the server with "
                         "--scheduling-policy priority (offline: LLM(..., scheduling_policy='priority')).")


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: Optional[int] = None
    arrival_time: float = field(default_factory=time.monotonic)
    lora_id: Optional[int] = None  # prefix-cache salt: blocks of different adapters never match
    cache_salt: Optional[str] = None  # the client's prefix-cache salt: blocks of different salts never match
    priority: int = 0  # --scheduling-policy priority: lower is served first (vLLM)
    # The adapter's prefix-cache salt when it differs from lora_id: an id given other weights since its blocks were
    # cached (EngineLoRAs.cache_key) must not hit them.
    lora_cache_key: Optional[int] = None

    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens found in the prefix cache when the request was first scheduled (for metrics / usage).
    num_cached_tokens: Optional[int] = None
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: Optional[int | str] = None
    block_hashes: list[int] = field(default_factory=list)
    # Async scheduling: tokens being sampled by a step still in flight (scheduled, not yet appended).
    num_output_placeholders: int = 0
    # The scheduler's plan count when it took the request in: a row of an older plan under its id is another
    # request's (one finished while that plan ran, whose id was then reused) and is not applied to it.
    added_after_plan: int = 0
    # Monotonic time when first scheduled / first token produced (metrics).
    first_scheduled_time: Optional[float] = None
    # Monotonic time the scheduler took it in (arrival_time may be another clock: the API process's wall clock).
    queued_time: Optional[float] = None
    first_token_time: Optional[float] = None
    # Speculative decoding: tokens proposed for the positions after the last one (scheduled as extra tokens to
    # compute and verified in the next step; never part of all_token_ids).
    spec_token_ids: list[int] = field(default_factory=list)
    # Structured outputs: the request's grammar state (structured_output.RequestStructuredOutput, duck-typed
    # here: is_ready(), accept(token_ids), is_terminated()); None for unconstrained requests.
    structured_output: Optional[Any] = None
    # (needs_sync, needs_sync_sampling) when the scheduler counted the request in (Scheduler.num_needs_sync).
    sync_counted: tuple[bool, bool] = (False, False)
    # LongRoPE with both factor tables: the request's KV is computed with the long factors (its sequence was
    # longer than the original context when its computation started); a prefix-cache salt too.
    rope_long: bool = False
    # Dynamic NTK past the model's context: a prompt longer than it (its length; None otherwise) is rotated with
    # the base for that length, so its blocks are shared only with prompts of the same length.
    ntk_prompt_len: Optional[int] = None
    # Priority scheduling: (priority, arrival_time, order added), the key its queues are sorted by (set when added).
    priority_key: tuple = ()
    # A prompt given as embeddings (enable_prompt_embeds): [num_prompt_tokens, hidden] on the CPU, its prompt token
    # ids placeholders; embeds_key (their content's bytes digest) keeps its prefix-cache chain apart.
    prompt_embeds: Optional[Any] = None
    embeds_key: Optional[bytes] = None

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.all_token_ids = self.prompt_token_ids + list(self.output_token_ids)
        p = self.sampling_params  # fixed for the request's life: the engine asks every step, so decide once
        self._sync_sampling = (p.seed is not None or p.min_tokens > 0 or p.presence_penalty != 0.0
                               or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0
                               or any(len(seq) > 1 for seq in p.bad_words_token_ids))
        # The scheduler's per-step fast paths ask these instead of walking the sampling parameters: the tokens
        # that may stop the request (EOS unless ignored, stop ids; min_tokens is checked only for these), and the
        # length of all_token_ids at which it ends by length (max_tokens here; Scheduler.add_request caps it at
        # max_model_len).
        stop_ids = set(p.all_stop_token_ids)
        if not p.ignore_eos and self.eos_token_id is not None:
            stop_ids.add(self.eos_token_id)
        self.stop_ids = frozenset(stop_ids)
        self.length_limit = len(self.prompt_token_ids) + p.max_tokens if p.max_tokens is not None else 1 << 62

    @property
    def prefix_lora_key(self) -> Optional[int]:
        """What salts the request's prefix-cache blocks for its adapter (None: the base model)."""
        return self.lora_id if self.lora_cache_key is None else self.lora_cache_key

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def needs_sync(self) -> bool:
        """Whether sampling for this request must see every earlier token (penalties, seeds, min_tokens,
        multi-token bad words, a grammar's mask): such requests are never run one step ahead."""
        return self.structured_output is not None or self.needs_sync_sampling

    @property
    def needs_sync_sampling(self) -> bool:
        """needs_sync less the grammar mask (which the engine can fill while the step's forward runs)."""
        return self._sync_sampling

    @property
    def max_tokens(self) -> int:
        # Resolved by the engine at add time (None means "up to the context length").
        return self.sampling_params.max_tokens  # type: ignore[return-value]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
