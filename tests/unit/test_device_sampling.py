"""The one-kernel device sampler (kernels/sampling.py) in Triton's interpreter on the CPU: distributions against
the sort-based reference, greedy rows, masked tokens, seeded rows independent of their batch, the Sampler's wiring
(tests/unit/interpret_sampling.py; the large draws run on the GPU: tests/gpu/test_device_sampling_gpu.py)."""
from __future__ import annotations

import os

from tests.triton_interpreter import needs_triton, run_interpreted

HERE = os.path.dirname(os.path.abspath(__file__))


@needs_triton
def test_device_sampler_in_triton_interpreter():
    assert "device sampling ok" in run_interpreted(os.path.join(HERE, "interpret_sampling.py"))
