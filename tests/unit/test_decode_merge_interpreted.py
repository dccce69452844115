"""The split decode's merge in its last program (kernels/paged_attention._merge_slices, PAGEDLLM_DECODE_MERGE) in
Triton's interpreter on the CPU: the fp32 MQA-like case of tests/gpu/test_attention_kernels.py test_decode_merge
(split counts, start orders, a sliding window, zero-length rows, the counters reset) run with
PAGEDLLM_TEST_DEVICE=cpu; the 16-bit cases and CUDA-graph replays run on the GPU."""
from __future__ import annotations

from tests.triton_interpreter import needs_triton, run_gpu_tests_interpreted


@needs_triton
def test_decode_merge_interpreted():
    run_gpu_tests_interpreted("test_attention_kernels.py", "test_decode_merge and d64-h8-kv1-bs32-float32", "1 passed")
