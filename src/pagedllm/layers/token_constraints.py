"""The sampler's per-request token constraints, vectorized over the batch: allowed_token_ids (everything else
to -inf), bad words (their banned next tokens to -inf) and logit_bias (added). Applied to the logits after the
raw logprobs are taken and before penalties, in vLLM's order: allowed ids, bad words, bias.

A step with any constrained row never takes the argmax-only shortcut (SamplingMetadata.argmax_only).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from pagedllm.sampling_constraints import banned_by_bad_words
from pagedllm.sampling_params import SamplingParams


@dataclass
class TokenConstraints:
    # rows with allowed_token_ids [R] and their ids [R, L], right-padded with vocab_size (a scratch column)
    allowed_rows: Optional[torch.Tensor] = None
    allowed_ids: Optional[torch.Tensor] = None
    banned: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (rows [M], ids [M]) of bad words' next tokens
    bias: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None  # (rows [B], ids [B], values [B])


def build_token_constraints(params: Sequence[SamplingParams], output_token_ids: Sequence[Sequence[int]],
                            vocab_size: int, device: torch.device | str) -> Optional[TokenConstraints]:
    """None when no row is constrained; else the step's constraints in one int64 and one float32 copy."""
    if not any(p.logit_bias or p.allowed_token_ids or p.bad_words_token_ids for p in params):
        return None
    allowed = [(i, p.allowed_token_ids) for i, p in enumerate(params) if p.allowed_token_ids]
    banned_rows: list[int] = []
    banned_ids: list[int] = []
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_vals: list[float] = []
    for i, (p, out) in enumerate(zip(params, output_token_ids)):
        if p.bad_words_token_ids:
            ids = banned_by_bad_words(p.bad_words_token_ids, out)
            banned_rows += [i] * len(ids)
            banned_ids += ids
        if p.logit_bias:
            bias_rows += [i] * len(p.logit_bias)
            bias_ids += list(p.logit_bias)
            bias_vals += list(p.logit_bias.values())
    width = max((len(ids) for _, ids in allowed), default=0)
    padded = np.full((len(allowed), width), vocab_size, dtype=np.int64)
    for r, (_, ids) in enumerate(allowed):
        padded[r, :len(ids)] = ids
    parts = [np.array([i for i, _ in allowed], dtype=np.int64), padded.reshape(-1),
             np.array(banned_rows + banned_ids + bias_rows + bias_ids, dtype=np.int64)]
    packed = _to_device(torch.from_numpy(np.concatenate(parts)), device)
    c = TokenConstraints()
    a, b, m, nb = len(allowed), padded.size, len(banned_rows), len(bias_rows)
    if a:
        c.allowed_rows, c.allowed_ids = packed[:a], packed[a:a + b].view(a, width)
    rest = packed[a + b:]
    if m:
        c.banned = (rest[:m], rest[m:2 * m])
    if nb:
        values = _to_device(torch.tensor(bias_vals, dtype=torch.float32), device)
        c.bias = (rest[2 * m:2 * m + nb], rest[2 * m + nb:], values)
    return c


def apply_token_constraints(logits: torch.Tensor, c: TokenConstraints) -> torch.Tensor:
    """logits [N, V] float32, modified in place."""
    vocab = logits.shape[1]
    if c.allowed_rows is not None:
        keep = torch.zeros(c.allowed_ids.shape[0], vocab + 1, dtype=torch.bool, device=logits.device)
        keep.scatter_(1, c.allowed_ids, True)
        rows = logits.index_select(0, c.allowed_rows).masked_fill_(~keep[:, :vocab], float("-inf"))
        logits.index_copy_(0, c.allowed_rows, rows)
    if c.banned is not None:
        logits[c.banned] = float("-inf")  # a Python scalar: no host-to-device copy
    if c.bias is not None:
        rows, ids, values = c.bias
        logits.index_put_((rows, ids), values, accumulate=True)
    return logits


def _to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    # pinned on CUDA so the copy does not wait for the step in flight
    if torch.device(device).type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
