"""Speculative decoding on the Triton attention backend, in Triton's interpreter on the CPU (the GPU versions are
tests/gpu/test_spec_decode_gpu.py)."""
from __future__ import annotations

import os

from tests.triton_interpreter import needs_triton, run_interpreted

HERE = os.path.dirname(os.path.abspath(__file__))


@needs_triton
def test_speculating_engine_on_interpreted_triton_backend(tiny_llama_dir):
    """The engine with speculation on the Triton backend (interpreted) equals the torch backend's plain greedy
    tokens; its verify steps run the prefill attention kernel over k + 1 query tokens per request."""
    out = run_interpreted(os.path.join(HERE, "interpret_spec_engine.py"), tiny_llama_dir, PAGEDLLM_FUSED_QKV="0",
                          PAGEDLLM_DECODE_MAX_SPLITS="1")
    assert "engine ok" in out
