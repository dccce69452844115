"""The Triton LoRA shrink/expand kernels against their torch references, in Triton's interpreter on the CPU
(small shapes; the GPU versions of these cases are tests/gpu/test_lora_gpu.py)."""
from __future__ import annotations

import os
import sys

from tests.triton_interpreter import needs_triton, run_interpreted

HERE = os.path.dirname(os.path.abspath(__file__))


@needs_triton
def test_kernels_in_triton_interpreter():
    assert "lora kernels ok" in run_interpreted(os.path.join(HERE, "interpret_kernels.py"), timeout=300)


def test_cpu_batched_delta_matches_reference():
    """The engine's CPU path (two matmuls over all slots, masked per token) equals the per-token reference."""
    import torch

    sys.path.insert(0, HERE)
    from lora_kernel_cases import build_case

    from pagedllm.lora.layers import batched_lora_delta

    for seed, (t, s, k, slices, r, rp) in enumerate([(7, 3, 40, [24, 8, 8], 8, 16), (12, 1, 33, [50], 16, 16),
                                                     (9, 4, 16, [10, 10], 3, 32)]):
        x, a, b, slots, spans, out = build_case(t, s, k, slices, r, rp, torch.float32, "cpu", seed=seed)
        expected = torch.zeros_like(out)
        for i, slot in enumerate(slots.tolist()):
            if slot >= 0:
                h = a[slot] @ x[i]
                for j, (off, n) in enumerate(spans):
                    expected[i, off:off + n] = h[j * rp:(j + 1) * rp] @ b[slot, :, off:off + n]
        got = batched_lora_delta(x, a, b, slots, spans)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        assert torch.all(got[slots < 0] == 0)
