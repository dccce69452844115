"""Parallel sampling (`n` > 1): one user request becomes n independent engine requests, written once for the
offline LLM and the server's AsyncEngine. The OutputProcessor folds the children back under the parent id."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pagedllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class ChildRequest:
    request_id: str  # the engine's id: the parent's own id when n == 1, else f"{index}_{parent}"
    params: SamplingParams  # n=1; a seeded parent gives child i the seed + i (distinct, reproducible samples)
    parent_id: Optional[str]  # None when n == 1 (the request is its own parent)
    index: int


def fan_out(request_id: str, params: SamplingParams) -> list[ChildRequest]:
    if params.n == 1:
        return [ChildRequest(request_id, params, None, 0)]
    children = []
    for index in range(params.n):
        seed = None if params.seed is None else params.seed + index
        children.append(ChildRequest(f"{index}_{request_id}", params.clone(n=1, best_of=1, seed=seed),
                                     request_id, index))
    return children
