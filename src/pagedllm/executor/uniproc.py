"""The single-device executor: the Worker in the engine core's own process (no IPC, no extra copies)."""
from __future__ import annotations

import functools
from typing import Any, Optional

from pagedllm.worker.worker import Worker


def rpc_method(worker: Any, method: Any) -> Any:
    """The worker's public method `method` (collective_rpc), or a ValueError naming what was asked. A callable
    (vLLM's collective_rpc takes one too) runs with the worker as its first argument."""
    if callable(method) and not isinstance(method, str):
        return functools.partial(method, worker)
    fn = getattr(worker, method, None) if isinstance(method, str) and not method.startswith("_") else None
    if not callable(fn):
        raise ValueError(f"collective_rpc: the worker has no public method {method!r}.")
    return fn


class UniprocExecutor(Worker):
    """Exactly the in-process Worker; the engine core calls its launch/execute_model directly."""

    world_size = 1

    def check_health(self) -> None:
        return None

    def collective_rpc(self, method: str, args: tuple = (), kwargs: Optional[dict] = None) -> list:
        """vLLM's collective_rpc over the one in-process rank: its answer in a list."""
        return [rpc_method(self, method)(*args, **(kwargs or {}))]
