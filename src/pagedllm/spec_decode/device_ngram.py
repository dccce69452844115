"""N-gram speculation kept on the device, so that a verify step can be launched before the previous one is read.

With async scheduling a plain step N+1 is launched while step N runs: its one unknown input (N's token) is taken
on the device. A verify step has three more unknowns: how many of N's drafts were accepted (which shifts the
positions, slots and sequence lengths of N+1's tokens), the token N emitted last, and N+1's drafts (proposed from
a history that includes N's tokens). `DeviceNgram` keeps what answers them on the device, per InputBatch row:

  * the row's token history (`hist`, `lens`), appended with each step's emitted tokens;
  * the drafts proposed after the row's last step (`drafts`, `num_drafts`), by `propose_ngram`: the same rule
    as the host's NgramProposer (the latest earlier occurrence of the longest suffix n-gram, n from
    prompt_lookup_max down to prompt_lookup_min), tested against it.

The scheduler then plans a verify step with placeholder drafts (scheduling.PLACEHOLDER) and the positions of
"every draft of N accepted"; the runner fills the drafts and subtracts N's rejected count on the device
(worker/model_runner.py). A row proposing fewer than k drafts is padded with tokens of its history: verifying a
padded draft is exact (a draft is only kept if the target model picks it), it only costs a row.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch


def propose_ngram(hist: torch.Tensor, lens: torch.Tensor, k: int, min_n: int, max_n: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """hist: [R, W] token histories (garbage past each length), lens: [R] int64 lengths (<= W).
    Returns (drafts [R, k] int64, counts [R] int64): the first counts[r] entries of row r are its proposal (the
    tokens that followed the latest earlier match of its longest matching suffix n-gram), the rest padding."""
    num_rows, width = hist.shape
    device = hist.device
    found = torch.zeros(num_rows, dtype=torch.bool, device=device)
    start = torch.zeros(num_rows, dtype=torch.int64, device=device)
    for n in range(max_n, min_n - 1, -1):
        if width <= n:
            continue
        span = torch.arange(n, device=device)
        suffix = hist.gather(1, ((lens - n).clamp(min=0)[:, None] + span).clamp(max=width - 1))  # [R, n]
        windows = hist.unfold(1, n, 1)  # [R, W - n + 1, n]
        match = (windows == suffix[:, None, :]).all(dim=2)
        starts = torch.arange(windows.shape[1], device=device)
        match &= starts[None, :] < (lens - n)[:, None]  # a token must follow the match
        latest = torch.where(match, starts[None, :], -1).amax(dim=1)
        hit = (latest >= 0) & ~found
        start = torch.where(hit, latest + n, start)
        found |= hit
    counts = torch.where(found, (lens - start).clamp(min=0, max=k), 0)
    drafts = hist.gather(1, (start[:, None] + torch.arange(k, device=device)).clamp(max=width - 1))
    return drafts, counts


class DeviceNgram:
    """Per InputBatch row: the token history and the latest proposal, on the runner's device."""

    def __init__(self, max_reqs: int, max_model_len: int, k: int, min_n: int, max_n: int,
                 device: torch.device) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self.width = max_model_len
        self.hist = torch.zeros((max_reqs, max_model_len), dtype=torch.int32, device=device)  # (token ids fit)
        self.lens = torch.zeros(max_reqs, dtype=torch.int64, device=device)
        self.drafts = torch.zeros((max_reqs, k), dtype=torch.int64, device=device)
        self.num_drafts = torch.zeros(max_reqs, dtype=torch.int64, device=device)
        # CUDA: every step's packed results (DeviceStep.after_step) in this one buffer, grown as needed. A step's
        # readers (its host copy, the next step's inputs kernel) are enqueued before the next step's results
        # kernel, which is what overwrites it. (On the CPU each step has its own: the work is not queued.)
        self._packed: Optional[torch.Tensor] = None
        # Steps launched while a verify step was in flight (their inputs corrected on the device): the overlap.
        self.num_overlapped_steps = 0

    @staticmethod
    def new_rows_arrays(new_rows: list[tuple[int, list[int]]]) -> Optional[list[np.ndarray]]:
        """Host arrays (row of each token, its position, the token, [rows], [lengths]) that write new requests'
        known tokens (prompt, and outputs after a preemption) into their rows; None when there are none."""
        if not new_rows:
            return None
        lengths = np.fromiter((len(t) for _, t in new_rows), dtype=np.int64, count=len(new_rows))
        rows = np.fromiter((r for r, _ in new_rows), dtype=np.int64, count=len(new_rows))
        tok_rows = np.repeat(rows, lengths)
        positions = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        tokens = np.fromiter((t for _, ts in new_rows for t in ts), dtype=np.int64, count=int(lengths.sum()))
        return [tok_rows, positions, tokens, rows, lengths]

    def packed_buffer(self, n: int) -> torch.Tensor:
        """The first n entries of the CUDA steps' shared results buffer (see __init__)."""
        buf = self._packed
        if buf is None or buf.numel() < n:
            buf = self._packed = torch.empty(max(n, 2 * (0 if buf is None else buf.numel()), 256), dtype=torch.int64,
                                             device=self.hist.device)
        return buf[:n]

    def write_new_rows(self, tok_rows: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor,
                       rows: torch.Tensor, lengths: torch.Tensor) -> None:
        self.hist.index_put_((tok_rows, positions), tokens.to(self.hist.dtype))
        self.lens.index_copy_(0, rows, lengths)
        self.num_drafts.index_fill_(0, rows, 0)

    def append_and_propose(self, rows: torch.Tensor, tokens: torch.Tensor, slot_req: torch.Tensor,
                           slot_j: torch.Tensor, emitted: torch.Tensor, width: int, propose: bool = True
                           ) -> torch.Tensor:
        """A step's results for its sampling requests (rows [R]): `tokens` [T] the tokens of every verify row
        (request slot_req[t], row slot_j[t] of it), of which the first emitted[r] count. Appends them to the
        histories and proposes the next drafts; returns the number of drafts each row had before (the ones this
        step verified), for the acceptance statistics. width: an upper bound of the rows' lengths after this."""
        before = self.num_drafts.index_select(0, rows)
        lens = self.lens.index_select(0, rows)
        pos = (lens.index_select(0, slot_req) + slot_j).clamp(max=self.width - 1)
        self.hist.index_put_((rows.index_select(0, slot_req), pos), tokens.to(self.hist.dtype))
        lens = lens + emitted
        self.lens.index_copy_(0, rows, lens)
        if not propose:  # speculation is off at this batch size: the histories stay current, no drafts
            self.num_drafts.index_fill_(0, rows, 0)
            return before
        width = max(1, min(width, self.width))
        drafts, counts = propose_ngram(self.hist[:, :width].index_select(0, rows), lens, self.k, self.min_n,
                                       self.max_n)
        self.drafts.index_copy_(0, rows, drafts.to(torch.int64))
        self.num_drafts.index_copy_(0, rows, counts)
        return before


def _segments(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For consecutive segments of these lengths: each element's segment and its index within it (sizes read on
    the host: the torch reference path only)."""
    seg = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts)
    firsts = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    within = torch.arange(seg.shape[0], device=counts.device) - firsts
    return seg, within


def step_inputs_torch(items, src, num_drafts, rows, query_start_loc, prev_tokens, prev_rejected, drafts, input_ids,
                      positions, slot_mapping, seq_lens, block_table, block_size: int, group_slots=(),
                      group_tables=()) -> None:
    """kernels/spec_decode.spec_step_inputs in torch ops (the CPU path and the kernel's reference)."""
    qsl = query_start_loc.to(torch.int64)
    q0, q1 = qsl[items], qsl[items + 1]
    in_flight = src >= 0
    if bool(in_flight.any()):
        f_items, f_src, f_q0 = items[in_flight], src[in_flight], q0[in_flight]
        input_ids[f_q0] = prev_tokens[f_src].to(input_ids.dtype)
        if prev_rejected is not None:
            seg, within = _segments(q1[in_flight] - f_q0)
            tok = f_q0[seg] + within
            pos = positions[tok] - prev_rejected[f_src][seg]
            positions[tok] = pos
            block = torch.div(pos, block_size, rounding_mode="floor")
            for slots, table in zip((slot_mapping, *group_slots), (block_table, *group_tables)):
                slots[tok] = table[f_items[seg], block].to(torch.int64) * block_size + pos % block_size
            seq_lens[f_items] -= prev_rejected[f_src].to(seq_lens.dtype)
    verifying = num_drafts > 0
    if bool(verifying.any()):
        seg, within = _segments(num_drafts[verifying])
        input_ids[q0[verifying][seg] + 1 + within] = drafts[rows[verifying][seg], within]


def step_outputs_torch(ngram: DeviceNgram, rows, starts, counts, final, propose: bool, width: int,
                       draft_src=None, input_ids=None, accepted=None) -> torch.Tensor:
    """kernels/spec_decode.spec_step_outputs in torch ops (the CPU path and the kernel's reference)."""
    seg, within = _segments(counts)
    total = final.shape[0]
    if draft_src is not None:  # greedy: a row's draft (the next row's input) is accepted iff it is the row's token
        drafted = input_ids[draft_src.clamp(min=0)]
        accepted = (draft_src >= 0) & (drafted == final)
    if accepted is None:
        accepted = torch.zeros(total, dtype=torch.bool, device=final.device)
    stop = ~accepted.bool() | (within + 1 >= counts[seg])
    order = torch.arange(total, device=final.device)
    first = torch.full_like(starts, total).scatter_reduce(0, seg, torch.where(stop, order, total), "amin",
                                                          include_self=True)
    emitted = first - starts + 1
    last = final[first].to(torch.int64)
    before = ngram.append_and_propose(rows, final, seg, within, emitted, width, propose)
    return torch.stack([emitted, last, counts - emitted, before, ngram.num_drafts[rows]])


_CONSTS: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


def _consts(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(zeros, ones, arange) of n int64, made once per n and read-only (every step of a batch size stages them)."""
    got = _CONSTS.get(n)
    if got is None:
        got = (np.zeros(n, dtype=np.int64), np.ones(n, dtype=np.int64), np.arange(n, dtype=np.int64))
        for a in got:
            a.flags.writeable = False
        _CONSTS[n] = got
    return got


class DeviceStep:
    """One step's device-side speculation work for the runner (worker/model_runner.py), with DeviceNgram's state.

    Host arrays first (`arrays`: int64, staged with the step's other inputs in one copy), then on the device:
    before the forward, new requests' tokens into their rows, the in-flight step's tokens and the placeholder
    drafts into the input ids, and a verify step in flight's rejected drafts taken off its rows' positions, slots
    and sequence lengths; after sampling or verifying, the emitted counts, the tokens appended, the next drafts
    proposed. On CUDA two Triton launches do all but the new rows (kernels/spec_decode.py); elsewhere the same in
    torch ops (step_inputs_torch, step_outputs_torch: the kernels' reference).
    """

    def __init__(self, ngram: DeviceNgram, runner, plan, inp, fill_src: np.ndarray, verify_rows=None) -> None:
        from pagedllm.spec_decode.scheduling import PLACEHOLDER

        self.ngram = ngram
        self.kernels = runner.device.type == "cuda"
        self.propose = bool(plan.propose_drafts)
        arrays: list[np.ndarray] = []
        self._slices: dict[str, tuple[int, int]] = {}

        def add(name: str, group: Optional[list[np.ndarray]]) -> None:
            if group:
                self._slices[name] = (len(arrays), len(arrays) + len(group))
                arrays.extend(group)  # (int64 or cast by the stager's copy into its int64 buffer)

        if plan.new_requests:
            batch = runner.input_batch
            add("new", DeviceNgram.new_rows_arrays([(batch.requests[n.request_id].row, n.token_ids)
                                                     for n in plan.new_requests]))
        num_reqs = len(inp.req_ids)
        # (This runs on every step of a speculating engine: few numpy calls, each costs the host ~1-3 us.)
        num_drafts = None  # placeholder drafts per request of the step, where any
        spec = inp.spec_token_ids
        if spec:
            counts = [len(d) if d and d[0] == PLACEHOLDER else 0 for d in map(spec.get, inp.req_ids)]
            if any(counts):
                num_drafts = np.array(counts, dtype=np.int64)
        in_flight_rows = inp.in_flight_rows  # (ascending: np.nonzero)
        if num_drafts is None:  # the requests in flight, each computing its one token
            items, item_src, item_drafts = in_flight_rows, fill_src, _consts(len(in_flight_rows))[0]
            checked = inp.max_query_len == 1
        elif len(in_flight_rows) == num_reqs:  # every request in flight (and some verifying)
            items, item_src, item_drafts, checked = _consts(num_reqs)[2], fill_src, num_drafts, False
        else:
            src = np.full(num_reqs, -1, dtype=np.int64)  # index into the previous launch's per-request arrays
            src[in_flight_rows] = fill_src
            items = np.flatnonzero((src >= 0) | (num_drafts > 0))
            item_src, item_drafts, checked = src[items], num_drafts[items], False
        if len(items):
            qsl = inp.query_start_loc
            if not checked and int((qsl[items + 1] - qsl[items] - item_drafts).max()) != 1:
                raise RuntimeError("A request in flight or verifying drafts must compute one token and its drafts "
                                   "only; this is a bug.")
            add("items", [items, item_src, item_drafts, inp.rows if len(items) == num_reqs else inp.rows[items]])
        self.rejects = runner._prev_rej is not None and len(in_flight_rows) > 0
        sample_rows = inp.sample_rows
        self.verify = verify_rows is not None
        if len(sample_rows):
            sample_batch_rows = inp.rows if len(sample_rows) == num_reqs else inp.rows[sample_rows]
            if verify_rows is not None:
                starts, counts = verify_rows.starts, verify_rows.counts
                # The draft each verify row checks is the next token's input (none on a request's bonus row).
                draft_src = verify_rows.token_rows + 1
                draft_src[starts + counts - 1] = -1
                add("post", [sample_batch_rows, starts, counts, draft_src, verify_rows.token_rows])
            else:
                _, ones, arange = _consts(len(sample_rows))
                add("post", [sample_batch_rows, arange, ones])
        # An upper bound of the sampling rows' lengths after this step (the host's positions are upper bounds).
        self.width = inp.max_seq_len + 1
        self.arrays = arrays
        self.staged: list[torch.Tensor] = []
        # after_step's results in one int64 buffer (one host copy): (buffer, where the stats rows start, their
        # length); with keep_final the tokens of `final` first.
        self.packed: Optional[tuple[torch.Tensor, int, int]] = None

    def _get(self, name: str) -> Optional[list[torch.Tensor]]:
        span = self._slices.get(name)
        return None if span is None else self.staged[span[0]:span[1]]

    def before_forward(self, runner, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                       seq_lens: torch.Tensor, block_table: torch.Tensor, query_start_loc: torch.Tensor,
                       group_slots=(), group_tables=()) -> bool:
        """Device inputs of the step made right (the in-flight tokens included; with several KV-cache groups,
        every group's slot mapping); True when sequence lengths changed (the host's are then upper bounds)."""
        ngram = self.ngram
        new = self._get("new")
        if new is not None:
            ngram.write_new_rows(*new)
        items = self._get("items")
        if items is None:
            return False
        ngram.num_overlapped_steps += int(self.rejects)
        args = (*items, query_start_loc, runner._prev_sampled, runner._prev_rej if self.rejects else None,
                ngram.drafts, input_ids, positions, slot_mapping, seq_lens, block_table, runner.block_size,
                group_slots, group_tables)
        if self.kernels:
            from pagedllm.kernels.spec_decode import spec_step_inputs

            spec_step_inputs(*args)
        else:
            step_inputs_torch(*args)
        return self.rejects

    def token_rows(self) -> torch.Tensor:
        """[verify rows] each verify row's index among the step's tokens."""
        return self._get("post")[4]

    def draft_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[verify rows] the draft each row checks (NO_DRAFT on bonus rows), read from the step's inputs."""
        from pagedllm.spec_decode.rejection_sampler import NO_DRAFT

        draft_src = self._get("post")[3]
        got = input_ids.index_select(0, draft_src.clamp(min=0))
        return torch.where(draft_src >= 0, got, torch.full_like(got, NO_DRAFT))

    def after_step(self, final: torch.Tensor, input_ids: Optional[torch.Tensor] = None,
                   accepted: Optional[torch.Tensor] = None, keep_final: bool = False) -> torch.Tensor:
        """A step's results: `final` [verify rows] (a plain step: [sampling requests]), each verify row's draft
        accepted as `accepted` says or, given `input_ids`, iff it equals the row's token (greedy). Returns int64
        [5, sampling requests]: emitted count, last emitted token, rejected drafts, drafts verified (as proposed),
        drafts proposed now; the histories and proposals are updated. The stats live in `self.packed`'s buffer,
        after a copy of `final` with keep_final (rows of even lengths: 16-byte aligned, see spec_step_outputs)."""
        post = self._get("post")
        rows, starts, counts = post[:3]
        ngram = self.ngram
        greedy = self.verify and accepted is None
        kw = dict(draft_src=post[3] if greedy else None, input_ids=input_ids if greedy else None,
                  accepted=accepted if self.verify and not greedy else None)
        num_reqs, num_final = rows.shape[0], final.shape[0] if keep_final else 0
        stats_at, row_len = num_final + num_final % 2, num_reqs + num_reqs % 2
        flat = ngram.packed_buffer(stats_at + 5 * row_len) if final.is_cuda else torch.empty(
            stats_at + 5 * row_len, dtype=torch.int64, device=final.device)
        out = flat[stats_at:].view(5, row_len)[:, :num_reqs]
        self.packed = (flat, stats_at, row_len)
        if self.kernels:
            from pagedllm.kernels.spec_decode import spec_step_outputs

            return spec_step_outputs(rows, starts, counts, final, ngram.hist, ngram.lens, ngram.drafts,
                                     ngram.num_drafts, ngram.min_n, ngram.max_n, self.propose, out=out,
                                     final_out=flat[:num_final] if keep_final else None, **kw)
        out.copy_(step_outputs_torch(ngram, rows, starts, counts, final, self.propose, self.width, **kw))
        if keep_final:
            flat[:num_final].copy_(final)
        return out
