"""The CUDA W8A8 kernels (int8 activation quantization, the GEMM with its split K) in Triton's interpreter: int8
exactly equal to the torch form, FP8 within fp32 accumulation of float64 sums."""
from __future__ import annotations

import os

from tests.triton_interpreter import needs_triton, run_interpreted

HERE = os.path.dirname(os.path.abspath(__file__))


@needs_triton
def test_int8_w8a8_kernels_in_triton_interpreter():
    out = run_interpreted(os.path.join(HERE, "interpret_int8.py"))
    assert "activation quant ok" in out and "int8 gemm ok" in out and "fp8 gemm ok" in out
