"""Speculative decoding on the Triton attention backend, in Triton's interpreter on the CPU (the GPU versions are
tests/gpu/test_spec_decode_gpu.py)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_speculating_engine_on_interpreted_triton_backend(tiny_llama_dir):
    """The engine with speculation on the Triton backend (interpreted) equals the torch backend's plain greedy
    tokens; its verify steps run the prefill attention kernel over k + 1 query tokens per request."""
    env = dict(os.environ, TRITON_INTERPRET="1", PAGEDLLM_FUSED_QKV="0", PAGEDLLM_DECODE_MAX_SPLITS="1")
    r = subprocess.run([sys.executable, os.path.join(HERE, "interpret_spec_engine.py"), tiny_llama_dir], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "engine ok" in r.stdout
