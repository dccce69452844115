"""The runner's side of structured outputs: the plan's grammar bitmask -> one device tensor per step, in the
order of the rows that sample (rows of unconstrained requests allow every token)."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from pagedllm.core.batch_plan import BatchPlan
from pagedllm.core.errors import NO_ALLOWED_TOKEN
from pagedllm.layers.sampler import _to_device


def step_token_bitmask(plan: BatchPlan, req_ids: list[str], sample_rows: np.ndarray, device: torch.device,
                       counts: Optional[np.ndarray] = None) -> Optional[torch.Tensor]:
    """The step's mask, int32 [rows, W] on device, or None when no sampling row is under a grammar. Each request of
    `sample_rows` has counts[i] rows (default 1; a verify step's: 1 + its drafts) in order, taking its rows of the
    plan's bitmask from its first one there (one per verify position); other requests' rows allow every token."""
    if plan.grammar_bitmask is None:
        return None
    index = plan.structured_output_request_ids
    src = np.asarray(plan.grammar_bitmask, dtype=np.int32)
    rows = sample_rows.tolist()
    ns = [1] * len(rows) if counts is None else counts.tolist()
    picks, start = [], 0  # (first row here, first row in the plan's bitmask, rows)
    for r, n in zip(rows, ns):
        first = index.get(req_ids[r])
        if first is not None:
            picks.append((start, first, n))
        start += n
    if not picks:
        return None
    if len(picks) == len(rows) and start <= src.shape[0] and all(a == b for a, b, _ in picks):
        host = src[:start]  # every row under a grammar, in the plan's order (the usual all-grammar batch)
    else:
        host = np.full((start, src.shape[1]), -1, dtype=np.int32)
        for a, b, n in picks:
            host[a:a + n] = src[b:b + n]
    return _to_device(torch.from_numpy(np.ascontiguousarray(host)), device)


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
