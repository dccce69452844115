"""Scheduler: continuous batching under a per-step token budget, with chunked prefill and preemption.

One rule covers prefill, chunked prefill, prefix hits, recompute after preemption and decode: each step a
request is given up to (num_tokens - num_computed_tokens) tokens, so its computed count catches up with
its token count. No phase flags.

Step protocol (the engine core calls, in this order, every step):
  plan = schedule()                      # num_computed_tokens advances here, by what was scheduled
  output = runner.execute(plan)          # skipped by the engine when plan.is_empty
  outs = update_from_output(plan, output)  # ALWAYS call it (even for an empty plan): it appends the
                                           # sampled tokens, checks stops, and also returns outputs
                                           # of requests that schedule() had to finish.

schedule():
  1. Running requests, in admission order: min(remaining tokens, budget, long_prefill_token_threshold).
     When the pool runs dry, the newest running request is preempted (blocks freed, computed count
     reset to 0, put at the front of the waiting queue) until the allocation fits; if the request
     being scheduled is itself the newest, it is preempted and skipped. (scheduling_policy="priority":
     read "(priority, arrival) order" for admission order, "the largest (priority, arrival)" for the
     newest, and "back in its (priority, arrival) place" for the front of the queue.) A request that cannot grow
     while it is the only one running has filled the pool by itself and can never finish: it ends
     with FINISHED_LENGTH instead of looping forever.
  2. Only if nothing was preempted this step: waiting requests, FCFS (resumed ones are at the front;
     priority: in (priority, arrival) order; before step 1, the most urgent waiting request that a full running
     set or a short pool keeps out preempts running requests of strictly lower priority, which does not stop
     this step's admission),
     while budget and max_num_seqs allow: prefix-cache lookup, then a chunk of min(remaining, budget)
     tokens (with enable_chunked_prefill=False: all remaining tokens, or the request waits). The first one
     that does not fit stops admission (no preemption for waiting requests), except that a request that
     does not fit into an otherwise empty pool ends with FINISHED_LENGTH.

Invariants:
  * every running request holds blocks for its computed tokens; waiting requests hold no blocks;
  * after schedule(), num_computed_tokens counts the tokens whose K/V the step computes;
  * a running request samples a token in the step where num_computed_tokens reaches num_tokens.
"""
from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union

from pagedllm.core.batch_plan import (
    BatchPlan,
    CachedRequestData,
    EngineCoreOutput,
    ModelOutput,
    NewRequestData,
)
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import _FINISH_REASONS, Request, RequestStatus
from pagedllm.spec_decode.scheduling import SpecScheduling


# Ties of (priority, arrival_time) keep the order requests were added in.
_arrivals = itertools.count()


def _insort(queue: Union[list, deque], request: Request) -> None:
    """Insert `request` after every entry whose key is <= its own (priority scheduling's queues are sorted)."""
    key = request.priority_key
    i = bisect.bisect_right(queue, key, key=_priority_key)
    queue.insert(i, request)


def _priority_key(request: Request) -> tuple:
    return request.priority_key


def _queue_time(request: Request) -> Optional[float]:
    """Seconds the request waited from its arrival at the scheduler to its first scheduling."""
    t, queued = request.first_scheduled_time, request.queued_time
    return None if t is None or queued is None else max(0.0, t - queued)


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks held by requests, 0..1
    prefix_cache_queries: int  # cumulative tokens looked up in the prefix cache
    prefix_cache_hits: int  # cumulative tokens found there
    num_preemptions: int  # cumulative
    # Speculative decoding (cumulative; zeros without it).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    num_aborted: int = 0  # cumulative: requests finished from outside as aborted (disconnects, stop strings)
    running_lora_ids: tuple = ()  # distinct adapters of running requests
    waiting_lora_ids: tuple = ()  # distinct adapters of waiting requests
    # Sleep mode (set by the engine core, core/engine_core.sleep_state): vllm:engine_sleep_state's state
    sleep_state: str = "awake"


class Scheduler:
    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        block_size: int,
        num_blocks: int,
        enable_prefix_caching: bool = True,
        long_prefill_token_threshold: Optional[int] = None,
        async_scheduling: bool = False,
        enable_chunked_prefill: bool = True,
        num_speculative_tokens: int = 0,
        spec_disable_batch_size: Optional[int] = None,
        max_loras: Optional[int] = None,
        kv_group_windows: Sequence[Optional[int]] = (None,),
        long_rope_original: Optional[int] = None,
        scheduling_policy: str = "fcfs",
        ntk_original: Optional[int] = None,
    ) -> None:
        """kv_group_windows: the sliding window of each KV-cache group (core/kv_cache_groups.py; None: full
        attention); the default is one group of full-attention layers. long_rope_original: a LongRoPE model's
        original context when the engine's reaches past it (the model rotates a request longer than it with the
        long factors, shorter ones with the short factors); None otherwise. scheduling_policy: "fcfs" or
        "priority" (both queues kept in (priority, arrival) order, see _priority_key). ntk_original: a dynamic NTK
        model's context when the engine's reaches past it (a prompt longer than it is rotated with its own
        length's base: Request.ntk_prompt_len); None otherwise."""
        self.long_rope_original = long_rope_original
        self._held_out = False  # this step holds LongRoPE requests out of `running` (_recompute_outgrown)
        self.ntk_original = ntk_original
        if scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {scheduling_policy!r}.")
        if max_num_seqs < 1 or max_num_batched_tokens < 1 or max_model_len < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and max_model_len must be >= 1.")
        if long_prefill_token_threshold is not None and long_prefill_token_threshold < 1:
            raise ValueError(f"long_prefill_token_threshold must be >= 1, got {long_prefill_token_threshold}.")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.long_prefill_token_threshold = long_prefill_token_threshold
        # Off: a request's tokens run in one step or wait for a step with room for all of them (the engine makes
        # max_num_batched_tokens >= max_model_len so every request fits a step).
        self.enable_chunked_prefill = enable_chunked_prefill
        # Async scheduling: schedule() may run while the previous step is still in flight; each request
        # that samples is counted one token ahead (num_output_placeholders) until its token arrives.
        self.async_scheduling = async_scheduling
        # LoRA: running requests use at most max_loras distinct adapters (the runner's device slots); a waiting
        # request whose adapter would be one too many is held back, not failed. None: LoRA off.
        self.max_loras = max_loras
        # Priority: running and waiting stay sorted by (priority, arrival), so the loops below need no change: the
        # running loop serves the most urgent first and preempts from the end (vLLM's victim: the largest key),
        # admission takes the queue's front. Only inserts pay for it; fcfs keeps append / appendleft.
        self.priority = scheduling_policy == "priority"
        self.kv_cache_manager = KVCacheManager(
            block_size=block_size, num_blocks=num_blocks, enable_caching=enable_prefix_caching,
            group_windows=kv_group_windows,
        )
        self._groups = self.kv_cache_manager.num_groups > 1
        self._max_request_tokens: Optional[int] = None
        self.requests: dict[str, Request] = {}  # every unfinished request
        self._num_plans = 0  # BatchPlan.seq of the last plan made
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order; the last one is preempted first
        # Finished, aborted or preempted since the last plan: the runner must drop their state.
        self._finished_req_ids: set[str] = set()
        # Outputs of requests that schedule() finished (cannot grow); returned by the next update.
        self._pending_outputs: list[EngineCoreOutput] = []
        self.num_preemptions = 0
        self.num_aborted = 0
        # Unfinished requests that need_sync / need_sync_sampling (counted when added): while both are 0 no plan
        # can hold one, and the engine core skips asking each scheduled request (EngineCore._plan_needs_sync).
        self.num_needs_sync = 0
        self.num_needs_sync_sampling = 0
        self._max_reqs_this_step = max_num_seqs
        # Speculative decoding: drafts proposed by the runner are scheduled as extra tokens to compute, in steps
        # with at most spec_disable_batch_size running + waiting requests (spec_decode/scheduling.py).
        self.spec = SpecScheduling(num_speculative_tokens, spec_disable_batch_size, max_model_len)
        self.spec.long_rope_original = long_rope_original
        self.spec_stats = self.spec.stats
        # The inline per-row fast paths of _schedule_running and update_from_output (False: every row takes the
        # general path, the reference the tests compare them with).
        self.fast_paths = True

    # ---------------------------------------------------------------- bookkeeping

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_pool_tokens(self) -> int:
        """Tokens the whole KV pool can hold (no block is reserved)."""
        return self.kv_cache_manager.num_blocks * self.block_size

    @property
    def max_request_tokens(self) -> int:
        """The longest request the pool can hold by itself (sliding-window layers hold only their window)."""
        if self._max_request_tokens is None:
            self._max_request_tokens = self.kv_cache_manager.max_request_tokens(self.max_num_batched_tokens)
        return self._max_request_tokens

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"Request id {request.request_id!r} is already in use.")
        if request.num_tokens == 0:
            raise ValueError(f"Request {request.request_id!r} has an empty prompt; give at least one token.")
        request.status = RequestStatus.WAITING
        if self.long_rope_original is not None:
            request.rope_long = request.num_tokens > self.long_rope_original
        if self.ntk_original is not None and request.num_prompt_tokens > self.ntk_original:
            request.ntk_prompt_len = request.num_prompt_tokens
        self.kv_cache_manager.update_block_hashes(request)
        self.requests[request.request_id] = request
        request.added_after_plan = self._num_plans
        if request.queued_time is None:  # (a preempted request keeps its first one)
            request.queued_time = time.monotonic()
        request.length_limit = min(request.length_limit, self.max_model_len)  # (the fast paths' one test)
        request.sync_counted = (request.needs_sync, request.needs_sync_sampling)
        self.num_needs_sync += request.sync_counted[0]
        self.num_needs_sync_sampling += request.sync_counted[1]
        if self.priority:
            request.priority_key = (request.priority, request.arrival_time, next(_arrivals))
            _insort(self.waiting, request)
        else:
            self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=kv.get_usage(),
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            spec_num_drafts=self.spec_stats.num_drafts,
            spec_num_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
            spec_num_accepted_tokens_per_pos=tuple(self.spec_stats.num_accepted_tokens_per_pos),
            num_aborted=self.num_aborted,
            # Without LoRA no request has an adapter: skip the pass over every request (stats go out every step).
            running_lora_ids=self._lora_ids(self.running),
            waiting_lora_ids=self._lora_ids(self.waiting),
        )

    def _lora_ids(self, requests: Iterable[Request]) -> tuple:
        if self.max_loras is None:
            return ()
        return tuple(sorted({r.lora_id for r in requests if r.lora_id is not None}))

    def spec_active(self) -> bool:
        """Whether this step speculates: configured, and the load is small enough that it pays."""
        return self.spec.active(len(self.running), len(self.waiting))

    def spec_overlap_active(self) -> bool:
        """Whether speculating steps overlap (device drafts): the runner can, and no unfinished request's sampling
        or grammar needs every earlier token on the host."""
        return self.spec.overlap and self.num_needs_sync == 0

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def finish_requests(self, request_ids: Union[str, Iterable[str]], status: RequestStatus) -> None:
        """Finish requests from outside (abort, stop string): blocks are freed now. Unknown ids are ignored."""
        if not status.finished:
            raise ValueError(f"finish_requests needs a finished status, got {status.name}.")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        # dict.fromkeys: an id given twice (two aborts of one request in one call) is finished once
        to_finish = [self.requests[rid] for rid in dict.fromkeys(request_ids) if rid in self.requests]
        if not to_finish:
            return
        ids = {r.request_id for r in to_finish}
        if status == RequestStatus.FINISHED_ABORTED:
            self.num_aborted += len(to_finish)
        self.running = [r for r in self.running if r.request_id not in ids]
        self.waiting = deque(r for r in self.waiting if r.request_id not in ids)
        for request in to_finish:
            self._finish(request, status)

    def preempt_requests(self, request_ids: Iterable[str]) -> None:
        """Preempt running requests from outside (recovery from a failed step): blocks freed, recomputed later."""
        ids = set(request_ids)
        victims = [r for r in self.running if r.request_id in ids]
        self.running = [r for r in self.running if r.request_id not in ids]
        for request in reversed(victims):  # appendleft: keep their order at the front of the queue
            self._preempt(request)
            request.added_after_plan = self._num_plans  # (no plan is being made: every plan's row is void)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Mark finished and release everything; the caller removes it from running / waiting."""
        request.status = status
        self.kv_cache_manager.free(request, remember_partial=True)
        self.spec.forget(request)
        self._finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        needs_sync, needs_sync_sampling = request.sync_counted
        self.num_needs_sync -= needs_sync
        self.num_needs_sync_sampling -= needs_sync_sampling

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks and requeue it at the front of the waiting queue."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # a token in flight for it is dropped; it is recomputed
        original = self.long_rope_original
        if original is not None and request.rope_long != (request.num_tokens > original):
            # Recomputed with the factors of its present length: its blocks are hashed under them.
            request.rope_long = not request.rope_long
            request.block_hashes = []
        self.spec.forget(request)
        # A row for it in a plan made before this one (a step in flight) is void: it recomputes that position, maybe
        # in the plan being made (priority: an urgent request's room can readmit it at once), whose row is its own.
        request.added_after_plan = self._num_plans - 1
        request.num_preemptions += 1
        self.num_preemptions += 1
        if self.priority:
            _insort(self.waiting, request)  # back in its place: a more urgent request that came meanwhile goes first
        else:
            self.waiting.appendleft(request)
        self._finished_req_ids.add(request.request_id)

    def _finish_cannot_grow(self, request: Request) -> None:
        self._finish(request, RequestStatus.FINISHED_LENGTH)
        self._pending_outputs.append(
            EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=RequestStatus.FINISHED_LENGTH.finish_reason,
                num_cached_tokens=request.num_cached_tokens or 0,
            )
        )

    def _num_tokens_to_schedule(self, request: Request, num_computed_tokens: int, budget: int) -> int:
        if request.num_output_placeholders and self._reaches_limit(request):
            return 0  # the token in flight is its last one: do not compute past it
        remaining = len(request.all_token_ids) + request.num_output_placeholders - num_computed_tokens
        if not self.enable_chunked_prefill:
            return remaining if remaining <= budget else 0
        num_tokens = min(remaining, budget)
        if self.long_prefill_token_threshold is not None:
            num_tokens = min(num_tokens, self.long_prefill_token_threshold)
        return num_tokens

    def _reaches_limit(self, request: Request) -> bool:
        """Will the tokens already in flight finish this request by length?"""
        pending = request.num_output_placeholders
        max_tokens = request.sampling_params.max_tokens
        return ((max_tokens is not None and len(request.output_token_ids) + pending >= max_tokens)
                or len(request.all_token_ids) + pending >= self.max_model_len)

    # ---------------------------------------------------------------- schedule

    def schedule(self, max_num_reqs: Optional[int] = None) -> BatchPlan:
        """Plan one step. `max_num_reqs` caps the requests in this plan (pipeline micro-batches: the running
        set is spread over the in-flight slots so every stage has work)."""
        self._num_plans += 1
        plan = BatchPlan(seq=self._num_plans)
        budget = self.max_num_batched_tokens
        preempted: set[str] = set()
        scheduled: list[Request] = []
        self._max_reqs_this_step = max_num_reqs or self.max_num_seqs
        plan.propose_drafts = self.spec_active()
        # Overlapped verify steps need no host drafts: not while a request's sampling or grammar needs every
        # earlier token on the host (those steps run synchronously, with the host's drafts).
        plan.spec_overlap = plan.propose_drafts and self.spec_overlap_active()
        held = self._recompute_outgrown(preempted) if self.long_rope_original is not None else None
        self._held_out = bool(held)  # (their blocks free next step: no running request is then alone in the pool)
        # Priority: seats and blocks for the most urgent waiting request, taken from less urgent running ones. Not in
        # `preempted`: this step still admits (that is what they were freed for).
        made_room = self._preempt_for_urgent() if self.priority and self.waiting and self.running else None
        budget = self._schedule_running(plan, budget, preempted, scheduled)  # (these advance as they are planned)
        if held:
            if self.priority:  # running stays in (priority, arrival) order
                for request in held:
                    _insort(self.running, request)
            else:
                self.running[:0] = held
        num_running_scheduled = len(scheduled)
        if not preempted:
            self._schedule_waiting(plan, budget, scheduled)

        # Advance at schedule time: the step that follows computes exactly these tokens.
        num_scheduled = plan.num_scheduled_tokens
        async_scheduling = self.async_scheduling
        for request in scheduled[num_running_scheduled:]:
            request.num_computed_tokens += num_scheduled[request.request_id]
            if async_scheduling and request.num_computed_tokens >= len(request.all_token_ids):
                # This step samples a token the next schedule() must already count (async scheduling).
                request.num_output_placeholders += 1
        plan.total_num_scheduled_tokens = sum(plan.num_scheduled_tokens.values())
        plan.finished_request_ids = self._finished_req_ids
        plan.preempted_request_ids = preempted | made_room if made_room else preempted
        self._finished_req_ids = set()
        return plan

    def _preempt_for_urgent(self) -> Optional[set[str]]:
        """Priority scheduling: the most urgent waiting request, kept out by a full running set (max_num_seqs), too
        few free KV blocks for its first chunk or its adapter being one too many, takes the place of running
        requests of strictly lower priority, the least urgent first, as many as it needs. A request of equal priority
        is never preempted for it (their order is arrival's: no ping-pong), and nothing is for a request that the
        more urgent running ones would keep out anyway, or that cannot be admitted yet (its grammar compiling, too
        long for a step or for the whole pool)."""
        head = self.waiting[0]
        running = self.running
        if running[-1].priority <= head.priority:
            return None
        if head.structured_output is not None and not head.structured_output.is_ready():
            return None
        staying = [r for r in running if r.priority <= head.priority]  # what preemption may not touch
        if len(staying) >= self.max_num_seqs or self._lora_blocked(head, staying):
            return None
        kv = self.kv_cache_manager
        need, hits, chunk = 0, [], 0
        if not self._groups:  # (several KV-cache groups: seats and adapters only)
            params = head.sampling_params
            num_hit_tokens = 0
            if params.prompt_logprobs is None and params.pooling in (None, "last"):
                hits, num_hit_tokens = kv.get_computed_blocks(head, record_stats=False)
            chunk = self._num_tokens_to_schedule(head, num_hit_tokens, self.max_num_batched_tokens)
            if chunk <= 0:
                return None
            need = kv.num_free_blocks_taken(head, chunk, hits)
            if need > kv.num_blocks:
                return None
        made_room: set[str] = set()
        while running and running[-1].priority > head.priority:
            if (len(running) < self.max_num_seqs and kv.num_free_blocks >= need
                    and not self._lora_blocked(head, running)):
                break
            victim = running.pop()
            self._preempt(victim)
            made_room.add(victim.request_id)
            if hits:  # hits only the victim held are free blocks now: taking them back uses up free blocks too
                need = kv.num_free_blocks_taken(head, chunk, hits)
        return made_room

    def _lora_blocked(self, request: Request, running: Sequence[Request]) -> bool:
        """Would `request`'s adapter be one too many beside those of `running` (max_loras)?"""
        if self.max_loras is None or request.lora_id is None:
            return False
        active = {r.lora_id for r in running if r.lora_id is not None}
        return request.lora_id not in active and len(active) >= self.max_loras

    def _recompute_outgrown(self, preempted: set[str]) -> list[Request]:
        """LongRoPE: a request computed with the short factors whose next step reaches past the original context
        is recomputed whole with the long ones, as transformers does at that step (its keys cannot be re-rotated in
        place: other requests may share its blocks). One with a token in flight (async scheduling) is held out of
        this step until the token lands (recomputed without it, it would stop short of the boundary and sample
        across it again); returns those, taken out of `running`."""
        original = self.long_rope_original
        outgrown = [r for r in self.running
                    if not r.rope_long and len(r.all_token_ids) + r.num_output_placeholders > original]
        if not outgrown:
            return []
        ids = {r.request_id for r in outgrown}
        self.running = [r for r in self.running if r.request_id not in ids]
        held = [r for r in outgrown if r.num_output_placeholders]
        for request in reversed([r for r in outgrown if not r.num_output_placeholders]):  # keep their order
            self._preempt(request)
            preempted.add(request.request_id)
        return held

    def _schedule_running(
        self, plan: BatchPlan, budget: int, preempted: set[str], scheduled: list[Request]
    ) -> int:
        """Plan the running requests, in order, and advance each one's computed count as it is planned (a request
        planned here is never preempted later in the step: victims are taken from the end of the list)."""
        kv = self.kv_cache_manager
        spec = self.spec
        kept_blocks = spec.kept_blocks
        running = self.running  # the same list object throughout (preemption pops from it)
        max_reqs = self._max_reqs_this_step
        async_scheduling = self.async_scheduling
        # The usual row, a request decoding one token with room left in its last block, is planned inline below:
        # the same result as the general path (_num_tokens_to_schedule, allocate_slots) without its calls. Only
        # for the single full-attention block list; sliding windows and several KV-cache groups go the general way.
        fast_kv = self.fast_paths and kv.num_groups == 1 and kv.sliding_window is None
        req_blocks = kv.req_to_blocks
        num_cached_blocks = kv.num_cached_blocks
        caching = kv.enable_caching
        bs = self.block_size
        cached_requests = plan.cached_requests
        num_scheduled = plan.num_scheduled_tokens
        num_planned = len(scheduled)
        # (A for loop over the list itself: preemption pops victims from its end, which the loop then never reaches.)
        for request in running:
            if budget <= 0 or num_planned >= max_reqs:
                break
            if fast_kv:
                computed = request.num_computed_tokens
                pending = request.num_output_placeholders
                num_all = len(request.all_token_ids)
                if pending and num_all + pending >= request.length_limit:
                    continue  # the token in flight is its last one: do not compute past it (_reaches_limit)
                if num_all + pending - computed == 1 and not request.spec_token_ids:
                    rid = request.request_id
                    blocks = req_blocks.get(rid)
                    if blocks is not None and computed < len(blocks) * bs:  # its slot is in a block it holds
                        if caching:
                            num_known = computed + 1 if computed + 1 < num_all else num_all
                            if num_known // bs > num_cached_blocks[rid]:  # a block became full
                                kv._cache_full_blocks(request, num_known)
                        cached_requests.append(CachedRequestData(
                            rid, [], computed, kept_blocks.pop(rid, None) if kept_blocks else None))
                        num_scheduled[rid] = 1
                        computed += 1
                        request.num_computed_tokens = computed
                        if async_scheduling and computed >= num_all:
                            request.num_output_placeholders = pending + 1
                        scheduled.append(request)
                        num_planned += 1
                        budget -= 1
                        continue
            num_new_tokens = self._num_tokens_to_schedule(request, request.num_computed_tokens, budget)
            if num_new_tokens <= 0:  # already caught up (the runner sent no token for it last step)
                continue
            drafts = (spec.drafts_to_verify(request, num_new_tokens, budget, plan.propose_drafts, plan.spec_overlap)
                      if request.spec_token_ids else ())
            num_new_tokens += len(drafts)
            new_block_ids = kv.allocate_slots(request, num_new_tokens)
            while new_block_ids is None:
                if len(self.running) == 1 and not self._held_out:
                    # It alone holds the whole pool and still needs more: it can never finish.
                    self.running.pop()
                    self._finish_cannot_grow(request)
                    break
                victim = self.running.pop()
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is request:
                    break
                new_block_ids = kv.allocate_slots(request, num_new_tokens)
            if new_block_ids is None:
                break  # request was the last running one: nothing after it is left to schedule
            group_ids = None
            if self._groups:
                new_block_ids, *group_ids = new_block_ids
            cached_requests.append(
                CachedRequestData(
                    request_id=request.request_id,
                    new_block_ids=new_block_ids,
                    num_computed_tokens=request.num_computed_tokens,
                    num_kept_blocks=kept_blocks.pop(request.request_id, None) if kept_blocks else None,
                    group_new_block_ids=group_ids,
                )
            )
            num_scheduled[request.request_id] = num_new_tokens
            if drafts:
                plan.scheduled_spec_decode_tokens[request.request_id] = drafts
            scheduled.append(request)
            num_planned += 1
            budget -= num_new_tokens
            request.num_computed_tokens += num_new_tokens
            if async_scheduling and request.num_computed_tokens >= len(request.all_token_ids):
                # This step samples a token the next schedule() must count; an overlapped verify step counts as
                # emitting all it can (the next step's positions assume it; the runner corrects them).
                request.num_output_placeholders += 1 + (len(drafts) if plan.spec_overlap else 0)
        return budget

    def _schedule_waiting(self, plan: BatchPlan, budget: int, scheduled: list[Request]) -> None:
        if self.max_loras is None:
            self._admit_waiting(plan, budget, scheduled, None)
            return
        # Held back for want of an adapter slot: they keep their place in the queue, later requests go ahead.
        held: list[Request] = []
        active = {r.lora_id for r in self.running if r.lora_id is not None}  # grows as requests are admitted
        try:
            self._admit_waiting(plan, budget, scheduled, (held, active))
        finally:
            self.waiting.extendleft(reversed(held))

    def _lora_held_back(self, request: Request, lora: Optional[tuple[list[Request], set[int]]]) -> bool:
        """Would admitting `request` make running requests use more than max_loras adapters? (LoRA only)"""
        if lora is None or request.lora_id is None:
            return False
        _, active = lora
        return request.lora_id not in active and len(active) >= self.max_loras

    def _admit_waiting(self, plan: BatchPlan, budget: int, scheduled: list[Request],
                       lora: Optional[tuple[list[Request], set[int]]]) -> None:
        kv = self.kv_cache_manager
        compiling: list[Request] = []  # waiting for their grammar: passed over, kept in order at the front
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and len(scheduled) < self._max_reqs_this_step):
            request = self.waiting[0]
            if request.structured_output is not None and not request.structured_output.is_ready():
                compiling.append(self.waiting.popleft())
                continue
            if self._lora_held_back(request, lora):
                lora[0].append(self.waiting.popleft())
                continue
            partial = None  # (source block, tokens): a finished request's partial block that continues this one
            params = request.sampling_params
            if params.prompt_logprobs is None and params.pooling in (None, "last"):
                hit_blocks, num_hit_tokens = kv.get_computed_blocks(request, record_stats=False)
                partial = kv.partial_block_hit(request, num_hit_tokens)
            else:  # every prompt position must be computed to score or pool it: no prefix-cache hits
                hit_blocks, num_hit_tokens = [], 0
            num_copied = partial[1] if partial else 0
            num_new_tokens = self._num_tokens_to_schedule(request, num_hit_tokens + num_copied, budget)
            if num_new_tokens <= 0:
                break  # no chunked prefill: it waits (FCFS) for a step with room for its whole prompt
            new_block_ids = kv.allocate_slots(request, num_copied + num_new_tokens, hit_blocks)
            if new_block_ids is None:
                if self.running:
                    break  # wait for running requests to free blocks
                # Does not fit into an empty pool: it can never run.
                self.waiting.popleft()
                self._finish_cannot_grow(request)
                continue
            if partial:  # copy-on-write at the fork: its first fresh block gets the partial block's K/V
                plan.kv_block_copies.append((partial[0], new_block_ids[len(hit_blocks)]))
                kv.num_partial_block_copies += 1
                num_hit_tokens += num_copied
            if kv.enable_caching:
                kv.record_prefix_cache_lookup(request.num_tokens, num_hit_tokens)
            self.waiting.popleft()
            if self.priority:
                _insort(self.running, request)
            else:
                self.running.append(request)
            if lora is not None and request.lora_id is not None:
                lora[1].add(request.lora_id)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_hit_tokens
            plan.new_requests.append(
                NewRequestData(
                    request_id=request.request_id,
                    token_ids=list(request.all_token_ids),
                    num_prompt_tokens=request.num_prompt_tokens,
                    sampling_params=request.sampling_params,
                    block_ids=kv.get_block_ids(request.request_id),
                    num_computed_tokens=num_hit_tokens,
                    lora_id=request.lora_id,
                    group_block_ids=kv.get_group_block_ids(request.request_id),
                    prompt_embeds=request.prompt_embeds,
                )
            )
            plan.num_scheduled_tokens[request.request_id] = num_new_tokens
            scheduled.append(request)
            budget -= num_new_tokens
        self.waiting.extendleft(reversed(compiling))

    # ---------------------------------------------------------------- update

    def update_from_output(self, plan: BatchPlan, output: ModelOutput) -> list[EngineCoreOutput]:
        """Append the sampled tokens, apply stop rules, free finished requests, report per request."""
        outputs, self._pending_outputs = self._pending_outputs, []
        req_ids = output.req_ids
        if not req_ids:
            return outputs
        logprobs = output.logprobs
        finished: list[Request] = []
        spec_ids = output.spec_token_ids
        if (not self.fast_paths or output.prompt_logprobs or output.pooled or plan.scheduled_spec_decode_tokens
                or (logprobs and logprobs.count(None) != len(logprobs))):
            for index, (request_id, sampled, token_logprobs) in enumerate(
                    zip(req_ids, output.sampled_token_ids, logprobs or [None] * len(req_ids))):
                self._update_request(request_id, index, sampled, token_logprobs, plan, output, outputs, finished)
        else:
            # The usual step (no logprobs, prompt logprobs or drafts verified; next drafts proposed or not): a
            # request that sampled one token and has no grammar is applied inline, the same as _update_request
            # does; any other goes through it. A token that may end the request (a stop id, or its length limit)
            # takes _check_stop's full rules.
            requests = self.requests
            running_status = RequestStatus.RUNNING
            for index, (request_id, sampled) in enumerate(zip(req_ids, output.sampled_token_ids)):
                request = requests.get(request_id)
                # finished or aborted meanwhile (its id maybe reused since) / mid-prefill
                if request is None or not sampled or request.added_after_plan >= plan.seq:
                    continue
                if len(sampled) != 1 or request.structured_output is not None:
                    self._update_request(request_id, index, sampled, None, plan, output, outputs, finished)
                    continue
                if request.num_output_placeholders:
                    request.num_output_placeholders -= 1
                all_ids = request.all_token_ids
                # Skip: preempted, or still mid-prefill (a token sampled there is not a real next token).
                if request.status != running_status or request.num_computed_tokens < len(all_ids):
                    continue
                token_id = sampled[0]
                request.output_token_ids.append(token_id)
                all_ids.append(token_id)
                finish_reason = None
                if token_id in request.stop_ids or len(all_ids) >= request.length_limit:
                    status = self._check_stop(request, token_id)
                    if status is not None:
                        request.status = status
                        finish_reason = _FINISH_REASONS[status]
                        self._finish(request, status)
                        finished.append(request)
                if spec_ids is not None and finish_reason is None:  # the drafts proposed for its next step
                    request.spec_token_ids = spec_ids[index]
                queued = None
                if request.first_token_time is None:
                    request.first_token_time = time.monotonic()
                    queued = _queue_time(request)
                outputs.append(EngineCoreOutput(request_id, sampled, finish_reason=finish_reason,
                                                stop_reason=request.stop_reason,
                                                num_cached_tokens=request.num_cached_tokens or 0, queued_s=queued))
        if finished:  # (freed as they finished, in batch order: the free queue's order is the same as ever)
            running = self.running
            if len(finished) * 8 < len(running):  # a few: list.remove is a C scan
                for request in finished:
                    running.remove(request)
            else:
                self.running = [r for r in running if not r.is_finished]
        self.spec.note_proposals(output.spec_token_ids)
        return outputs

    def _update_request(self, request_id: str, index: int, sampled: list[int], token_logprobs, plan: BatchPlan,
                        output: ModelOutput, outputs: list[EngineCoreOutput], finished: list[Request]) -> None:
        """Apply one request's row of a step (any case); a request it finishes is freed and listed in `finished`
        (the caller takes those out of the running list)."""
        request = self.requests.get(request_id)
        if request is None or request.added_after_plan >= plan.seq:  # finished or aborted meanwhile (id reused?)
            return
        prompt_logprobs = output.prompt_logprobs
        plp = prompt_logprobs.get(request_id) if prompt_logprobs else None
        if not sampled:
            if plp is not None:  # a prefill chunk's prompt scores
                outputs.append(EngineCoreOutput(request_id=request_id, new_token_ids=[], prompt_logprobs=plp,
                                                num_cached_tokens=request.num_cached_tokens or 0))
            return
        spec_tokens = plan.scheduled_spec_decode_tokens
        drafts = spec_tokens.get(request_id) if spec_tokens else None
        if request.num_output_placeholders:
            pending = 1 + (len(drafts) if drafts and plan.spec_overlap else 0)
            request.num_output_placeholders = max(0, request.num_output_placeholders - pending)
        # Skip: preempted, or still mid-prefill (a token sampled there is not a real next token).
        if request.status != RequestStatus.RUNNING or request.num_computed_tokens < len(request.all_token_ids):
            return
        if drafts:
            real = output.spec_num_drafts[index] if output.spec_num_drafts is not None and index >= 0 else None
            self.spec.rollback_rejected(request, drafts, len(sampled) - 1, self.kv_cache_manager, real)
        if len(sampled) == 1 and request.structured_output is None:  # one token, no grammar
            token_id = sampled[0]
            request.output_token_ids.append(token_id)
            request.all_token_ids.append(token_id)
            status = self._check_stop(request, token_id)
            if status is not None:
                request.status = status
            new_token_ids = [token_id]
        else:
            new_token_ids = self._append_tokens(request, sampled)
        if request.sampling_params.pooling is not None:  # an embedding: its one token is no output (nor counted)
            new_token_ids = []
            if request.status.finished:  # it stops once pooled, as vLLM's: "stop", not the token's "length" or EOS
                request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, None
        is_finished = request.status.finished
        if output.spec_token_ids is not None and not is_finished:
            request.spec_token_ids = output.spec_token_ids[index]
        queued = None
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
            queued = _queue_time(request)
        if is_finished:
            self._finish(request, request.status)
            finished.append(request)
        outputs.append(
            EngineCoreOutput(
                request_id=request_id,
                new_token_ids=new_token_ids,
                new_logprobs=None if token_logprobs is None else token_logprobs[:len(new_token_ids)],
                finish_reason=_FINISH_REASONS.get(request.status),
                stop_reason=request.stop_reason,
                num_cached_tokens=request.num_cached_tokens or 0,
                prompt_logprobs=plp,
                pooled=output.pooled.get(request_id) if output.pooled else None,
                queued_s=queued,
            )
        )

    def _append_tokens(self, request: Request, sampled: list[int]) -> list[int]:
        """Append tokens one at a time, stopping at the first that ends the request."""
        appended = []
        grammar = request.structured_output
        for token_id in sampled:
            request.append_output_token_ids([token_id])
            appended.append(token_id)
            status = self._check_stop(request, token_id)
            if grammar is not None and not grammar.accept([token_id]) and status is None:
                status = RequestStatus.FINISHED_ABORTED  # the mask forbids this; never continue off-grammar
            if status is None and grammar is not None and grammar.is_terminated():
                status = RequestStatus.FINISHED_STOPPED  # the grammar is complete (its stop token was taken)
            if status is not None:
                request.status = status
                break
        return appended

    def _check_stop(self, request: Request, token_id: int) -> Optional[RequestStatus]:
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if num_output >= params.min_tokens:
            if not params.ignore_eos and request.eos_token_id is not None and token_id == request.eos_token_id:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.all_stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        max_tokens = params.max_tokens
        if (max_tokens is not None and num_output >= max_tokens) or (
            len(request.all_token_ids) >= self.max_model_len
        ):
            return RequestStatus.FINISHED_LENGTH
        return None

