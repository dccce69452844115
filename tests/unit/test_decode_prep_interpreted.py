"""qkv_prep's work inside the decode attention kernel (kernels/paged_attention.DecodePrep, PAGEDLLM_DECODE_PREP) in
Triton's interpreter on the CPU: one fp32 case of tests/gpu/test_qkv_prep.py (q / k norms, a padding row, splits)
run with PAGEDLLM_TEST_DEVICE=cpu; the other dtypes and batch shapes run on the GPU."""
from __future__ import annotations

from tests.triton_interpreter import needs_triton, run_gpu_tests_interpreted


@needs_triton
def test_decode_prep_interpreted():
    run_gpu_tests_interpreted("test_qkv_prep.py", "decode_prep and fp32-norm-short", "1 passed")
