"""The GEMV that computes the RMSNorm before it (kernels/gemv.GemvNorm, PAGEDLLM_NORM_GEMV) in Triton's interpreter on
the CPU: its cases of tests/gpu/test_small_kernels.py run with PAGEDLLM_TEST_DEVICE=cpu."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.triton_interpreter import needs_triton

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@needs_triton
def test_gemv_with_norm_interpreted():
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-k", "with_norm",
         os.path.join(ROOT, "tests", "gpu", "test_small_kernels.py")],
        env=dict(os.environ, TRITON_INTERPRET="1", PAGEDLLM_TEST_DEVICE="cpu"), capture_output=True, text=True,
        timeout=600, cwd=ROOT)
    assert r.returncode == 0 and "8 passed" in r.stdout and "failed" not in r.stdout, (
        r.stdout[-4000:] + r.stderr[-2000:])
