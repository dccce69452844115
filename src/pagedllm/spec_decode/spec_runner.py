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
from typing import Optional

import numpy as np
import torch

from pagedllm.core.batch_plan import ModelOutput, TokenLogprobs
from pagedllm.layers.sampler import SamplingMetadata
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.rejection_sampler import NO_DRAFT, accepted_tokens, rejection_sample
from pagedllm.spec_decode.stats import draft_room


class SpecDecodeRunner:
    def __init__(self, config: SpeculativeConfig, proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len

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
    def propose(self, runner, inp) -> list[list[int]]:
        """Drafts for every request of the step that sampled (empty lists elsewhere), in batch order."""
        batch = runner.input_batch
        out: list[list[int]] = [[] for _ in inp.req_ids]
        idx, req_ids, rows, lens, rooms = [], [], [], [], []
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
        if idx:
            drafts = self.proposer.propose(batch.token_ids, rows, lens, rooms, req_ids=req_ids)
            for r, d in zip(idx, drafts):
                out[r] = d
        return out

    # ------------------------------------------------------------------ verify
    @staticmethod
    def stage_arrays(inp) -> list[np.ndarray]:
        """[token rows, draft ids] (int64) of a step with drafts: per sampling request its 1 + d rows (the last
        1 + d tokens of its query span) and the draft each row is checked against (NO_DRAFT on the bonus row).
        Known before the forward, so the runner stages them with the step's inputs (no copy after it)."""
        spec = inp.spec_token_ids
        sample_rows = inp.sample_rows
        drafts = [spec.get(inp.req_ids[r], ()) for r in sample_rows.tolist()]
        counts = np.fromiter((len(d) + 1 for d in drafts), dtype=np.int64, count=len(drafts))
        total = int(counts.sum())
        ends = inp.query_start_loc[1:][sample_rows].astype(np.int64)
        first = np.cumsum(counts) - counts  # each request's first row among the verify rows
        token_rows = np.repeat(ends - counts, counts) + (np.arange(total, dtype=np.int64) - np.repeat(first, counts))
        draft_ids = np.fromiter(itertools.chain.from_iterable(itertools.chain(d, (NO_DRAFT,)) for d in drafts),
                                dtype=np.int64, count=total)
        return [token_rows, draft_ids]

    @torch.inference_mode()
    def verify(self, runner, inp, hidden: torch.Tensor, prompt_logprobs: dict,
               staged: Optional[list[torch.Tensor]] = None) -> "VerifyPending":
        """Enqueue the verification of a step's drafts; the returned pending output's result() is the step's one
        host sync (one packed copy of the emitted ids and acceptances)."""
        spec = inp.spec_token_ids
        if staged is None:
            staged = [torch.from_numpy(a).to(runner.device) for a in self.stage_arrays(inp)]
        token_rows_t, draft_t = staged
        sample_rows = inp.sample_rows.tolist()
        states = [inp.states[r] for r in sample_rows]
        num_rows = [len(spec.get(st.req_id, ())) + 1 for st in states]
        dev = runner.device
        rows_hidden = hidden.index_select(0, token_rows_t)
        # Whether the argmax alone decides every row: one metadata row per request tells (a request's later rows
        # differ only in their output count, which changes nothing here once row 0 has no min_tokens mask).
        probe = SamplingMetadata.build(
            params=[st.sampling_params for st in states], prompt_token_ids=[st.prompt_token_ids for st in states],
            output_token_ids=[st.output_token_ids for st in states],
            eos_token_ids=[None if st.sampling_params.ignore_eos else runner.eos_token_id for st in states],
            vocab_size=runner.vocab_size, device=dev)
        greedy = None
        if probe.argmax_only:
            greedy = getattr(runner.model, "greedy_token_ids", lambda h: None)(rows_hidden)
        if greedy is not None:  # every row plain greedy: accept where the draft is the argmax
            accepted, final = greedy == draft_t, greedy
            lp = None
        else:
            meta = self._row_metadata(runner, states, spec)
            result = rejection_sample(runner.model.compute_logits(rows_hidden), meta, draft_t, None, None)
            accepted, final, lp = result.accepted, result.final_token_ids, result.logprobs
        packed = torch.stack([final.to(torch.int64), accepted.to(torch.int64)])  # [2, rows]
        event = None
        if dev.type == "cuda":
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            lp = None if lp is None else tuple(t.to("cpu", non_blocking=True) for t in lp)
            event = torch.cuda.Event()
            event.record()
        else:
            host = packed
        return VerifyPending(self, runner, inp, host, lp, event, prompt_logprobs, sample_rows, num_rows)

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
            e = None if p.ignore_eos else runner.eos_token_id
            for j in range(len(drafts) + 1):
                params.append(p)
                prompts.append(state.prompt_token_ids)
                if j == 0:
                    outputs.append(state.output_token_ids)
                elif needs_history:
                    outputs.append(state.output_token_ids + drafts[:j])
                else:
                    outputs.append(_Len(len(state.output_token_ids) + j))
                eos.append(e)
        return SamplingMetadata.build(params=params, prompt_token_ids=prompts, output_token_ids=outputs,
                                      eos_token_ids=eos, vocab_size=runner.vocab_size, device=runner.device)

    def _output(self, runner, inp, sample_rows: list[int], emitted: list[list[int]], num_rows: list[int],
                lp: Optional[list]) -> ModelOutput:
        batch = runner.input_batch
        num_reqs = len(inp.req_ids)
        output = ModelOutput(req_ids=inp.req_ids, sampled_token_ids=[[] for _ in range(num_reqs)],
                             logprobs=[None] * num_reqs)
        start = 0
        for r, tokens, n in zip(sample_rows, emitted, num_rows):
            state = inp.states[r]
            for t in tokens:
                batch.append_token(state, t)
            output.sampled_token_ids[r] = tokens
            k = state.sampling_params.logprobs
            if lp is not None and k is not None:
                ids, vals, ranks = lp
                output.logprobs[r] = [TokenLogprobs(token_ids=ids[j][:k + 1], logprobs=vals[j][:k + 1],
                                                    ranks=ranks[j][:k + 1])
                                      for j in range(start, start + len(tokens))]
            start += n
        if inp.propose_drafts:
            output.spec_token_ids = self.propose(runner, inp)
        return output


class VerifyPending:
    """A launched verify step (PendingOutput's interface): result() waits for the packed [final ids; accepted]
    copy, then appends the emitted tokens and proposes the next drafts on the host."""

    def __init__(self, spec: SpecDecodeRunner, runner, inp, packed_host: torch.Tensor, logprobs_host, event,
                 prompt_logprobs: dict, sample_rows: list[int], num_rows: list[int]) -> None:
        self.spec, self.runner, self.inp = spec, runner, inp
        self.packed_host, self.logprobs_host, self.event = packed_host, logprobs_host, event
        self.prompt_logprobs = prompt_logprobs or {}
        self.sample_rows, self.num_rows = sample_rows, num_rows
        self._output: Optional[ModelOutput] = None

    def result(self) -> ModelOutput:
        if self._output is None:
            if self.event is not None:
                self.event.synchronize()
            final, accepted = self.packed_host.tolist()
            lp = None if self.logprobs_host is None else [t.tolist() for t in self.logprobs_host]
            emitted = accepted_tokens(accepted, final, self.num_rows)
            output = self.spec._output(self.runner, self.inp, self.sample_rows, emitted, self.num_rows, lp)
            output.prompt_logprobs = self.prompt_logprobs
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

