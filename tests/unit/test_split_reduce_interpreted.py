"""The split decode launch that reduces its own splits (kernels/paged_attention.py, PAGEDLLM_FUSED_SPLIT_REDUCE), in
Triton's interpreter on the CPU; the GPU runs the same comparisons in tests/gpu/test_attention_kernels.py."""
from __future__ import annotations

import os

from tests.triton_interpreter import needs_triton, run_interpreted

HERE = os.path.dirname(os.path.abspath(__file__))


@needs_triton
def test_fused_split_reduce_matches_the_reduce_kernel_and_reference():
    out = run_interpreted(os.path.join(HERE, "interpret_split_reduce.py"), timeout=600)
    assert "split reduce ok" in out
