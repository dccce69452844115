"""The one-kernel device sampler (kernels/sampling.py) in Triton's interpreter on the CPU: distributions against
the sort-based reference, greedy rows, masked tokens, seeded rows independent of their batch, the Sampler's wiring
(tests/unit/interpret_sampling.py; the large draws run on the GPU: tests/gpu/test_device_sampling_gpu.py)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_device_sampler_in_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, os.path.join(HERE, "interpret_sampling.py")], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "device sampling ok" in r.stdout
