"""Speculative-decoding counters (vLLM's metric names), kept by the scheduler; pure Python."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Cumulative: drafts = request-steps that verified at least one draft token."""

    num_spec_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [k]: how often the draft at position i (0-based) was accepted.
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify step (accepted drafts + the one the target always adds)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def summary(self) -> str:
        per_pos = ", ".join(f"{n / self.num_drafts:.2f}" if self.num_drafts else "0" for n in
                            self.num_accepted_tokens_per_pos)
        return (f"SpecDecoding metrics: acceptance rate {100 * self.acceptance_rate:.1f}%, mean acceptance length "
                f"{self.mean_acceptance_length:.2f}, accepted tokens {self.num_accepted_tokens}, drafted tokens "
                f"{self.num_draft_tokens}, drafts {self.num_drafts}, per-position acceptance [{per_pos}]")


def draft_room(num_output_tokens: int, num_tokens: int, max_tokens, max_model_len: int) -> int:
    """Most drafts worth verifying: a step emits up to drafts + 1 tokens, which must stay within max_tokens and
    max_model_len (drafts past the end could only be thrown away)."""
    room = max_model_len - num_tokens - 1
    if max_tokens is not None:
        room = min(room, max_tokens - num_output_tokens - 1)
    return max(0, room)


class SpecLogger:
    """The periodic acceptance log line (every interval_s while drafts are being verified)."""

    def __init__(self, stats: SpecDecodeStats, interval_s: float = 10.0) -> None:
        import time

        self._time = time.monotonic
        self.stats = stats
        self.interval_s = interval_s
        self._last = self._time()
        self._last_drafts = 0

    def maybe_log(self) -> None:
        now = self._time()
        if now - self._last < self.interval_s or self.stats.num_drafts == self._last_drafts:
            return
        import logging

        logging.getLogger("pagedllm").info(self.stats.summary())
        self._last, self._last_drafts = now, self.stats.num_drafts
