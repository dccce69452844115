"""qkv_prep's work inside the decode attention kernel (kernels/paged_attention.DecodePrep, PAGEDLLM_DECODE_PREP) in
Triton's interpreter on the CPU: one fp32 case of tests/gpu/test_qkv_prep.py (q / k norms, a padding row, splits)
run with PAGEDLLM_TEST_DEVICE=cpu; the other dtypes and batch shapes run on the GPU."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.triton_interpreter import needs_triton

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@needs_triton
def test_decode_prep_interpreted():
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-k",
         "decode_prep and fp32-norm-short", os.path.join(ROOT, "tests", "gpu", "test_qkv_prep.py")],
        env=dict(os.environ, TRITON_INTERPRET="1", PAGEDLLM_TEST_DEVICE="cpu"), capture_output=True, text=True,
        timeout=900, cwd=ROOT)
    assert r.returncode == 0 and "1 passed" in r.stdout and "failed" not in r.stdout, (
        r.stdout[-4000:] + r.stderr[-2000:])
