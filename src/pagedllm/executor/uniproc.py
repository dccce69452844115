"""The single-device executor: the Worker in the engine core's own process (no IPC, no extra copies)."""
from __future__ import annotations

from pagedllm.worker.worker import Worker


class UniprocExecutor(Worker):
    """Exactly the in-process Worker; the engine core calls its launch/execute_model directly."""

    world_size = 1

    def check_health(self) -> None:
        return None
