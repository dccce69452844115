"""Helpers shared by the engine process (entrypoints/engine_proc.py) and the worker ranks (executor/worker_proc.py)."""
from __future__ import annotations

import os
import threading
import time


def watch_parent(exit_code: int, interval_s: float = 0.5) -> None:
    """Exit with `exit_code` as soon as the process that started this one is gone, whatever the main thread is
    doing (mid-step, or blocked on a peer that will never answer): an orphan would hold its memory and device."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                os._exit(exit_code)

    threading.Thread(target=watch, name="pagedllm-parent-watchdog", daemon=True).start()


def one_line(e: BaseException, user_errors: tuple[type, ...] = (ValueError,)) -> str:
    """An error as one line for another process: a user error as its sentence, anything else with its type."""
    lines = str(e).strip().splitlines()
    text = lines[0] if lines else ""
    if isinstance(e, user_errors) and text:
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
