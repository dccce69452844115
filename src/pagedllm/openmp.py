"""pagedllm's OpenMP wait policy in the process that imports it, without touching that process's environment.

libgomp reads OMP_WAIT_POLICY once, when it is loaded. pagedllm's OpenMP code runs in the libgomp copies that its
dependencies ship: torch's (torch's own threads and the C++ CPU kernels, which link the libgomp.so.1 torch has
loaded) and sentencepiece's (its tokenizers). So `import pagedllm` loads those copies first, with
envs.own_runtime_env() in os.environ only while they load: pagedllm's threads then spin briefly and sleep
between parallel regions, and os.environ, which every subprocess inherits, is as the user left it. A copy whose
package is already imported (too late), a policy the user chose, or a build without its own libgomp (a conda torch linking
another OpenMP) is left alone: set OMP_WAIT_POLICY yourself there. The processes pagedllm starts get the
variable in their environment instead (envs.child_env).
"""
from __future__ import annotations

import glob
import importlib.util
import os
import sys
from typing import Optional

from pagedllm import envs

_loaded_with: dict[str, str] = {}  # what libgomp was loaded under by load_with_own_policy (empty: not by it)


# Packages whose wheels ship the libgomp that runs pagedllm's OpenMP code.
OPENMP_PACKAGES = ("torch", "sentencepiece")


def bundled_libgomp(package: str) -> Optional[str]:
    """The libgomp file `package` loads (PKG/lib, or PKG.libs in auditwheel-repaired wheels), found without
    importing it; None where it ships none."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    pkg_dir = list(spec.submodule_search_locations)[0]
    for pattern in (os.path.join(pkg_dir, "lib", "libgomp*.so*"),
                    os.path.join(os.path.dirname(pkg_dir), package + ".libs", "libgomp*.so*")):
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def load_with_own_policy() -> list[str]:
    """Load the OPENMP_PACKAGES' libgomp copies not loaded yet under envs.own_runtime_env(); the files loaded."""
    own = envs.own_runtime_env()
    if not own or sys.platform != "linux":
        return []
    paths = [p for p in (bundled_libgomp(pkg) for pkg in OPENMP_PACKAGES if pkg not in sys.modules) if p]
    if not paths:
        return []
    import ctypes

    loaded = []
    with envs.environ_set(own):
        for path in paths:
            try:
                # RTLD_LOCAL (ctypes' default): loaded and configured now, its symbols bound later exactly as
                # they would be (the package's own load finds this copy by its soname).
                ctypes.CDLL(path)
            except OSError:
                continue
            loaded.append(path)
    if loaded:
        _loaded_with.update(own)
    return loaded


def wait_policy() -> str:
    """The OpenMP wait policy of this process's pagedllm threads, in words (benchmarks print it)."""
    if _loaded_with:
        return ", ".join(f"{k}={v}" for k, v in _loaded_with.items()) + " (pagedllm's, for its OpenMP runtime only)"
    if not envs.own_runtime_env():
        return f"the user's (OMP_WAIT_POLICY={envs.OMP_WAIT_POLICY}, GOMP_SPINCOUNT={envs.GOMP_SPINCOUNT})"
    return "libgomp's default (torch was imported before pagedllm)"
