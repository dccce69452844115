"""The CPU kernels (kernels/csrc/cpu_ops.cpp): built once per machine, loaded as `torch.ops.pagedllm_cpu`.

`cpu_ops()` returns the op namespace, or None when the kernels are disabled (PAGEDLLM_CPU_KERNELS=0) or cannot
be built here (no C++ compiler, say); every caller then keeps its plain-torch path, which computes the same
thing more slowly. The build goes to $PAGEDLLM_KERNEL_CACHE_DIR/<name> (default $PAGEDLLM_CACHE_DIR/cpu_kernels/<name>), where <name> hashes the source,
torch's version and this CPU's instruction-set flags (the code is built for the machine it runs on), so a
second start, or another process, loads it in well under a second.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import sys
import threading
import time
from typing import Any, Iterator, Optional

import torch

from pagedllm import envs

logger = logging.getLogger("pagedllm")

_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "cpu_ops.cpp")
# The quantized (GGUF block / int8 row) matmuls and the fused decoder stack, built into the same extension.
_SOURCES = [_SOURCE] + [os.path.join(os.path.dirname(__file__), "csrc", name) for name in ("gguf_ops.cpp",
                                                                                           "cpu_fused.cpp")]
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]
_lock = threading.Lock()
_state: dict[str, Any] = {}


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _build_name() -> str:
    src = b""
    for path in _SOURCES:
        with open(path, "rb") as f:
            src += f.read()
    key = b"|".join([src, torch.__version__.encode(), " ".join(_CFLAGS).encode(), platform.machine().encode(),
                     _cpu_flags().encode(), sys.version.encode()])
    return "pagedllm_cpu_" + hashlib.sha256(key).hexdigest()[:16]


def _path_with_ninja() -> str:
    """PATH with the venv's bin and the `ninja` wheel's directory: torch's extension builder runs `ninja` from
    PATH, and the venv's bin may not be on it."""
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja  # the PyPI package ships the binary

        dirs.append(ninja.BIN_DIR)
    except Exception:
        pass
    path = envs.PATH
    missing = [d for d in dirs if d and d not in path.split(os.pathsep)]
    return os.pathsep.join(missing + [path]) if missing else path


@contextlib.contextmanager
def _build_dir_flock(build_dir: str) -> Iterator[None]:
    """Serialize builders of one build directory with flock, which the kernel drops when a process dies.
    torch's own lock is a file that a build killed midway (Ctrl-C, a killed test run) leaves behind, after which
    every later start waits on it forever; holding the flock means no other pagedllm process is building here, so
    such a file is stale and is removed."""
    with open(os.path.join(build_dir, "pagedllm.flock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = os.path.join(build_dir, "lock")
            if os.path.exists(stale):
                logger.warning("Removing %s, left by a CPU-kernel build that did not finish.", stale)
                os.remove(stale)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _load() -> Any:
    if platform.system() != "Linux":
        raise RuntimeError("the CPU kernels are built for Linux only")
    from torch.utils import cpp_extension

    name = _build_name()
    build_dir = os.path.join(envs.PAGEDLLM_KERNEL_CACHE_DIR, name)
    os.makedirs(build_dir, exist_ok=True)
    built = os.path.exists(os.path.join(build_dir, f"{name}.so"))
    if not built:
        logger.info("Building the pagedllm CPU kernels for this machine (once; about 30 s) in %s", build_dir)
    t0 = time.perf_counter()
    with _build_dir_flock(build_dir), \
            envs.environ_set({"PATH": _path_with_ninja()}):  # the build takes its environment from os.environ
        cpp_extension.load(name=name, sources=_SOURCES, extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"],
                           build_directory=build_dir, is_python_module=False, verbose=False)
    if not built:
        logger.info("Built the CPU kernels in %.1f s.", time.perf_counter() - t0)
    return torch.ops.pagedllm_cpu


def cpu_ops() -> Optional[Any]:
    """`torch.ops.pagedllm_cpu`, built on first use; None if disabled or unavailable (logged once)."""
    if "ops" in _state:
        return _state["ops"]
    with _lock:
        if "ops" not in _state:
            ops = None
            if envs.PAGEDLLM_CPU_KERNELS:
                try:
                    ops = _load()
                except Exception as e:  # no compiler, no ninja, a build error: keep the torch path
                    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
                    compiler = [ln for ln in lines if "error:" in ln or "not found" in ln or "No such file" in ln]
                    errors = [ln for ln in lines if "error" in ln.lower()]
                    reason = (compiler or errors or lines or [type(e).__name__])[0][:300]
                    logger.warning("The pagedllm CPU kernels could not be built (%s); using the slower "
                                   "plain-torch CPU path. Set PAGEDLLM_CPU_KERNELS=0 to skip the attempt.", reason)
            _state["ops"] = ops
    return _state["ops"]


def usable(t: torch.Tensor) -> Optional[Any]:
    """The ops if `t` lives on the CPU in a dtype the kernels handle, else None."""
    if t.device.type != "cpu" or t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    return cpu_ops()
