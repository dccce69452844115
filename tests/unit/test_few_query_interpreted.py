"""The few-query split-KV attention kernel (speculative verify rows) in Triton's interpreter on the CPU: the GPU file
tests/gpu/test_few_query_attention.py run with PAGEDLLM_TEST_DEVICE=cpu (its fp32 GQA case; the MHA case, four
times slower interpreted, runs on the GPU)."""
from __future__ import annotations

from tests.triton_interpreter import needs_triton, run_gpu_tests_interpreted


@needs_triton
def test_few_query_kernel_interpreted():
    run_gpu_tests_interpreted("test_few_query_attention.py", "not d32-h4-kv4", " passed")
