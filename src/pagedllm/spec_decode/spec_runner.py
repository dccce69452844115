"""SpecDecodeRunner: the model runner's speculative-decoding side (proposing drafts, verifying them).

The runner calls
  * verify(...) for a step whose plan scheduled drafts: rows of every position that samples go through the
    rejection sampler in one pass; the step's host sync returns the accepted tokens per request;
  * propose(...) after a step's tokens are appended (when the plan says speculation is on): the proposer's
    drafts for the next step go back to the scheduler in ModelOutput.spec_token_ids;
  * drop(...) for requests the plan finished (a draft model frees their draft KV blocks).
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from pagedllm.core.batch_plan import ModelOutput, TokenLogprobs
from pagedllm.layers.sampler import SamplingMetadata, penalized_prompt
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.rejection_sampler import NO_DRAFT, emitted_counts, rejection_sample
from pagedllm.spec_decode.stats import draft_room

logger = logging.getLogger(__name__)


class SpecDecodeRunner:
    def __init__(self, config: SpeculativeConfig, proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self._free_slots: list = []  # CUDA: pinned result buffers + events that verify steps reuse
        # Overlapped n-gram speculation: the histories and drafts on the device (spec_decode/device_ngram.py).
        self.device_ngram = None

    def enable_device_ngram(self, runner) -> bool:
        """Keep n-gram drafts on the device (overlapped verify steps). False, with a warning, if the CUDA kernels
        fail to compile or run at start-up: verify steps then wait for the step before, as without overlap."""
        from pagedllm.spec_decode.device_ngram import DeviceNgram

        c = self.config
        self.device_ngram = DeviceNgram(runner.max_num_seqs, runner.max_model_len, c.num_speculative_tokens,
                                        c.prompt_lookup_min, c.prompt_lookup_max, runner.device)
        if runner.device.type == "cuda":
            from pagedllm.kernels.spec_decode import warm_up

            try:
                warm_up(c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max, runner.max_model_len,
                        runner.block_size, runner.device)
            except Exception as e:  # noqa: BLE001 - a kernel that cannot run here must not stop the engine
                logger.warning("Overlapped speculative decoding is off: its kernels failed at start-up (%s: %s); "
                               "verify steps wait for the step before them.", type(e).__name__, e)
                self.device_ngram = None
                return False
        return True

    def initialize(self, num_target_blocks: int) -> None:
        """After the target's KV cache exists: a draft model allocates its own."""
        init = getattr(self.proposer, "initialize", None)
        if init is not None:
            init(num_target_blocks)

    def graph_token_sizes(self) -> list[int]:
        """Token counts of verify steps worth an exact CUDA-graph bucket: (k + 1) x a decode batch size up to the
        batch size where speculation turns off (other verify steps replay the next larger mixed bucket)."""
        k1 = self.config.num_speculative_tokens + 1
        limit = self.config.disable_by_batch_size or 16
        return [k1 * b for b in (1, 2, 4, 8, 16, 32, 64) if b <= limit]

    def share_blocks(self, num_blocks: int, target_spec) -> int:
        """Target blocks left when a draft model's KV cache (as many blocks) shares the same memory budget."""
        spec_of = getattr(self.proposer, "kv_cache_spec", None)
        if spec_of is None:
            return num_blocks
        target, draft = target_spec.bytes_per_block, spec_of().bytes_per_block
        return max(1, num_blocks * target // (target + draft))

    def drop(self, req_ids) -> None:
        drop = getattr(self.proposer, "drop", None)
        if drop is not None:
            drop(req_ids)

    # ------------------------------------------------------------------ propose
    def proposals(self, runner, inp, num_drafts: Optional[list[int]] = None) -> list[list[int]]:
        """The next step's drafts per request (batch order): an overlapped step's are placeholders, as many as the
        device proposed (num_drafts: per sampling row); any other step's the host proposer's."""
        if not inp.spec_overlap:
            return self.propose(runner, inp)
        from pagedllm.spec_decode.scheduling import PLACEHOLDER

        out: list[list[int]] = [[] for _ in inp.req_ids]
        for r, n in zip(inp.sample_rows.tolist(), num_drafts):
            out[r] = [PLACEHOLDER] * n
        return out

    def propose(self, runner, inp) -> list[list[int]]:
        """Drafts for every request of the step that sampled (empty lists elsewhere), in batch order."""
        batch = runner.input_batch
        out: list[list[int]] = [[] for _ in inp.req_ids]
        idx, req_ids, rows, lens, rooms, longs, plens = [], [], [], [], [], [], []
        for r in inp.sample_rows.tolist():
            state = inp.states[r]
            if batch.requests.get(state.req_id) is not state:
                continue
            room = draft_room(len(state.output_token_ids), state.num_tokens, state.sampling_params.max_tokens,
                              self.max_model_len)
            if room <= 0:
                continue
            idx.append(r)
            req_ids.append(state.req_id)
            rows.append(state.row)
            lens.append(state.num_tokens)
            rooms.append(room)
            longs.append(state.rope_long)
            plens.append(len(state.prompt_token_ids))
        if idx:
            # (a draft model rotates each request as the target does: LongRoPE factors, dynamic NTK base)
            kw = {"rope_long": longs, "prompt_lens": plens} if self.config.method == "draft_model" else {}
            drafts = self.proposer.propose(batch.token_ids, rows, lens, rooms, req_ids=req_ids, **kw)
            for r, d in zip(idx, drafts):
                out[r] = d
        return out

    # ------------------------------------------------------------------ verify
    def verify_rows(self, runner, inp) -> "VerifyRows":
        """The verify rows of a step with drafts: per sampling request its 1 + d rows (the last 1 + d tokens of its
        query span) and the draft each row is checked against (NO_DRAFT on the bonus row). Known before the
        forward, so the runner stages what the device needs of them with the step's inputs (`device_arrays`)."""
        spec, req_ids = inp.spec_token_ids, inp.req_ids
        sample_rows = inp.sample_rows
        token_rows: list[int] = []
        draft_ids: list[int] = []
        starts: list[int] = []
        counts: list[int] = []
        # Lists, not numpy: a few requests of at most k + 1 rows each, where numpy's per-call cost dominates.
        for r, end in zip(sample_rows.tolist(), inp.query_start_loc[1:][sample_rows].tolist()):
            drafts = spec.get(req_ids[r], ())
            n = len(drafts) + 1
            starts.append(len(draft_ids))
            counts.append(n)
            token_rows.extend(range(end - n, end))
            draft_ids.extend(drafts)
            draft_ids.append(NO_DRAFT)
        return VerifyRows(token_rows=np.array(token_rows, dtype=np.int64), draft_ids=np.array(draft_ids, dtype=np.int64),
                          starts=np.array(starts, dtype=np.int64), counts=np.array(counts, dtype=np.int64),
                          every_token=len(token_rows) == len(inp.input_ids),
                          greedy=self._all_plain_greedy(runner, inp))

    def _host_slot(self, runner, need: int = 0) -> tuple[torch.Tensor, "torch.cuda.Event"]:
        """A pinned [2, rows] int64 buffer and its event, reused across steps (a verify result hands them back once
        read; one still unread, e.g. a dropped step's, is never reused). need: the entries row 0 must hold."""
        rows = max(runner.max_num_batched_tokens + 3 * runner.max_num_seqs, need, 1)
        while self._free_slots:
            slot = self._free_slots.pop()
            if slot[0].shape[1] >= need:
                return slot
        return torch.empty((2, rows), dtype=torch.int64, pin_memory=True), torch.cuda.Event()

    @torch.inference_mode()
    def verify(self, runner, inp, hidden: torch.Tensor, prompt_logprobs: dict, staged: list[torch.Tensor],
               rows: "VerifyRows", dev_step=None, input_ids: Optional[torch.Tensor] = None,
               meta: Optional[SamplingMetadata] = None, token_bitmask: Optional[torch.Tensor] = None
               ) -> "VerifyPending":
        """Enqueue the verification of a step's drafts; the returned pending output's result() is the step's one
        host sync (one copy of the emitted ids, and of the acceptances when the rows are not all greedy).
        meta: the verify rows' sampling metadata from the batch's per-row arrays (None: built here, per row).
        token_bitmask: int32 [verify rows, W], the grammars' allowed tokens per row (None: no row under a grammar),
        applied to a row's logits before the target's choice, as a plain step applies it.

        All-greedy steps need no device work past the argmax: a row's emitted token is its argmax whether or not
        its draft is accepted, and a draft is accepted iff it equals that argmax, which the host checks against
        the drafts it already holds."""
        if dev_step is not None:
            return self._verify_on_device(runner, inp, hidden, prompt_logprobs, rows, dev_step, input_ids, meta,
                                          token_bitmask)
        staged = iter(staged)
        token_rows_t = None if rows.every_token else next(staged)
        draft_t = None if rows.greedy else next(staged)
        sample_rows = inp.sample_rows.tolist()
        rows_hidden = hidden if rows.every_token else hidden.index_select(0, token_rows_t)
        greedy = None
        if rows.greedy:
            greedy = runner.greedy_ids(rows_hidden, token_bitmask)
        lp = None
        if greedy is not None:
            final, accepted = greedy, None
        else:
            if draft_t is None:  # a model without the argmax shortcut
                draft_t = torch.from_numpy(rows.draft_ids).to(runner.device)
            if meta is None:
                meta = self._row_metadata(runner, [inp.states[r] for r in sample_rows], inp.spec_token_ids)
            meta.logprobs_mode = runner.logprobs_mode
            meta.token_bitmask = token_bitmask
            result = rejection_sample(runner.model.compute_logits(rows_hidden), meta, draft_t, None, None)
            final, accepted, lp = result.final_token_ids, result.accepted, result.logprobs
        slot = None
        if runner.device.type == "cuda":
            n = final.shape[0]
            slot = self._host_slot(runner)
            buf, event = slot
            final = buf[0, :n].copy_(final, non_blocking=True)
            if accepted is not None:
                accepted = buf[1, :n].copy_(accepted, non_blocking=True)
            lp = None if lp is None else tuple(t.to("cpu", non_blocking=True) for t in lp)
            event.record()
        return VerifyPending(self, runner, inp, final, accepted, lp, slot, prompt_logprobs, sample_rows, rows)

    def _verify_on_device(self, runner, inp, hidden: torch.Tensor, prompt_logprobs: dict, rows: "VerifyRows",
                          dev_step, input_ids: torch.Tensor, meta: Optional[SamplingMetadata] = None,
                          token_bitmask: Optional[torch.Tensor] = None) -> "VerifyPending":
        """verify() with the drafts read from the step's device inputs (placeholders filled there, or the host's):
        acceptance, emitted counts and the step's last tokens stay on the device, where the next step (launched
        before this one is read) takes them; the host copy carries the verify rows' ids, the emitted counts and the
        draft counts."""
        token_rows = dev_step.token_rows() if not rows.every_token else None
        rows_hidden = hidden if token_rows is None else hidden.index_select(0, token_rows)
        greedy = None
        if rows.greedy:
            greedy = runner.greedy_ids(rows_hidden, token_bitmask)
        lp = None
        if greedy is not None:  # a row's draft is accepted iff it is the row's argmax (checked on the device)
            stats = dev_step.after_step(greedy, input_ids=input_ids, keep_final=True)
        else:
            if meta is None:
                meta = self._row_metadata(runner, [inp.states[r] for r in inp.sample_rows.tolist()],
                                          inp.spec_token_ids)
            meta.logprobs_mode = runner.logprobs_mode
            meta.token_bitmask = token_bitmask
            result = rejection_sample(runner.model.compute_logits(rows_hidden), meta, dev_step.draft_ids(input_ids),
                                      None, None)
            lp = result.logprobs
            stats = dev_step.after_step(result.final_token_ids, accepted=result.accepted, keep_final=True)
        # [emitted, last, rejected, drafts verified, drafts proposed] per sampling request, after the rows' tokens
        runner._prev_sampled, runner._prev_rej = stats[1], stats[2]
        if token_bitmask is not None or (meta is not None and meta.no_token_rows is not None):
            # (the next launch's input ids must be valid: a row without an allowed token holds NO_ALLOWED_TOKEN)
            runner._prev_sampled = stats[1].clamp(min=0)
        runner._prev_pos.fill(-1)
        runner._prev_pos[inp.rows[inp.sample_rows]] = np.arange(len(inp.sample_rows))
        packed, stats_at, row_len = dev_step.packed
        slot = None
        if runner.device.type == "cuda":
            slot = self._host_slot(runner, packed.shape[0])
            buf, event = slot
            packed = buf[0, :packed.shape[0]].copy_(packed, non_blocking=True)
            lp = None if lp is None else tuple(t.to("cpu", non_blocking=True) for t in lp)
            event.record()
        return VerifyPending(self, runner, inp, packed, None, lp, slot, prompt_logprobs, inp.sample_rows.tolist(),
                             rows, on_device=(stats_at, row_len))

    @staticmethod
    def _all_plain_greedy(runner, inp) -> bool:
        """Every verifying request greedy without logprobs, penalties, min_tokens, seeds or token constraints (the
        batch's per-row arrays): the argmax alone decides each row. Rows the arrays send to the general builder
        take the sampler's path, which gives the same tokens for greedy rows."""
        s = runner.input_batch.sampling
        brows = inp.rows[inp.sample_rows]
        return bool(s.greedy[brows].all()) and not s.general[brows].any() and not (s.logprobs[brows] >= 0).any()

    @staticmethod
    def _row_metadata(runner, states, spec) -> SamplingMetadata:
        """Sampling metadata over every verify row: row j of a request sees the drafts before it as outputs
        (penalties, min_tokens, the seed's position)."""
        params, prompts, outputs, eos = [], [], [], []
        for state in states:
            drafts = spec.get(state.req_id, [])
            p = state.sampling_params
            # Penalties and bad words read the output tokens themselves; seeds and min_tokens only their count.
            needs_history = (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                             or bool(getattr(p, "bad_words_token_ids", None)))
            e = runner.eos_token_id  # (min_tokens forbids EOS also under ignore_eos, as vLLM)
            for j in range(len(drafts) + 1):
                params.append(p)
                prompts.append(penalized_prompt(state))
                if j == 0:
                    outputs.append(state.output_token_ids)
                elif needs_history:
                    outputs.append(state.output_token_ids + drafts[:j])
                else:
                    outputs.append(_Len(len(state.output_token_ids) + j))
                eos.append(e)
        return SamplingMetadata.build(params=params, prompt_token_ids=prompts, output_token_ids=outputs,
                                      eos_token_ids=eos, vocab_size=runner.vocab_size, device=runner.device)

    def _output(self, runner, inp, sample_rows: list[int], final: list[int], num_emitted: list[int],
                rows: "VerifyRows", lp: Optional[list], draft_counts: Optional[list[list[int]]] = None) -> ModelOutput:
        batch = runner.input_batch
        num_reqs = len(inp.req_ids)
        output = ModelOutput(req_ids=inp.req_ids, sampled_token_ids=[[] for _ in range(num_reqs)],
                             logprobs=[None] * num_reqs)
        # A request dropped since the launch (finished, aborted, preempted: with overlapped steps its row may hold
        # another request by now) takes no tokens into the batch.
        all_live = batch.num_dropped == inp.dropped_epoch
        for r, start, n in zip(sample_rows, rows.starts.tolist(), num_emitted):
            state = inp.states[r]
            tokens = final[start:start + n]
            if all_live or batch.requests.get(state.req_id) is state:
                batch.append_tokens(state, tokens)
            output.sampled_token_ids[r] = tokens
            k = state.sampling_params.logprobs
            if lp is not None and k is not None:
                ids, vals, ranks = lp
                output.logprobs[r] = [TokenLogprobs(token_ids=ids[j][:k + 1], logprobs=vals[j][:k + 1],
                                                    ranks=ranks[j][:k + 1])
                                      for j in range(start, start + n)]
        if draft_counts is not None and inp.spec_overlap:
            verified = [0] * num_reqs
            for r, n in zip(sample_rows, draft_counts[0]):
                verified[r] = n
            output.spec_num_drafts = verified
        if inp.propose_drafts:
            output.spec_token_ids = self.proposals(runner, inp, None if draft_counts is None else draft_counts[1])
        return output


@dataclass
class VerifyRows:
    """The rows a verify step samples (SpecDecodeRunner.verify_rows)."""

    token_rows: np.ndarray  # [rows] int64: each row's index among the step's tokens
    draft_ids: np.ndarray  # [rows] int64: the draft the row checks, NO_DRAFT on bonus rows
    starts: np.ndarray  # [sampling requests] int64: a request's first row
    counts: np.ndarray  # [sampling requests] int64: its 1 + number of drafts
    every_token: bool  # the rows are all of the step's tokens in order (token_rows = arange)
    greedy: bool  # every row plain greedy (SpecDecodeRunner._all_plain_greedy): the argmax decides

    def device_arrays(self) -> list[np.ndarray]:
        """What the device needs: the token rows unless they are every token, the drafts unless all greedy (the
        host checks those against the argmax)."""
        return ([] if self.every_token else [self.token_rows]) + ([] if self.greedy else [self.draft_ids])


class VerifyPending:
    """A launched verify step (PendingOutput's interface): result() waits for the emitted ids (and acceptances),
    then appends the emitted tokens and proposes the next drafts on the host."""

    def __init__(self, spec: SpecDecodeRunner, runner, inp, final: torch.Tensor, accepted: Optional[torch.Tensor],
                 logprobs_host, slot, prompt_logprobs: dict, sample_rows: list[int], rows: VerifyRows,
                 on_device: Optional[tuple[int, int]] = None) -> None:
        self.spec, self.runner, self.inp = spec, runner, inp
        # on_device (SpecDecodeRunner._verify_on_device): `final` packs the verify rows' ids, then from
        # on_device[0] the five stats rows of on_device[1] entries (DeviceStep.after_step's packed results).
        self.on_device = on_device
        # Host tensors once `slot`'s event has fired (CUDA: views of its pinned buffer); accepted None: all greedy.
        self.final, self.accepted, self.logprobs_host, self.slot = final, accepted, logprobs_host, slot
        self.prompt_logprobs = prompt_logprobs or {}
        self.sample_rows, self.rows = sample_rows, rows
        self._output: Optional[ModelOutput] = None

    def result(self) -> ModelOutput:
        if self._output is None:
            rows = self.rows
            if self.slot is not None:
                self.slot[1].synchronize()
            final = self.final.numpy().copy()
            draft_counts = None
            if self.on_device:
                stats_at, row_len = self.on_device
                stats = final[stats_at:stats_at + 5 * row_len].reshape(5, row_len)[:, :len(self.sample_rows)]
                num_emitted = stats[0]
                draft_counts = stats[3:5].tolist()
                final = final[:len(rows.token_rows)]
            else:
                accepted = final == rows.draft_ids if self.accepted is None else self.accepted.numpy() != 0
                num_emitted = emitted_counts(accepted, rows.starts, rows.counts)
            if self.slot is not None:
                self.spec._free_slots.append(self.slot)  # read: the buffer may serve a later step
            lp = None if self.logprobs_host is None else [t.tolist() for t in self.logprobs_host]
            output = self.spec._output(self.runner, self.inp, self.sample_rows, final.tolist(), num_emitted.tolist(),
                                       rows, lp, draft_counts)
            output.prompt_logprobs = self.prompt_logprobs
            output.pooled = self.inp.pooled
            self._output = output
        return self._output


class _Len:
    """Stands in for an output-token list where only its length is read (seeds, min_tokens)."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def build_proposer(config: SpeculativeConfig, **kwargs):
    if config.method == "ngram":
        from pagedllm.spec_decode.ngram_proposer import NgramProposer

        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
    from pagedllm.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer(config, **kwargs)

