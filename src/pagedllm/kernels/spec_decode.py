"""Overlapped speculation's per-step device work in two launches (spec_decode/device_ngram.py has the torch
reference these are tested against, and the CPU path).

The host of a GPU machine pays ~10 us per eager launch; the torch form of this work is ~100 small ops a step,
which would make the host, not the device, the bound of a speculating step. So on CUDA:

  * `spec_step_inputs` (before the forward), one program per request of the step that is in flight or verifies
    placeholder drafts: its first input is the in-flight step's last emitted token; with a verify step in flight
    its rejected count comes off its positions, slot mapping and sequence length; its drafts are filled in;
  * `spec_step_outputs` (after sampling / verifying), one program per sampling request: how many of its rows are
    emitted (leading accepted drafts + 1), its last emitted token and rejected count, its tokens appended to its
    row's history, then the next proposal: the latest earlier occurrence of the longest suffix n-gram.
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from pagedllm.kernels.triton_launch import direct

_SCAN = 256  # history positions compared per iteration of a proposal's scan


@triton.jit(do_not_specialize=["bt_stride"])  # (changes from step to step: no recompiles mid-run)
def _spec_inputs_kernel(items_ptr, src_ptr, nd_ptr, rows_ptr, qsl_ptr, prev_tok_ptr, prev_rej_ptr, drafts_ptr,
                        input_ids_ptr, positions_ptr, slot_ptr, seq_lens_ptr, block_table_ptr, bt_stride,
                        block_size, K: tl.constexpr, HAS_REJ: tl.constexpr, SLOTS_ONLY: tl.constexpr,
                        BLOCK: tl.constexpr):
    # SLOTS_ONLY: another KV-cache group's slot mapping, from the positions a first launch corrected.
    pid = tl.program_id(0)
    i = tl.load(items_ptr + pid)
    q0 = tl.load(qsl_ptr + i).to(tl.int64)
    q1 = tl.load(qsl_ptr + i + 1).to(tl.int64)
    src = tl.load(src_ptr + pid)
    nd = tl.load(nd_ptr + pid)
    row = tl.load(rows_ptr + pid)
    offs = tl.arange(0, BLOCK)
    if src >= 0:
        if not SLOTS_ONLY:
            tl.store(input_ids_ptr + q0, tl.load(prev_tok_ptr + src))
        if HAS_REJ:
            t = q0 + offs
            m = t < q1
            pos = tl.load(positions_ptr + t, mask=m, other=0)
            if not SLOTS_ONLY:
                rej = tl.load(prev_rej_ptr + src)
                pos = pos - rej
                tl.store(positions_ptr + t, pos, mask=m)
                tl.store(seq_lens_ptr + i, tl.load(seq_lens_ptr + i) - rej.to(tl.int32))
            blk = tl.load(block_table_ptr + i * bt_stride + pos // block_size, mask=m, other=0).to(tl.int64)
            tl.store(slot_ptr + t, blk * block_size + pos % block_size, mask=m)
    if not SLOTS_ONLY:
        dm = offs < nd
        drafts = tl.load(drafts_ptr + row * K + offs, mask=dm, other=0)
        tl.store(input_ids_ptr + q0 + 1 + offs, drafts, mask=dm)


@triton.jit(do_not_specialize=["out_stride"])  # (the batch size, rounded up to even)
def _spec_outputs_kernel(rows_ptr, starts_ptr, counts_ptr, final_ptr, draft_src_ptr, input_ids_ptr, accepted_ptr,
                         hist_ptr, hist_stride, width, lens_ptr, drafts_ptr, nd_ptr, out_ptr, out_stride,
                         final_out_ptr, K: tl.constexpr, MIN_N: tl.constexpr, MAX_N: tl.constexpr,
                         ACC_MODE: tl.constexpr, PROPOSE: tl.constexpr, BLOCK_K: tl.constexpr, SCAN: tl.constexpr,
                         FINAL_OUT: tl.constexpr, NUM_N: tl.constexpr):
    r = tl.program_id(0)
    row = tl.load(rows_ptr + r)
    start = tl.load(starts_ptr + r)
    cnt = tl.load(counts_ptr + r)
    offs = tl.arange(0, BLOCK_K)
    valid = offs < cnt
    toks = tl.load(final_ptr + start + offs, mask=valid, other=0).to(tl.int64)
    if FINAL_OUT:  # the rows' tokens beside the stats, for one host copy of both
        tl.store(final_out_ptr + start + offs, toks, mask=valid)
    if ACC_MODE == 0:  # greedy: a row's draft (the next row's input) is accepted iff it is the row's token
        src = tl.load(draft_src_ptr + start + offs, mask=valid, other=-1)
        drafted = tl.load(input_ids_ptr + tl.maximum(src, 0), mask=valid & (src >= 0), other=-1)
        acc = (src >= 0) & (drafted == toks)
    elif ACC_MODE == 1:  # the rejection sampler's verdicts
        acc = tl.load(accepted_ptr + start + offs, mask=valid, other=0) != 0
    else:  # a plain step: one row, nothing drafted
        acc = offs < 0
    acc = acc & (offs < cnt - 1)
    first = tl.min(tl.where(valid & (~acc), offs, BLOCK_K), axis=0)  # the bonus row at the latest
    emitted = first + 1
    last = tl.load(final_ptr + start + first).to(tl.int64)
    base = hist_ptr + row * hist_stride
    len0 = tl.load(lens_ptr + row)
    tl.store(base + tl.minimum(len0 + offs, width - 1), toks.to(tl.int32), mask=valid)
    new_len = len0 + emitted
    tl.store(lens_ptr + row, new_len)
    tl.store(out_ptr + r, emitted)
    tl.store(out_ptr + out_stride + r, last)
    tl.store(out_ptr + 2 * out_stride + r, cnt - emitted)
    tl.store(out_ptr + 3 * out_stride + r, tl.load(nd_ptr + row))
    if PROPOSE and MIN_N <= MAX_N:
        tl.debug_barrier()  # the tokens just stored are the suffix the lookup reads
        dstart, count = _latest_match(base, new_len, K, MIN_N, MAX_N, NUM_N, SCAN)
        km = offs < K
        drafts = tl.load(base + tl.minimum(dstart + offs, width - 1), mask=km, other=0).to(tl.int64)
        tl.store(drafts_ptr + row * K + offs, drafts, mask=km)
    else:
        count = new_len * 0
    tl.store(nd_ptr + row, count)
    tl.store(out_ptr + 4 * out_stride + r, count)


@triton.jit
def _latest_match(base, new_len, K: tl.constexpr, MIN_N: tl.constexpr, MAX_N: tl.constexpr, NUM_N: tl.constexpr,
                  SCAN: tl.constexpr):
    """The proposal's (draft start, draft count) from one backward pass over the history (not one pass per n-gram
    length: a step with no long match would scan it MAX_N - MIN_N + 1 times). For each candidate match end e (the
    draft starts at e + 1; e <= new_len - 2 so that a token follows the match) it counts how many of the suffix's
    last tokens match backwards from e (at most MAX_N), and keeps, per n, the latest e matching n tokens; the
    longest n that matched wins, then its latest match (as propose_ngram). Chunks are scanned from the end and the
    scan stops at the first chunk with a full MAX_N match (the latest one)."""
    lanes = tl.arange(0, SCAN)
    ns = MIN_N + tl.arange(0, NUM_N)  # (NUM_N: MAX_N - MIN_N + 1 rounded up to a power of two)
    n_ok = ns <= MAX_N
    bests = tl.full([NUM_N], -1, tl.int32)
    hi = new_len - 2  # the last candidate end
    e0 = (hi - SCAN + 1).to(tl.int32)
    while (e0 + SCAN > MIN_N - 1) & (tl.max(tl.where(ns == MAX_N, bests, -1), axis=0) < 0):
        e = e0 + lanes
        alive = (e >= MIN_N - 1) & (e <= hi)
        run = tl.zeros([SCAN], tl.int32)
        for j in tl.static_range(MAX_N):
            at = new_len - 1 - j
            want = tl.where(at >= 0, tl.load(base + tl.maximum(at, 0)), -2)  # (token ids are >= 0)
            got = tl.load(base + e - j, mask=alive & (e - j >= 0), other=-1)
            alive = alive & (got == want)
            run += alive.to(tl.int32)
        latest = tl.max(tl.where(run[None, :] >= ns[:, None], e[None, :], -1), axis=1)  # [NUM_N], per n
        bests = tl.maximum(bests, latest)
        e0 -= SCAN
    found_n = tl.max(tl.where(n_ok & (bests >= 0), ns, 0), axis=0)
    dstart = tl.sum(tl.where(ns == found_n, bests, 0), axis=0) + 1
    count = tl.where(found_n > 0, tl.minimum(new_len - dstart, K), 0)
    return tl.where(found_n > 0, dstart, 0), count


# Both run eagerly on every step of a speculating engine: launched directly.
_spec_inputs, _spec_outputs = direct(_spec_inputs_kernel), direct(_spec_outputs_kernel)


def spec_step_inputs(items: torch.Tensor, src: torch.Tensor, num_drafts: torch.Tensor, rows: torch.Tensor,
                     query_start_loc: torch.Tensor, prev_tokens: torch.Tensor, prev_rejected, drafts: torch.Tensor,
                     input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                     seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int,
                     group_slots: Sequence[torch.Tensor] = (), group_tables: Sequence[torch.Tensor] = ()) -> None:
    """In place on the step's inputs, for each listed request (items: its index in the step; src: its index in
    the previous launch's per-request arrays, -1 if not in flight; num_drafts: placeholder drafts it verifies;
    rows: its InputBatch row). A request's tokens here are at most k + 1 (its token and its drafts). Several
    KV-cache groups: groups 1..'s slot mappings follow the corrected positions (one more launch each)."""
    k = drafts.shape[1]
    # (no request in flight: the previous launch may have sampled nothing; its arrays are then never read)
    common = (items, src, num_drafts, rows, query_start_loc, prev_tokens if prev_tokens is not None else items,
              prev_rejected if prev_rejected is not None else items, drafts, input_ids, positions)
    meta = dict(K=k, HAS_REJ=prev_rejected is not None, BLOCK=triton.next_power_of_2(k + 1))
    _spec_inputs[(items.shape[0],)](*common, slot_mapping, seq_lens, block_table, block_table.stride(0),
                                    block_size, SLOTS_ONLY=False, **meta)
    if prev_rejected is not None:
        for slots, table in zip(group_slots, group_tables):
            _spec_inputs[(items.shape[0],)](*common, slots, seq_lens, table, table.stride(0), block_size,
                                            SLOTS_ONLY=True, **meta)


def spec_step_outputs(rows: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, final: torch.Tensor,
                      hist: torch.Tensor, lens: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor,
                      min_n: int, max_n: int, propose: bool, draft_src=None, input_ids=None, accepted=None,
                      out=None, final_out=None) -> torch.Tensor:
    """For each sampling request (rows, and its verify rows starts[r] .. + counts[r] of `final`): returns int64
    [5, R]: emitted count, last emitted token, rejected drafts, drafts it had (verified now), drafts proposed now;
    appends the emitted tokens to `hist` / `lens` and writes the proposal to `drafts` / `num_drafts` (as
    DeviceNgram.append_and_propose). Acceptance: from `draft_src` + `input_ids` (greedy), else `accepted`, else
    none (every count 1). out: where to write those [5, R] (rows 16-byte aligned); final_out: also a copy of
    `final` as int64 there (the caller's packed results: spec_decode/device_ngram.DeviceStep)."""
    num_reqs, k = rows.shape[0], drafts.shape[1]
    if out is None:
        # Rows of an even length: each row 16-byte aligned, as Triton specializes pointers (the next step's kernel
        # reads rows 1 and 2), so no batch size compiles another variant mid-run.
        out = torch.empty((5, num_reqs + num_reqs % 2), dtype=torch.int64, device=rows.device)[:, :num_reqs]
    mode = 0 if draft_src is not None else (1 if accepted is not None else 2)
    if accepted is not None and accepted.dtype == torch.bool:
        accepted = accepted.view(torch.int8)
    dummy = rows
    max_n = min(max_n, hist.shape[1] - 1)  # (longer n-grams cannot match: as propose_ngram's `width <= n`)
    if min_n > max_n:
        min_n, max_n = 1, 0  # no n to try: nothing is proposed
    _spec_outputs[(num_reqs,)](
        rows, starts, counts, final, draft_src if draft_src is not None else dummy,
        input_ids if input_ids is not None else dummy, accepted if accepted is not None else dummy,
        hist, hist.stride(0), hist.shape[1], lens, drafts, num_drafts, out, out.stride(0),
        final_out if final_out is not None else dummy, K=k, MIN_N=min_n, MAX_N=max_n, ACC_MODE=mode,
        PROPOSE=propose, BLOCK_K=triton.next_power_of_2(k + 1), SCAN=_SCAN, FINAL_OUT=final_out is not None,
        NUM_N=triton.next_power_of_2(max(1, max_n - min_n + 1)))
    return out


def warm_up(k: int, min_n: int, max_n: int, width: int, block_size: int, device) -> None:
    """Compile the variants a run uses (greedy / sampled / plain steps, proposing or not, with a verify step in
    flight or not) at start-up, on scratch state, not in the middle of serving."""
    z = lambda *shape: torch.zeros(shape, dtype=torch.int64, device=device)  # noqa: E731
    one = torch.ones(1, dtype=torch.int64, device=device)
    hist = torch.zeros((1, width), dtype=torch.int32, device=device)
    for mode in ("greedy", "sampled", "plain"):
        for propose in (True, False):
            kw = {"greedy": dict(draft_src=z(1), input_ids=z(1)), "sampled": dict(accepted=z(1).bool()),
                  "plain": {}}[mode]
            # (verify steps pack their rows' tokens with the stats: DeviceStep.after_step)
            kw["final_out"] = None if mode == "plain" else z(2)
            spec_step_outputs(z(1), z(1), one, z(1), hist, z(1), z(1, k), z(1), min_n, max_n, propose, **kw)
    qsl = torch.tensor([0, 2], dtype=torch.int32, device=device)
    seq_lens = torch.ones(1, dtype=torch.int32, device=device)
    block_table = torch.zeros((1, 1), dtype=torch.int32, device=device)
    for rejected in (z(1), None):
        spec_step_inputs(z(1), z(1), one, z(1), qsl, z(1), rejected, z(1, k), z(k + 2), z(k + 2), z(k + 2), seq_lens,
                         block_table, block_size)
