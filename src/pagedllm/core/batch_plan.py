"""BatchPlan / ModelOutput: the whole contract between the scheduler and the model runner.

Only ints, lists, strings, SamplingParams and one numpy array (the grammar bitmask) cross it. The runner keeps its own per-request state
(token ids, block table, sampling state) keyed by request_id, and updates it from these diffs:

  * new_requests: requests the runner has not seen (first schedule, or resumed after preemption):
    sent in full, with every token id known so far and the full block table.
  * cached_requests: requests the runner already holds: only the blocks appended this step and the
    computed-token count at the start of the step. Blocks a sliding window left behind are freed without a
    word: the runner's table keeps their ids, which no backend reads (attention/backend.py). Tokens the runner
    sampled itself in the previous step are already in its state; it appends what it samples.
  * num_scheduled_tokens: how many tokens of each request to compute this step, in batch order
    (the order of the dict is the order of rows in the batch).
  * finished_request_ids: requests to drop (finished, aborted or preempted since the last plan).
  * grammar_bitmask / structured_output_request_ids: for requests under a grammar that sample this step, an
    int32 [rows, ceil(vocab / 32)] numpy array of allowed next tokens (bit j of word w: token 32 w + j) and
    request id -> its row. None / empty when no such request is scheduled.

A request samples a token this step when num_computed_tokens + num_scheduled_tokens reaches its token
count; a request still in the middle of a chunked prefill does not.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import msgspec

from pagedllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    request_id: str
    token_ids: list[int]  # prompt + outputs so far (outputs are non-empty only after a preemption)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    lora_id: Optional[int] = None
    # Models with several KV-cache groups (core/kv_cache_groups.py): the block ids of groups 1.. (block_ids is
    # group 0's). None with one group.
    group_block_ids: Optional[list[list[int]]] = None
    # A prompt given as embeddings: [num_prompt_tokens, hidden], used in place of the embedding lookup there.
    prompt_embeds: Optional[Any] = None


@dataclass(slots=True)  # one per running request per step: slots make it cheaper to build and read
class CachedRequestData:
    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # Speculative rollback: when set, the runner first cuts the request's block table to this many blocks
    # (the scheduler freed the blocks that only held rejected draft tokens), then appends new_block_ids.
    num_kept_blocks: Optional[int] = None
    # Several KV-cache groups: the blocks appended to groups 1.. (new_block_ids is group 0's; every group's list
    # has the same length). None with one group.
    group_new_block_ids: Optional[list[list[int]]] = None


@dataclass
class BatchPlan:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_request_ids: set[str] = field(default_factory=set)
    # Ids preempted in this very step (also listed in finished_request_ids).
    preempted_request_ids: set[str] = field(default_factory=set)
    # Speculative decoding: request id -> the draft tokens scheduled after its last token (they are counted in
    # num_scheduled_tokens); the runner verifies them. propose_drafts: the runner proposes drafts for the next
    # step (speculation is on for this batch size).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    propose_drafts: bool = False
    # Overlapped speculation (spec_decode/device_ngram.py): the drafts above are placeholders the runner fills on
    # the device, and a request's step in flight counts as emitting all it can (1 + its drafts).
    spec_overlap: bool = False
    grammar_bitmask: Optional[Any] = None  # numpy int32 [len(structured_output_request_ids), ceil(V / 32)]
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    # (source block id, destination block id): K/V blocks the runner copies before the forward (a finished
    # request's last partial block continued by a new request, e.g. a beam fork: core/partial_blocks.py).
    kv_block_copies: list[tuple[int, int]] = field(default_factory=list)
    seq: int = 0  # the scheduler's count of plans made, this one included (Request.added_after_plan)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class TokenLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Logprobs for one sampled position: the sampled token first, then the top-k (may repeat it)."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]  # rank of each token among all tokens (1 = most likely)


@dataclass
class ModelOutput:
    # Request ids in batch order, and for each the token ids sampled this step (empty when the
    # request was mid-prefill, one token otherwise; 1 + accepted drafts with speculative decoding).
    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    # Per request: one TokenLogprobs per sampled token, or None when logprobs were not asked for.
    logprobs: list[Optional[list[TokenLogprobs]]] = field(default_factory=list)
    # Requests that asked for prompt_logprobs: request id -> (first prompt position covered, one
    # TokenLogprobs per position, whose first token is the actual prompt token at that position).
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # Speculative decoding: per request (batch order) the drafts proposed for the next step, or None.
    spec_token_ids: Optional[list[list[int]]] = None
    # Overlapped speculation: per request (batch order) how many of the drafts it verified the device proposed
    # (the rest were padding), for the acceptance statistics; None otherwise.
    spec_num_drafts: Optional[list[int]] = None
    # Embedding requests whose prompt this step completed: request id -> pooled hidden state (fp32 values).
    pooled: Optional[dict[str, list[float]]] = None


class EngineCoreOutput(msgspec.Struct, array_like=True, gc=False):
    """What the engine core reports about one request after a step (new tokens, maybe finished).

    A msgspec Struct sent as an array: the server's engine core sends a step's outputs to the API process
    (entrypoints/messages.py), and a Struct is about 3x cheaper than a dataclass to build and encode there and
    to decode on the other side."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: Optional[list[TokenLogprobs]] = None
    finish_reason: Optional[str] = None  # None while running; "stop" | "length" | "abort"
    stop_reason: Optional[int | str] = None  # the stop token id that ended it, if any
    num_cached_tokens: int = 0
    # (first prompt position covered, one TokenLogprobs per position) when prompt_logprobs was asked for.
    prompt_logprobs: Optional[tuple[int, list[TokenLogprobs]]] = None
    # An embedding request's pooled hidden state, in the output that finishes it (pooling/).
    pooled: Optional[list[float]] = None
    # In the output of its first token: seconds from the engine core's receipt of the request to its first
    # scheduling (vllm:request_queue_time_seconds).
    queued_s: Optional[float] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
