"""The scheduler's speculative-decoding bookkeeping (pure Python; owned by core.scheduler.Scheduler).

Drafts are more tokens to compute: a caught-up request with drafts is scheduled 1 + len(drafts) tokens. After the
step, rejected drafts are rolled back: the computed count steps back and blocks that held only rejected slots are
freed; the runner learns the kept block count with the request's next CachedRequestData.
"""
from __future__ import annotations

from typing import Optional

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.spec_decode.stats import SpecDecodeStats, draft_room

# A draft the runner fills on the device (overlapped verify steps: the host does not know the drafts).
PLACEHOLDER = -1


class SpecScheduling:
    def __init__(self, num_speculative_tokens: int, disable_by_batch_size: Optional[int], max_model_len: int) -> None:
        self.k = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats(num_spec_tokens=num_speculative_tokens)
        self.kept_blocks: dict[str, int] = {}  # request id -> block count after a rollback (sent once)
        # Whether the last applied step proposed any draft: under async scheduling only then does the engine wait
        # for the step in flight (whose drafts the next step verifies); a proposer finding nothing keeps the
        # overlap of plain async steps. True at start so a first proposing step is waited for.
        self.expects_drafts = True
        # Overlapped verify steps (the runner keeps n-gram drafts on the device: spec_decode/device_ngram.py): a
        # step verifies placeholder drafts while the previous one is still in flight. Set by the engine core when
        # its runner can; a step uses it only when no unfinished request needs host drafts (Scheduler.schedule).
        self.overlap = False
        # LongRoPE with both tables (Scheduler.long_rope_original): a request rotated with the short factors
        # verifies no draft past the original context (those logits need the long factors: it is recomputed first)
        self.long_rope_original: Optional[int] = None

    def _rope_room(self, request: Request, room: int) -> int:
        if self.long_rope_original is None or request.rope_long:
            return room
        # the step's longest sequence: the known and in-flight tokens plus the drafts
        return min(room, self.long_rope_original - request.num_tokens - request.num_output_placeholders)

    def wants_sync(self, running) -> bool:
        """Under async scheduling: wait for the step in flight before scheduling the next one, because the next
        verifies drafts (the last applied step proposed some, or a running request holds drafts: a step with drafts
        never runs overlapped)."""
        return self.expects_drafts or any(r.spec_token_ids for r in running)

    def note_proposals(self, spec_token_ids) -> None:
        """A step's output was applied: its proposals (per request, batch order) or None (nothing proposed)."""
        self.expects_drafts = bool(spec_token_ids) and any(spec_token_ids)

    def active(self, num_running: int, num_waiting: int) -> bool:
        """Whether a step speculates: configured, and the load small enough that it pays."""
        if self.k <= 0:
            return False
        limit = self.disable_by_batch_size
        return limit is None or num_running + num_waiting <= limit

    def forget(self, request: Request) -> None:
        """Preempted or finished: its drafts and pending rollback mean nothing any more."""
        request.spec_token_ids = []
        self.kept_blocks.pop(request.request_id, None)

    def drafts_to_verify(self, request: Request, num_new_tokens: int, budget: int, active: bool,
                         overlap: bool = False) -> list[int]:
        """The request's proposed drafts this step verifies (consumed either way: drafts are only valid right after
        the step that proposed them). Only for a request whose one remaining token is its last.

        overlap: the step verifies the runner's device drafts (k placeholders, fewer near the request's length
        limits) whatever the step in flight for it emits; the request's spec_token_ids only say that its last
        known proposal found some. Room is counted as if the step in flight emitted all it can."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        if not drafts or not active or num_new_tokens != 1:
            return []
        pending = request.num_output_placeholders
        grammar = request.structured_output
        if overlap:
            if grammar is not None:
                return []  # (never: a grammar's request keeps steps from overlapping; the host cannot mask those)
            if request.num_computed_tokens != request.num_tokens + pending - 1:
                return []
            room = draft_room(request.num_output_tokens + pending, request.num_tokens + pending, request.max_tokens,
                              self.max_model_len)
            room = self._rope_room(request, room)
            return [PLACEHOLDER] * max(0, min(self.k, room, budget - 1))
        if pending or request.num_computed_tokens != request.num_tokens - 1 or drafts[0] == PLACEHOLDER:
            return []  # (placeholders: proposed by an overlapped step; the host does not know them)
        room = self._rope_room(request, draft_room(request.num_output_tokens, request.num_tokens, request.max_tokens,
                                                   self.max_model_len))
        drafts = drafts[:max(0, min(room, budget - 1))]
        return grammar_prefix(grammar, drafts) if grammar is not None and drafts else drafts

    def rollback_rejected(self, request: Request, drafts: list[int], num_accepted: int, kv: KVCacheManager,
                          num_real: Optional[int] = None) -> None:
        """The step computed K/V for every draft; only the accepted ones count. Prefix-cache hashes never covered
        drafts (they are not tokens), so nothing cached is touched. num_real: of placeholder drafts, how many the
        device proposed (the rest were padding; the statistics count the real ones)."""
        real = len(drafts) if num_real is None else min(num_real, len(drafts))
        if real:
            self.stats.observe(real, min(num_accepted, real))
        num_rejected = len(drafts) - num_accepted
        if num_rejected <= 0:
            return
        request.num_computed_tokens -= num_rejected
        before = len(kv.req_to_blocks.get(request.request_id, ()))
        kept = kv.trim(request, request.num_computed_tokens)
        if kept < before:
            self.kept_blocks[request.request_id] = kept


def grammar_prefix(grammar, drafts: list[int]) -> list[int]:
    """The drafts up to the first one the request's grammar rejects (a later one could never be accepted: the
    verify row before it is masked to the grammar) and none past one that ends the grammar. The matcher is checked,
    not advanced: it stays at the request's real tokens."""
    return drafts[:grammar.validate(drafts)]
