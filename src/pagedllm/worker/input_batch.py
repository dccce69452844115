"""InputBatch: persistent host-side arrays of the requests the runner holds, updated from plan diffs.

Each running request owns one row: its token ids (prompt + outputs) and its block table. Building a step's
inputs is then a handful of vectorized numpy gathers, not a Python loop over tokens or blocks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from pagedllm.core.batch_plan import BatchPlan, NewRequestData
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.sampling_batch import SamplingBatch


@dataclass
class CachedRequestState:
    req_id: str
    row: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    num_computed_tokens: int
    lora_id: Optional[int] = None
    rope_long: bool = False  # LongRoPE: longer than the original context when its computation started
    # A pooling request's pooling so far (fp32 on the device): mean's running sum, cls's first row, all's chunks' rows.
    pool_acc: Any = None
    prompt_embeds: Any = None  # [num_prompt_tokens, hidden] on the CPU: a prompt given as embeddings

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass
class StepInputs:
    """One step's flattened batch, host side. Rows are in plan order."""

    req_ids: list[str]
    states: list[CachedRequestState]
    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    query_start_loc: np.ndarray  # [num_reqs + 1] int32
    seq_lens: np.ndarray  # [num_reqs] int32
    block_table: np.ndarray  # [num_reqs, max_blocks_in_batch] int32
    sample_rows: np.ndarray  # indices (into req_ids) of requests that sample this step
    # Rows whose last input token is one the host has not seen yet (sampled by the step in flight).
    in_flight_rows: np.ndarray
    max_query_len: int
    max_seq_len: int = 0  # seq_lens.max()
    # Speculative decoding: draft tokens per request id this step verifies (their inputs follow the last token).
    spec_token_ids: Optional[dict[str, list[int]]] = None
    propose_drafts: bool = False
    spec_overlap: bool = False  # the drafts are placeholders filled on the device (BatchPlan.spec_overlap)
    rows: Optional[np.ndarray] = None  # each request's row in the InputBatch's arrays
    # InputBatch.num_dropped when the step was prepared: unchanged when its result comes, every row still holds
    # the request it held (no row was freed or reused since).
    dropped_epoch: int = 0
    # Several KV-cache groups (core/kv_cache_groups.py): groups 1..'s slot mappings and block tables (the fields
    # above are group 0's). None with one group.
    group_slot_mappings: Optional[list[np.ndarray]] = None
    group_block_tables: Optional[list[np.ndarray]] = None
    # Embedding requests whose prompt this step completed: request id -> pooled hidden state (ModelOutput.pooled).
    pooled: Optional[dict[str, list[float]]] = None


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, block_size: int,
                 vocab_size: int = 0, num_kv_groups: int = 1) -> None:
        self.block_size = block_size
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        # One table per KV-cache group; every group of a row holds the same number of entries.
        self.block_tables = np.zeros((num_kv_groups, max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.block_table = self.block_tables[0]
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        # Per row, kept in step with the row's state: tokens known to the runner, and tokens computed.
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        self.sampling = SamplingBatch(max_num_reqs, vocab_size)
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))
        self.requests: dict[str, CachedRequestState] = {}
        self.num_dropped = 0  # requests whose state left the batch so far (finished, preempted, restarted)
        # LongRoPE with both tables: the original context (a request's factors are chosen when it is added, as the
        # scheduler chooses them: core/scheduler.py, rope_long)
        self.long_rope_original: Optional[int] = None

    # ------------------------------------------------------------------ diffs
    def update(self, plan: BatchPlan) -> None:
        for req_id in plan.finished_request_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self._free(state.row)
        for new in plan.new_requests:
            self._add(new)
        requests = self.requests
        rows, computed = [], []  # written into num_computed at once (a numpy write per row costs more)
        for cached in plan.cached_requests:
            state = requests[cached.request_id]
            state.num_computed_tokens = n = cached.num_computed_tokens
            rows.append(state.row)
            computed.append(n)
            if cached.num_kept_blocks is not None:  # speculative rollback freed its tail blocks
                self.num_blocks[state.row] = min(self.num_blocks[state.row], cached.num_kept_blocks)
            if cached.new_block_ids:
                self._append_blocks(state.row, cached.new_block_ids, cached.group_new_block_ids)
        if rows:
            self.num_computed[rows] = computed
        for req_id, drafts in plan.scheduled_spec_decode_tokens.items():
            # Draft inputs sit past the last token; the tokens appended after verification overwrite them.
            state = self.requests[req_id]
            self.token_ids[state.row, state.num_tokens:state.num_tokens + len(drafts)] = drafts

    def _add(self, new: NewRequestData) -> None:
        if new.request_id in self.requests:  # resumed without a finish notice: start over
            self._free(self.requests.pop(new.request_id).row)
        row = self.free_rows.pop()
        n = len(new.token_ids)
        self.token_ids[row, :n] = new.token_ids
        self.num_blocks[row] = 0
        self._append_blocks(row, new.block_ids, new.group_block_ids)
        self.num_tokens[row] = n
        self.num_computed[row] = new.num_computed_tokens
        self.sampling.set_row(row, new.sampling_params)
        self.requests[new.request_id] = CachedRequestState(
            req_id=new.request_id, row=row, prompt_token_ids=list(new.token_ids[:new.num_prompt_tokens]),
            output_token_ids=list(new.token_ids[new.num_prompt_tokens:]), sampling_params=new.sampling_params,
            num_computed_tokens=new.num_computed_tokens, lora_id=new.lora_id, prompt_embeds=new.prompt_embeds,
            rope_long=self.long_rope_original is not None and n > self.long_rope_original)

    def _free(self, row: int) -> None:
        self.free_rows.append(row)
        self.sampling.clear_row(row)
        self.num_dropped += 1

    def _append_blocks(self, row: int, block_ids: list[int], group_ids: Optional[list[list[int]]] = None) -> None:
        if block_ids:
            start = self.num_blocks[row]
            end = start + len(block_ids)
            self.block_table[row, start:end] = block_ids
            for g, ids in enumerate(group_ids or (), 1):
                self.block_tables[g, row, start:end] = ids
            self.num_blocks[row] = end

    def append_token(self, state: CachedRequestState, token: int) -> None:
        row = state.row
        n = self.num_tokens[row]
        self.token_ids[row, n] = token
        self.num_tokens[row] = n + 1
        state.output_token_ids.append(token)

    def append_tokens(self, state: CachedRequestState, tokens: list[int]) -> None:
        """append_token for several tokens of one row (a verify step's emitted tokens): one numpy write."""
        row = state.row
        n = self.num_tokens[row]
        self.token_ids[row, n:n + len(tokens)] = tokens
        self.num_tokens[row] = n + len(tokens)
        state.output_token_ids.extend(tokens)

    def append_sampled(self, states: list[CachedRequestState], tokens: list[int],
                       rows: Optional[np.ndarray] = None) -> None:
        """append_token for many rows: one numpy write for the token ids, a list append per row. rows: the states'
        rows, when the caller has them."""
        if not states:
            return
        if rows is None:
            rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
        n = self.num_tokens[rows]
        self.token_ids[rows, n] = tokens
        self.num_tokens[rows] = n + 1
        for state, token in zip(states, tokens):
            state.output_token_ids.append(token)

    # ------------------------------------------------------------------ step inputs
    def prepare(self, plan: BatchPlan) -> StepInputs:
        # (Every step runs this; at a few requests the numpy calls' fixed cost is most of it, so a pure-decode
        # step takes the shorter branch below and the rest avoid calls that have a cheaper twin.)
        sched = plan.num_scheduled_tokens
        req_ids = list(sched)
        requests = self.requests
        states = [requests[r] for r in req_ids]
        num_reqs = len(states)
        rows = np.array([s.row for s in states], dtype=np.int64)
        starts = self.num_computed[rows]
        totals = self.num_tokens[rows]
        spec = plan.scheduled_spec_decode_tokens
        if spec:  # a request verifying drafts samples when its computed count reaches its last draft
            totals += np.array([len(spec.get(r, ())) for r in req_ids], dtype=np.int64)
        if plan.total_num_scheduled_tokens == num_reqs:  # pure decode: one token per request
            query_start_loc = np.arange(num_reqs + 1, dtype=np.int32)
            seq_lens = starts + 1
            token_rows, positions, max_query_len = rows, starts, 1
        else:
            num_sched = np.array(list(sched.values()), dtype=np.int64)
            query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
            query_start_loc[1:] = num_sched.cumsum()
            num_tokens = int(query_start_loc[-1])
            seq_lens = starts + num_sched
            token_rows = np.repeat(rows, num_sched)
            positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(starts - query_start_loc[:-1], num_sched)
            max_query_len = int(num_sched.max())
        input_ids = self.token_ids[token_rows, positions]
        bs = self.block_size
        block_idx, offset = np.divmod(positions, bs)
        slot_mapping = self.block_table[token_rows, block_idx].astype(np.int64) * bs + offset
        max_seq_len = int(seq_lens.max())
        max_blocks = -(-max_seq_len // bs)
        group_slots = group_tables = None
        if len(self.block_tables) > 1:
            group_slots = [t[token_rows, block_idx].astype(np.int64) * bs + offset for t in self.block_tables[1:]]
            group_tables = [t[rows, :max_blocks] for t in self.block_tables[1:]]
        past = seq_lens - totals  # >= 0: the request samples; > 0: its last input is the token in flight
        return StepInputs(
            req_ids=req_ids, states=states, input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
            query_start_loc=query_start_loc, seq_lens=seq_lens.astype(np.int32),
            block_table=self.block_table[rows, :max_blocks], sample_rows=np.nonzero(past >= 0)[0],
            in_flight_rows=np.nonzero(past > 0)[0], max_query_len=max_query_len, max_seq_len=max_seq_len,
            spec_token_ids=spec or None, propose_drafts=plan.propose_drafts, spec_overlap=plan.spec_overlap,
            rows=rows, group_slot_mappings=group_slots, group_block_tables=group_tables, dropped_epoch=self.num_dropped)
