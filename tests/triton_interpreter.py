"""Running a script in Triton's interpreter on the CPU, for the tests that check the GPU kernels in CI.

A subprocess because TRITON_INTERPRET must be set before any kernel is compiled, and a process that already
compiled (or imported) kernels cannot switch."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def run_interpreted(script: str, *args: str, timeout: int = 600, **env: str) -> str:
    """Run `script` with `args` under TRITON_INTERPRET=1 (plus `env`); assert it exits 0 and return its stdout."""
    r = subprocess.run([sys.executable, script, *args], env=dict(os.environ, TRITON_INTERPRET="1", **env),
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r.stdout


def run_gpu_tests_interpreted(test_file: str, select: str, passed: str, timeout: int = 900) -> None:
    """Run the cases `select` (pytest -k) of a tests/gpu file in Triton's interpreter on the CPU
    (PAGEDLLM_TEST_DEVICE=cpu) and assert that `passed` (e.g. "8 passed") and no failure are reported."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-k", select,
         os.path.join(root, "tests", "gpu", test_file)],
        env=dict(os.environ, TRITON_INTERPRET="1", PAGEDLLM_TEST_DEVICE="cpu"), capture_output=True, text=True,
        timeout=timeout, cwd=root)
    assert r.returncode == 0 and passed in r.stdout and "failed" not in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]
