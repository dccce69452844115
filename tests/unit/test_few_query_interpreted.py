"""The few-query split-KV attention kernel (speculative verify rows) in Triton's interpreter on the CPU: the GPU file
tests/gpu/test_few_query_attention.py run with PAGEDLLM_TEST_DEVICE=cpu (its fp32 GQA case; the MHA case, four
times slower interpreted, runs on the GPU)."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.triton_interpreter import needs_triton

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@needs_triton
def test_few_query_kernel_interpreted():
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-k", "not d32-h4-kv4",
         os.path.join(ROOT, "tests", "gpu", "test_few_query_attention.py")],
        env=dict(os.environ, TRITON_INTERPRET="1", PAGEDLLM_TEST_DEVICE="cpu"), capture_output=True, text=True,
        timeout=900, cwd=ROOT)
    assert r.returncode == 0 and " passed" in r.stdout and "failed" not in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]
