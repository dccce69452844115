"""The runner's side of structured outputs: the plan's grammar bitmask -> one device tensor per step, in the
order of the rows that sample (rows of unconstrained requests allow every token)."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from pagedllm.core.batch_plan import BatchPlan
from pagedllm.core.errors import NO_ALLOWED_TOKEN
from pagedllm.layers.sampler import _to_device


def step_token_bitmask(plan: BatchPlan, req_ids: list[str], sample_rows: np.ndarray,
                       device: torch.device) -> Optional[torch.Tensor]:
    """int32 [len(sample_rows), W] on device, or None when no sampling row is under a grammar."""
    if plan.grammar_bitmask is None:
        return None
    index = plan.structured_output_request_ids
    src = np.asarray(plan.grammar_bitmask, dtype=np.int32)
    picks = [(j, index[req_ids[r]]) for j, r in enumerate(sample_rows.tolist()) if req_ids[r] in index]
    if not picks:
        return None
    if len(picks) == len(sample_rows) and all(j == k for j, k in picks):
        host = src[:len(picks)]
    else:
        host = np.full((len(sample_rows), src.shape[1]), -1, dtype=np.int32)
        dst_rows, src_rows = zip(*picks)
        host[list(dst_rows)] = src[list(src_rows)]
    return _to_device(torch.from_numpy(np.ascontiguousarray(host)), device)


def verify_token_bitmask(plan: BatchPlan, req_ids: list[str], sample_rows: np.ndarray, starts: np.ndarray,
                         counts: np.ndarray, device: torch.device) -> Optional[torch.Tensor]:
    """A verify step's mask: int32 [verify rows, W] on device, or None when no verifying request is under a grammar.
    A request's counts[i] rows (1 + its drafts) take its rows of the plan's bitmask, from its first one there (one
    per verify position); other requests' rows allow every token."""
    if plan.grammar_bitmask is None:
        return None
    index = plan.structured_output_request_ids
    src = np.asarray(plan.grammar_bitmask, dtype=np.int32)
    host = None
    for r, start, n in zip(sample_rows.tolist(), starts.tolist(), counts.tolist()):
        first = index.get(req_ids[r])
        if first is None:
            continue
        if host is None:
            host = np.full((int(starts[-1] + counts[-1]), src.shape[1]), -1, dtype=np.int32)
        host[start:start + n] = src[first:first + n]
    if host is None:
        return None
    return _to_device(torch.from_numpy(host), device)


def greedy_token_ids(model: torch.nn.Module, hidden: torch.Tensor,
                     token_bitmask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The model's greedy LM-head shortcut, honouring the bitmask; None where there is none (or it cannot mask)."""
    fn = getattr(model, "greedy_token_ids", None)
    if fn is None:
        return None
    if token_bitmask is None:
        return fn(hidden)
    try:
        ids = fn(hidden, token_bitmask=token_bitmask)
    except TypeError:  # a model whose shortcut knows no mask: the sampler path applies it
        return None
    if ids is None:
        return None
    # A row whose grammar allows no token at all gets NO_ALLOWED_TOKEN, as the sampler path marks it: the request
    # then fails saying why, instead of taking a token its grammar refuses (once an "abort" with no reason).
    dead = ~token_bitmask.any(dim=1)
    return torch.where(dead.view(-1, *([1] * (ids.dim() - 1))), torch.full_like(ids, NO_ALLOWED_TOKEN), ids)
