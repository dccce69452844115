"""The runner's per-row sampling parameters as persistent arrays, set once when a request joins the batch.

A step's SamplingMetadata is then a few numpy gathers over the rows that sample and one host-to-device copy per
dtype (staged with the step's other inputs), instead of a Python pass over every row's SamplingParams each step.

Rows that need per-step host work beyond these arrays (penalties, seeds, min_tokens, allowed ids, bad words,
logit bias) are marked `general`: a step with any such row builds its metadata with SamplingMetadata.build, the
reference implementation, so both paths give the same tensors and the same tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from pagedllm.layers.sampler import SamplingMetadata, row_temperature
from pagedllm.sampling_params import _GREEDY_EPS, SamplingParams


def needs_general_build(p: SamplingParams) -> bool:
    """Whether a row's sampling state changes with its outputs (or is rare enough to keep off the fast path)."""
    return bool(p.seed is not None or p.min_tokens or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                or p.repetition_penalty != 1.0 or p.logit_bias or p.allowed_token_ids or p.bad_words_token_ids)


@dataclass
class StepSampling:
    """Host arrays of one step's sampling rows (fast path): float32 [k, N] packed rows named by `names`, top-k."""

    names: list[str]
    floats: Optional[np.ndarray]
    top_k: Optional[np.ndarray]
    all_greedy: bool
    all_random: bool
    max_top_k: int
    max_num_logprobs: Optional[int]
    top_p_within_top_k: bool = False  # every sampled row with a top-p has a top-k (SamplingMetadata's)


class SamplingBatch:
    def __init__(self, max_rows: int, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.greedy = np.ones(max_rows, dtype=bool)
        self.temperature = np.zeros(max_rows, dtype=np.float32)  # 0 for greedy rows, as the builder sends
        self.top_p = np.ones(max_rows, dtype=np.float32)
        self.min_p = np.zeros(max_rows, dtype=np.float32)
        self.top_k = np.full(max_rows, vocab_size, dtype=np.int64)  # vocab_size: no top-k
        self.logprobs = np.full(max_rows, -1, dtype=np.int64)  # -1: none asked
        self.general = np.zeros(max_rows, dtype=bool)
        # the row reads its prompt's hidden states: prompt logprobs, or an embedding's pooling
        self.prompt_logprobs = np.zeros(max_rows, dtype=bool)
        # Rows held that are not plain greedy (sampled, logprobs or the general builder), and rows that asked for
        # prompt logprobs: while both are 0 (a greedy batch) a step needs no gather (at a few rows the numpy
        # calls' fixed cost is most of a step's sampling setup).
        self._special = np.zeros(max_rows, dtype=bool)
        self.num_special = 0
        self.num_prompt_logprobs = 0

    def set_row(self, row: int, p: SamplingParams) -> None:
        greedy = p.temperature < _GREEDY_EPS
        self.greedy[row] = greedy
        self.temperature[row] = 0.0 if greedy else row_temperature(p)
        self.top_p[row] = float(p.top_p)
        self.min_p[row] = float(p.min_p)
        self.top_k[row] = p.top_k if 0 < p.top_k < self.vocab_size else self.vocab_size
        self.logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.general[row] = general = needs_general_build(p)
        self._mark(row, not greedy or general or p.logprobs is not None,
                   p.prompt_logprobs is not None or p.pooling is not None)

    def clear_row(self, row: int) -> None:
        """The row's request left the batch: it no longer counts as special."""
        self._mark(row, False, False)

    def _mark(self, row: int, special: bool, prompt_logprobs: bool) -> None:
        self.num_special += int(special) - int(self._special[row])
        self.num_prompt_logprobs += int(prompt_logprobs) - int(self.prompt_logprobs[row])
        self._special[row] = special
        self.prompt_logprobs[row] = prompt_logprobs

    def gather(self, rows: np.ndarray) -> Optional[StepSampling]:
        """The fast path's arrays for these batch rows (in sampling order), or None if a row needs the builder."""
        if self.num_special == 0 and len(rows):  # every row held is plain greedy
            return StepSampling(names=[], floats=None, top_k=None, all_greedy=True, all_random=False, max_top_k=0,
                                max_num_logprobs=None)
        if self.general[rows].any():
            return None
        greedy = self.greedy[rows]
        all_greedy = bool(greedy.all())
        all_random = not greedy.any()
        names: list[str] = []
        floats: list[np.ndarray] = []
        top_k = None
        max_top_k = 0
        within = False
        if not all_greedy:
            sampled = ~greedy
            names.append("temperature")
            floats.append(self.temperature[rows])
            top_p = self.top_p[rows]
            if (top_p[sampled] < 1.0).any():
                names.append("top_p")
                floats.append(top_p)
            min_p = self.min_p[rows]
            if (min_p[sampled] > 0.0).any():
                names.append("min_p")
                floats.append(min_p)
            ks = self.top_k[rows]
            limited = ks < self.vocab_size
            if limited[sampled].any():
                top_k = ks
                max_top_k = int(ks[limited].max())
            within = bool(limited[sampled & (top_p < 1.0)].all())
        lp = self.logprobs[rows]
        max_lp = int(lp.max()) if len(lp) else -1
        return StepSampling(names=names, floats=np.stack(floats) if floats else None, top_k=top_k,
                            all_greedy=all_greedy, all_random=all_random, max_top_k=max_top_k,
                            max_num_logprobs=max_lp if max_lp >= 0 else None, top_p_within_top_k=within)


def fast_metadata(step: StepSampling, num_rows: int, vocab_size: int, floats: Optional[torch.Tensor],
                  top_k: Optional[torch.Tensor]) -> SamplingMetadata:
    """SamplingMetadata from the gathered arrays, already on the device (floats [k, N], top_k [N])."""
    meta = SamplingMetadata(num_rows=num_rows, vocab_size=vocab_size, all_greedy=step.all_greedy,
                            all_random=step.all_random)
    if floats is not None:
        for name, row in zip(step.names, floats.unbind(0)):
            setattr(meta, name, row)
    if top_k is not None:
        meta.top_k, meta.max_top_k, meta.no_top_k = top_k, step.max_top_k, False
    meta.no_top_p = meta.top_p is None
    meta.no_min_p = meta.min_p is None
    meta.max_num_logprobs = step.max_num_logprobs
    meta.top_p_within_top_k = step.top_p_within_top_k
    return meta
