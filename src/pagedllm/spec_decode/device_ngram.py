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


class DeviceStep:
    """One step's device-side speculation work for the runner (worker/model_runner.py), with DeviceNgram's state.

    Host arrays first (`arrays`: int64, staged with the step's other inputs in one copy), then on the device:
    before the forward, new requests' tokens into their rows, the placeholder drafts into the input ids, and the
    step in flight's rejected drafts taken off its rows' positions, slots and sequence lengths; after sampling
    or verifying, the emitted tokens appended and the next drafts proposed.
    """

    def __init__(self, ngram: DeviceNgram, runner, plan, inp, fill_src: np.ndarray,
                 verify_rows=None) -> None:
        from pagedllm.spec_decode.scheduling import PLACEHOLDER

        self.ngram = ngram
        self.propose = bool(plan.propose_drafts)
        self.overlap = bool(plan.spec_overlap)
        arrays: list[np.ndarray] = []
        self._slices: dict[str, tuple[int, int]] = {}

        def add(name: str, group: Optional[list[np.ndarray]]) -> None:
            if group:
                self._slices[name] = (len(arrays), len(arrays) + len(group))
                arrays.extend(group)

        batch = runner.input_batch
        add("new", DeviceNgram.new_rows_arrays([(batch.requests[n.request_id].row, n.token_ids)
                                                 for n in plan.new_requests]))
        qsl = inp.query_start_loc.astype(np.int64)
        k = ngram.k
        spec = inp.spec_token_ids or {}
        dst: list[int] = []
        src: list[int] = []
        if spec:
            index = {r: i for i, r in enumerate(inp.req_ids)}
            for req_id, drafts in spec.items():
                if not drafts or drafts[0] != PLACEHOLDER:
                    continue
                i = index[req_id]
                first, d = int(qsl[i]), len(drafts)
                if int(qsl[i + 1]) - first != d + 1:
                    raise RuntimeError("A verify step's request must compute its last token and its drafts only; "
                                       "this is a bug.")
                row = int(inp.rows[i])
                dst.extend(range(first + 1, first + 1 + d))
                src.extend(range(row * k, row * k + d))
        add("drafts", [np.array(dst, dtype=np.int64), np.array(src, dtype=np.int64)] if dst else None)
        # The step in flight was a verify step: its rows' tokens here sit at "every draft accepted" positions.
        in_flight = inp.in_flight_rows
        self.corrects = runner._prev_rej is not None and len(in_flight) > 0
        if self.corrects:
            n_tok = qsl[in_flight + 1] - qsl[in_flight]
            offsets = np.arange(int(n_tok.sum()), dtype=np.int64) - np.repeat(np.cumsum(n_tok) - n_tok, n_tok)
            add("fix", [np.repeat(qsl[in_flight], n_tok) + offsets, np.repeat(fill_src, n_tok),
                        np.repeat(in_flight.astype(np.int64), n_tok), in_flight.astype(np.int64), fill_src])
        sample_rows = inp.sample_rows
        self.num_sampling = len(sample_rows)
        if self.num_sampling:
            if verify_rows is not None:
                starts, counts = verify_rows.starts, verify_rows.counts
                slot_req = np.repeat(np.arange(self.num_sampling, dtype=np.int64), counts)
                slot_j = np.arange(len(slot_req), dtype=np.int64) - np.repeat(starts, counts)
                # The draft each verify row checks is the next token's input (none on a request's bonus row).
                draft_src = np.where(slot_j + 1 < np.repeat(counts, counts), verify_rows.token_rows + 1, -1)
                add("post", [inp.rows[sample_rows].astype(np.int64), slot_req, slot_j, starts, counts, draft_src,
                             verify_rows.token_rows])
            else:
                zeros = np.zeros(self.num_sampling, dtype=np.int64)
                add("post", [inp.rows[sample_rows].astype(np.int64), np.arange(self.num_sampling, dtype=np.int64),
                             zeros])
        # An upper bound of the sampling rows' lengths after this step (the host's positions are upper bounds).
        self.width = int(inp.seq_lens.max()) + 1
        self.arrays = arrays
        self.staged: list[torch.Tensor] = []

    def _get(self, name: str) -> Optional[list[torch.Tensor]]:
        span = self._slices.get(name)
        return None if span is None else self.staged[span[0]:span[1]]

    def before_forward(self, runner, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                       seq_lens: torch.Tensor, block_table: torch.Tensor) -> bool:
        """Device inputs of the step made right; True when sequence lengths changed (the host's are bounds)."""
        new = self._get("new")
        if new is not None:
            self.ngram.write_new_rows(*new)
        drafts = self._get("drafts")
        if drafts is not None:
            dst, src = drafts
            input_ids.index_copy_(0, dst, self.ngram.drafts.view(-1).index_select(0, src))
        fix = self._get("fix")
        if fix is None:
            return False
        tok, tok_src, tok_req, reqs, req_src = fix
        self.ngram.num_overlapped_steps += 1
        rej = runner._prev_rej
        pos = positions.index_select(0, tok) - rej.index_select(0, tok_src)
        positions.index_copy_(0, tok, pos)
        bs = runner.block_size
        slots = block_table[tok_req, torch.div(pos, bs, rounding_mode="floor")].to(torch.int64) * bs + pos % bs
        slot_mapping.index_copy_(0, tok, slots)
        seq_lens.index_copy_(0, reqs, seq_lens.index_select(0, reqs) - rej.index_select(0, req_src).to(seq_lens.dtype))
        return True

    def after_sampling(self, sampled: torch.Tensor) -> torch.Tensor:
        """A plain step's sampled ids [R]: appended, next drafts proposed. Returns the rows' draft counts now."""
        rows, slot_req, slot_j = self._get("post")
        ones = torch.ones_like(rows)
        self.ngram.append_and_propose(rows, sampled, slot_req, slot_j, ones, self.width, self.propose)
        return self.ngram.num_drafts.index_select(0, rows)

    def token_rows(self) -> torch.Tensor:
        """[verify rows] each verify row's index among the step's tokens."""
        return self._get("post")[6]

    def draft_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[verify rows] the draft each row checks (NO_DRAFT on bonus rows), read from the step's inputs."""
        from pagedllm.spec_decode.rejection_sampler import NO_DRAFT

        draft_src = self._get("post")[5]
        got = input_ids.index_select(0, draft_src.clamp(min=0))
        return torch.where(draft_src >= 0, got, torch.full_like(got, NO_DRAFT))

    def after_verify(self, final: torch.Tensor, accepted: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A verify step's final ids and acceptances per verify row: (emitted count per request, last emitted
        token, rejected drafts, [drafts verified (as proposed), drafts proposed now] per request)."""
        rows, slot_req, slot_j, starts, counts, draft_src, _ = self._get("post")
        total = final.shape[0]
        order = torch.arange(total, device=final.device)
        stop = ~accepted.bool() | (draft_src < 0)
        first = torch.full_like(starts, total).scatter_reduce(0, slot_req, torch.where(stop, order, total), "amin",
                                                              include_self=True)
        emitted = first - starts + 1
        last = final.index_select(0, first).to(torch.int64)
        before = self.ngram.append_and_propose(rows, final, slot_req, slot_j, emitted, self.width, self.propose)
        return emitted, last, counts - emitted, torch.stack([before, self.ngram.num_drafts.index_select(0, rows)])
