"""Failures of one request inside an engine step (pure Python, shared by the core and its drivers)."""
from __future__ import annotations

from typing import Iterable


# The sampler's id for a row that no token may follow (its masks in conflict: layers/sampler.mark_no_token): outside
# the vocabulary, so the guard below fails that request alone, saying why.
NO_ALLOWED_TOKEN = -2


class RequestStepError(RuntimeError):
    """A step could not produce a valid result for these requests (e.g. the sampled-token guard below). The
    engine fails only them: EngineCore recovers its state (see EngineCore.step) and re-raises this so the driver
    reports an error for each id; every other request goes on."""

    def __init__(self, request_ids: Iterable[str], message: str, status: int = 500) -> None:
        super().__init__(message)
        self.request_ids = list(request_ids)
        self.message = message
        self.status = status  # the HTTP status a server reports: 400 where the request asked for the impossible
        self.outputs: list = []  # set by EngineCore: other requests' outputs this step had already applied


def check_sampled_tokens(req_ids: list[str], sampled: list[list[int]], vocab_size: int) -> None:
    """Guard: a sampled id outside the vocabulary means the request's logits were not finite numbers (NaN / inf
    from its inputs or its sampling parameters); that request cannot go on, the batch can."""
    flat = [t for tokens in sampled for t in tokens]
    if not flat or (min(flat) >= 0 and max(flat) < vocab_size):  # the usual case, checked in two C calls
        return
    bad = [rid for rid, tokens in zip(req_ids, sampled) if any(not 0 <= t < vocab_size for t in tokens)]
    if bad:
        if all(NO_ALLOWED_TOKEN in tokens for rid, tokens in zip(req_ids, sampled) if rid in bad):
            raise RequestStepError(bad, "no token satisfies this request's constraints at this point (its "
                                        "allowed_token_ids, bad_words, structured output and min_tokens together "
                                        "leave nothing to generate)", status=400)
        raise RequestStepError(bad, "the model produced no valid token for this request (non-finite logits)")
