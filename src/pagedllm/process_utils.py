"""Helpers shared by the server's processes: the engine process (entrypoints/engine_proc.py), the worker ranks
(executor/worker_proc.py) and the API server processes."""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from typing import Optional

logger = logging.getLogger(__name__)

# A Unix socket's path holds at most 107 bytes (sockaddr_un); the longest name put in a socket directory
# ("in-<client>-<engine>.sock") fits in the rest.
_SOCKET_PATH_MAX = 107
_SOCKET_NAME_MAX = 24


def socket_directory(prefix: str) -> str:
    """A private directory (tempfile.mkdtemp) for ipc:// sockets: in the temp directory (TMPDIR) unless its path is
    too long for a socket's (a job's deep TMPDIR on a cluster), then in /tmp."""
    directory = tempfile.mkdtemp(prefix=prefix)
    if len(directory) + 1 + _SOCKET_NAME_MAX <= _SOCKET_PATH_MAX:
        return directory
    os.rmdir(directory)
    fallback = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    if len(fallback) + 1 + _SOCKET_NAME_MAX > _SOCKET_PATH_MAX:  # (only a very odd /tmp)
        os.rmdir(fallback)
        raise RuntimeError(f"No directory for the processes' sockets: {directory} and {fallback} are too long for a "
                           f"Unix socket path ({_SOCKET_PATH_MAX} bytes); set TMPDIR to a short directory.")
    logger.info("The temp directory's path is too long for Unix sockets; the process sockets go in %s.", fallback)
    return fallback


def watch_parent(exit_code: int, interval_s: float = 0.5, leftovers: Optional[str] = None) -> None:
    """Exit with `exit_code` as soon as the process that started this one is gone, whatever the main thread is
    doing (mid-step, or blocked on a peer that will never answer): an orphan would hold its memory and device.
    `leftovers`: a directory the parent owned, removed first (a killed parent could not: its socket files would
    stay in /tmp)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                if leftovers:
                    shutil.rmtree(leftovers, ignore_errors=True)
                os._exit(exit_code)

    threading.Thread(target=watch, name="pagedllm-parent-watchdog", daemon=True).start()


def end_process(proc, grace_s: float = 3) -> None:
    """A multiprocessing child still alive after its shutdown was asked for: SIGTERM, then SIGKILL, each given
    grace_s to take effect."""
    if proc.is_alive():
        proc.terminate()
        proc.join(grace_s)
    if proc.is_alive():
        proc.kill()
        proc.join(grace_s)


def one_line(e: BaseException, user_errors: tuple[type, ...] = (ValueError,)) -> str:
    """An error as one line for another process: a user error as its sentence, anything else with its type."""
    lines = str(e).strip().splitlines()
    text = lines[0] if lines else ""
    if isinstance(e, user_errors) and text:
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def set_process_name(name: str) -> None:
    """Name this process in `ps -o comm` / top (Linux; at most 15 characters): the server's processes all run
    the same `python -c ... spawn_main` command line. A no-op where prctl is missing."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(15, name.encode()[:15] + b"\0", 0, 0, 0)  # 15 = PR_SET_NAME
    except (OSError, AttributeError):
        pass
