"""The speculative verify attention kernel and the skinny GEMM in Triton's interpreter on the CPU (small shapes,
fp32 / fp16); the GPU version with bf16 and CUDA-graph replay is tests/gpu/test_verify_gpu.py."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_verify_kernel_in_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PAGEDLLM_VERIFY_ATTENTION="1")
    r = subprocess.run([sys.executable, os.path.join(HERE, "interpret_verify_attention.py")], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "verify attention ok" in r.stdout and "skinny gemm ok" in r.stdout


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_speculating_engine_on_interpreted_triton_backend(tiny_llama_dir):
    """The engine with speculation on the Triton backend (interpreted) equals the torch backend's plain greedy
    tokens: eagerly, and through VerifyGraphRunner.run's padded static buffers (graphs replaced by eager replays)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PAGEDLLM_VERIFY_ATTENTION="1", PAGEDLLM_FUSED_QKV="0",
               PAGEDLLM_DECODE_MAX_SPLITS="1")
    r = subprocess.run([sys.executable, os.path.join(HERE, "interpret_verify_attention.py"), "engine", tiny_llama_dir],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "engine ok" in r.stdout and "verify graph runner ok" in r.stdout
