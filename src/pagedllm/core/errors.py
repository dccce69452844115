"""Failures of one request inside an engine step (pure Python, shared by the core and its drivers)."""
from __future__ import annotations

from typing import Iterable


class RequestStepError(RuntimeError):
    """A step could not produce a valid result for these requests (e.g. the sampled-token guard below). The
    engine fails only them: EngineCore recovers its state (see EngineCore.step) and re-raises this so the driver
    reports an error for each id; every other request goes on."""

    def __init__(self, request_ids: Iterable[str], message: str) -> None:
        super().__init__(message)
        self.request_ids = list(request_ids)
        self.message = message
        self.outputs: list = []  # set by EngineCore: other requests' outputs this step had already applied


def check_sampled_tokens(req_ids: list[str], sampled: list[list[int]], vocab_size: int) -> None:
    """Guard: a sampled id outside the vocabulary means the request's logits were not finite numbers (NaN / inf
    from its inputs or its sampling parameters); that request cannot go on, the batch can."""
    flat = [t for tokens in sampled for t in tokens]
    if not flat or (min(flat) >= 0 and max(flat) < vocab_size):  # the usual case, checked in two C calls
        return
    bad = [rid for rid, tokens in zip(req_ids, sampled) if any(not 0 <= t < vocab_size for t in tokens)]
    if bad:
        raise RequestStepError(bad, "the model produced no valid token for this request (non-finite logits)")
