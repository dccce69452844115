"""Run under TRITON_INTERPRET=1 (tests/unit/test_spec_decode_units.py starts it): the overlapped-speculation kernels
(kernels/spec_decode.py) against their torch reference (spec_decode/device_ngram.py), on random steps.

spec_step_outputs: greedy verify steps (acceptance from the inputs), sampled ones (the sampler's verdicts) and plain
steps, with and without proposing, over histories where
n-grams repeat (tiny vocabularies; and histories of hundreds of tokens, several scan chunks), two copies of the
DeviceNgram state kept side by side: every output and every state tensor equal after every step; every other step
writes into a caller's packed buffer (the stats after a copy of the rows' tokens, as DeviceStep.after_step does).
spec_step_inputs: random steps with requests in flight (with and without a rejected count) and verifying
placeholder drafts: input ids, positions, slot mapping and sequence lengths equal.
"""
from __future__ import annotations

import copy

import numpy as np
import torch

from pagedllm.kernels.spec_decode import spec_step_inputs, spec_step_outputs
from pagedllm.spec_decode.device_ngram import DeviceNgram, step_inputs_torch, step_outputs_torch


def check_outputs(seed: int, long: bool = False) -> None:
    """long: prompts of hundreds of tokens over a larger vocabulary (the scan's several chunks, matches far back or
    none)."""
    rng = np.random.default_rng(seed)
    k, lo = int(rng.integers(1, 6)), int(rng.integers(1, 3))
    hi = lo + int(rng.integers(0, 3))
    vocab, width, max_reqs = int(rng.integers(2, 6)), 300, 6
    if long:
        vocab, width = int(rng.integers(8, 40)), 1200
    ref = DeviceNgram(max_reqs, width, k, lo, hi, torch.device("cpu"))
    rows = rng.choice(max_reqs, size=int(rng.integers(1, 5)), replace=False)
    prompts = []
    for r in rows:
        tokens = rng.integers(0, vocab, int(rng.integers(200, 1000) if long else rng.integers(1, 12))).tolist()
        if long and rng.random() < 0.5:  # an earlier stretch repeated at the end: long matches far back
            at = int(rng.integers(0, len(tokens) - 20))
            tokens += tokens[at:at + int(rng.integers(4, 20))]
        prompts.append((int(r), tokens))
    ref.write_new_rows(*(torch.from_numpy(a) for a in DeviceNgram.new_rows_arrays(prompts)))
    got = copy.deepcopy(ref)
    rows_t = torch.from_numpy(rows.astype(np.int64))
    for step in range(12):
        mode = rng.choice(["greedy", "sampled", "plain"])
        propose = bool(rng.random() < 0.8)
        n = len(rows)
        counts = np.ones(n, dtype=np.int64) if mode == "plain" else rng.integers(1, k + 2, size=n)
        starts = np.cumsum(counts) - counts
        total = int(counts.sum())
        final = rng.integers(0, vocab, total)
        kw = {}
        if mode == "greedy":
            # the step's inputs: each request's token then its drafts; draft_src points a row at the next input
            input_ids = rng.integers(0, vocab, total + 3)
            within = np.arange(total) - np.repeat(starts, counts)
            token_rows = np.arange(total) + 3  # (the verify rows need not start at token 0)
            draft_src = np.where(within + 1 < np.repeat(counts, counts), token_rows + 1, -1)
            # accept some drafts: make a row's token equal its draft
            same = rng.random(total) < 0.6
            final = np.where(same & (draft_src >= 0), input_ids[np.clip(draft_src, 0, None)], final)
            kw = dict(draft_src=torch.from_numpy(draft_src), input_ids=torch.from_numpy(input_ids))
        elif mode == "sampled":
            kw = dict(accepted=torch.from_numpy(rng.random(total) < 0.7))
        args = (rows_t, torch.from_numpy(starts), torch.from_numpy(counts), torch.from_numpy(final))
        want = step_outputs_torch(ref, *args, propose, width, **kw)
        packed = step % 2 == 1  # (as DeviceStep.after_step: the stats after a copy of `final`, one buffer)
        if packed:
            at, row_len = total + total % 2, n + n % 2
            flat = torch.full((at + 5 * row_len,), -7, dtype=torch.int64)
            kw.update(out=flat[at:].view(5, row_len)[:, :n], final_out=flat[:total])
        have = spec_step_outputs(*args, got.hist, got.lens, got.drafts, got.num_drafts, got.min_n, got.max_n,
                                 propose, **kw)
        where = (f"seed {seed} step {step} ({mode}, k={k}, n={lo}..{hi}, propose={propose}, packed={packed}, "
                 f"long={long})")
        assert torch.equal(have, want), (where, have, want)
        if packed:
            assert have.data_ptr() == kw["out"].data_ptr(), where
            assert torch.equal(flat[:total], torch.from_numpy(final)), where
        assert torch.equal(got.lens, ref.lens), where
        for r in rows:
            n_tok = int(ref.lens[r])
            assert torch.equal(got.hist[r, :n_tok], ref.hist[r, :n_tok]), where
        assert torch.equal(got.num_drafts, ref.num_drafts), where
        assert torch.equal(got.drafts[rows_t], ref.drafts[rows_t]), where


def check_inputs(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    k, bs, num_reqs = int(rng.integers(1, 6)), 4, int(rng.integers(1, 7))
    q_lens = rng.integers(1, k + 2, size=num_reqs)
    kinds = rng.choice(["in_flight", "drafts", "both", "prefill"], size=num_reqs)
    if seed < 2:
        kinds[:] = "drafts"  # nothing in flight (seed 1: and the previous launch sampled nothing)
    q_lens = np.where(kinds == "prefill", rng.integers(1, 9, size=num_reqs), q_lens)
    num_drafts = np.where((kinds == "drafts") | (kinds == "both"), q_lens - 1, 0)
    q_lens = np.where(kinds == "in_flight", 1 + num_drafts, q_lens)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    total = int(qsl[-1])
    max_blocks = 16
    positions = np.concatenate([np.arange(q) + rng.integers(8, 40) for q in q_lens])
    block_table = rng.integers(0, 100, size=(num_reqs, max_blocks)).astype(np.int32)
    slots = np.concatenate([block_table[i, p // bs].astype(np.int64) * bs + p % bs
                            for i, p in enumerate(np.split(positions, qsl[1:-1]))])
    seq_lens = np.array([positions[qsl[i + 1] - 1] + 1 for i in range(num_reqs)], dtype=np.int32)
    src = np.where((kinds == "in_flight") | (kinds == "both"), rng.permutation(num_reqs), -1)
    items = np.flatnonzero((src >= 0) | (num_drafts > 0))
    rows = rng.permutation(8)[:num_reqs]
    prev_tokens = torch.from_numpy(rng.integers(0, 1000, num_reqs))
    drafts = torch.from_numpy(rng.integers(0, 1000, size=(8, k)))
    if not (src >= 0).any() and seed % 2:  # nothing in flight: the previous launch may have sampled nothing
        prev_tokens = None
    # groups 1..: other block tables, their slot mappings (0 to 2 more groups)
    group_tables = [torch.from_numpy(rng.integers(0, 100, size=(num_reqs, max_blocks)).astype(np.int32))
                    for _ in range(seed % 3)]
    for with_rej in (False, True):
        prev_rej = torch.from_numpy(rng.integers(0, 8, num_reqs)) if with_rej and prev_tokens is not None else None
        tensors = [torch.from_numpy(rng.integers(0, 1000, total)), torch.from_numpy(positions.copy()),
                   torch.from_numpy(slots.copy()), torch.from_numpy(seq_lens.copy())]
        group_slots = [torch.from_numpy(rng.integers(0, 400, total)) for _ in group_tables]
        ref, ref_groups = [t.clone() for t in tensors], [t.clone() for t in group_slots]
        common = (torch.from_numpy(items.astype(np.int64)), torch.from_numpy(src[items].astype(np.int64)),
                  torch.from_numpy(num_drafts[items].astype(np.int64)), torch.from_numpy(rows[items].astype(np.int64)),
                  torch.from_numpy(qsl), prev_tokens, prev_rej, drafts)
        if len(items) == 0:
            continue
        step_inputs_torch(*common, *ref, torch.from_numpy(block_table), bs, ref_groups, group_tables)
        spec_step_inputs(*common, *tensors, torch.from_numpy(block_table), bs, group_slots, group_tables)
        names = ["input_ids", "positions", "slot_mapping", "seq_lens"] + [f"group {g + 1} slots" for g in
                                                                          range(len(group_tables))]
        for name, a, b in zip(names, tensors + group_slots, ref + ref_groups):
            assert torch.equal(a, b), (seed, with_rej, name, a, b)


def main() -> None:
    from pagedllm.kernels.spec_decode import warm_up

    warm_up(4, 2, 4, 64, 16, torch.device("cpu"))  # (every variant it compiles runs)
    for seed in range(16):
        check_outputs(seed)
    for seed in range(6):
        check_outputs(100 + seed, long=True)
    for seed in range(20):
        check_inputs(seed)
    print("spec kernels ok")


if __name__ == "__main__":
    main()
