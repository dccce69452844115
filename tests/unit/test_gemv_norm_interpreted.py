"""The GEMV that computes the RMSNorm before it (kernels/gemv.GemvNorm, PAGEDLLM_NORM_GEMV) in Triton's interpreter on
the CPU: its cases of tests/gpu/test_small_kernels.py run with PAGEDLLM_TEST_DEVICE=cpu."""
from __future__ import annotations

from tests.triton_interpreter import needs_triton, run_gpu_tests_interpreted


@needs_triton
def test_gemv_with_norm_interpreted():
    run_gpu_tests_interpreted("test_small_kernels.py", "with_norm", "8 passed", timeout=600)
