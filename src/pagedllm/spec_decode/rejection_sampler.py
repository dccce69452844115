"""Rejection sampler: verify proposed tokens against the target model in one pass over all rows.

Rows: each request that samples contributes 1 + d rows (d = its number of drafts). Row j of a request is the
target's distribution after its input token j (input 0 = its last real token, input j >= 1 = draft j); row j < d
is checked against draft j + 1, and row d is the bonus row.

  * greedy rows accept a draft iff it equals the target's argmax (so output is identical with and without
    speculation); the first row that does not accept emits its argmax;
  * random rows with a one-hot q (the proposers here: n-gram, a greedy draft model) draw their token as a plain
    step draws it (seeded rows from their (seed, position) key) and accept the draft iff it is that token: the
    draft x is accepted with probability p(x) = min(1, p(x) / q(x)) and a rejected row emits a draw from p
    without x, which is the rejection rule (Leviathan et al. 2023) for that q, so every emitted token is an
    exact draw from p; and a request's tokens are those it gets without speculation under the same draws,
    whatever its drafts or its batch-mates';
  * rows with a general q accept draft x with probability min(1, p(x) / q(x)) and otherwise emit a sample from
    norm(max(0, p - q)). The bonus row samples from p.

p is the target distribution after the sampler's own processing (min_tokens, penalties, temperature, min_p,
top-k, top-p), so seeds, penalties and logprobs work as without speculation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from pagedllm.layers.sampler import (
    LogprobsTensors,
    Sampler,
    SamplingMetadata,
    exponential_race,
    gather_logprobs,
    inverse_cdf_sample,
    mark_no_token,
    processed_values,
)
from pagedllm.sampling_params import _GREEDY_EPS

NO_DRAFT = -1  # draft_token_ids entry of a bonus row


@dataclass
class VerifyOutput:
    accepted: torch.Tensor  # [N] bool: the row's draft is accepted (always False on bonus rows)
    final_token_ids: torch.Tensor  # [N] int64: the draft where accepted, else the row's emitted token
    logprobs: Optional[LogprobsTensors] = None  # of final_token_ids under the raw distribution


def _uniform(n: int, generators: dict[int, torch.Generator], device) -> torch.Tensor:
    u = torch.rand(n, dtype=torch.float32, device=device)
    for row, gen in generators.items():
        u[row] = torch.rand(1, generator=gen, dtype=torch.float32, device=device)[0]
    return u


def rejection_sample(
    logits: Optional[torch.Tensor],  # [N, V] raw target logits (None when greedy_ids covers everything)
    meta: SamplingMetadata,  # built over the N rows
    draft_token_ids: torch.Tensor,  # [N] int64, NO_DRAFT on bonus rows
    draft_probs: Optional[torch.Tensor] = None,  # [N, V] q of the proposer; None = one-hot at the draft
    greedy_ids: Optional[torch.Tensor] = None,  # [N] argmax of the raw logits, when the caller has it
) -> VerifyOutput:
    is_draft = draft_token_ids >= 0
    safe_draft = draft_token_ids.clamp(min=0)
    if greedy_ids is not None and meta.argmax_only:
        accepted = is_draft & (greedy_ids == draft_token_ids)
        return VerifyOutput(accepted, torch.where(accepted, draft_token_ids, greedy_ids))
    if logits is None:
        raise ValueError("rejection_sample needs the logits unless every row is plain greedy.")
    logits, raw_logprobs = Sampler.process_logits(logits, meta)
    if raw_logprobs is None and meta.max_num_logprobs is not None:  # processed_* logprobs_mode: the target's p
        raw_logprobs = processed_values(logits, meta)
    if draft_probs is None or meta.all_greedy:
        # One-hot q (every proposer here): each row draws its token as a plain step would (the same (seed,
        # position) key for seeded rows) and a draft is accepted iff it is that token. Accepting x with
        # probability p(x) = min(1, p(x) / q(x)) and otherwise emitting a draw from p without x is exactly the
        # rejection rule, so every emitted token is a draw from p; and a request's tokens do not depend on its
        # drafts, or on its batch-mates'.
        emitted = Sampler.draw(logits, meta)
        accepted = is_draft & (emitted == draft_token_ids)
    else:
        argmax = logits.argmax(dim=-1)
        probs = Sampler.probs(logits, meta)  # [N, V]
        p_draft = probs.gather(1, safe_draft.unsqueeze(1)).squeeze(1)
        q_draft = draft_probs.gather(1, safe_draft.unsqueeze(1)).squeeze(1)
        residual = (probs - draft_probs).clamp_(min=0.0)
        # Bonus rows (and rows whose residual vanished, which only happens when p == q and the draft is then
        # always accepted) draw from p itself.
        empty = residual.sum(dim=-1) <= 0
        residual = torch.where(((~is_draft) | empty).unsqueeze(1), probs, residual)
        if residual.device.type == "cpu":
            sampled = inverse_cdf_sample(residual, meta.generators)
        else:
            sampled = exponential_race(residual, meta.generators)
        u = _uniform(probs.shape[0], meta.generators, probs.device)
        accepted_random = is_draft & (u * q_draft < p_draft)  # u < p / q without dividing by q = 0
        greedy_rows = meta.temperature < _GREEDY_EPS
        emitted = torch.where(greedy_rows, argmax, sampled)
        accepted = torch.where(greedy_rows, is_draft & (argmax == draft_token_ids), accepted_random)
    final = torch.where(accepted, draft_token_ids, emitted)
    lp = None
    if raw_logprobs is not None:
        lp = gather_logprobs(raw_logprobs, final, meta.max_num_logprobs)
    if meta.no_token_rows is not None:  # (no draft is accepted where no token is allowed)
        accepted = accepted & ~meta.no_token_rows
        final = mark_no_token(final, meta)
    return VerifyOutput(accepted, final, lp)


def emitted_counts(accepted: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Host side: per request (counts[i] rows from starts[i], the last one its bonus row) how many tokens it emits:
    its leading accepted drafts + 1 (the first non-accepted row's token: the correction, or the bonus when every
    draft was accepted). One search over the non-accepted rows, no loop over requests."""
    stops = ~np.asarray(accepted, dtype=bool)
    stops[starts + counts - 1] = True  # a bonus row ends its request's run whatever it says
    first = np.flatnonzero(stops)
    return first[np.searchsorted(first, starts)] - starts + 1


def accepted_tokens(accepted: Sequence[bool], final_token_ids: Sequence[int],
                    num_rows: Sequence[int]) -> list[list[int]]:
    """Per request (num_rows[i] = 1 + its drafts), the tokens it emits (emitted_counts over lists)."""
    num_rows = np.asarray(num_rows, dtype=np.int64)
    starts = np.cumsum(num_rows) - num_rows
    counts = emitted_counts(np.array(accepted, dtype=bool), starts, num_rows)
    final = list(final_token_ids)
    return [final[s:s + n] for s, n in zip(starts.tolist(), counts.tolist())]
