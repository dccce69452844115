"""The fused MoE kernels in Triton's interpreter on the CPU, fp32: `TRITON_INTERPRET=1 python interpret_fused_moe.py`
(run in a subprocess by test_fused_moe_interpreted.py: TRITON_INTERPRET must be set before any kernel is defined).
Small shapes with ragged edges (hidden and intermediate sizes that are not multiples of the tiles, experts with no
tokens, one token); bf16/fp16 and real shapes are the GPU tests' (the interpreter's bf16 tl.dot is wrong)."""
from __future__ import annotations

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
    from tests.gpu.conftest import _tag_comparisons_as_int1  # noqa: F401 - importing it tags the comparisons
    from tests.lora.interpret_kernels import patch_interpreter_for_numpy2
    from tests.models.moe_kernel_cases import (check_align, check_fenced_equals_loops, check_fused, check_fused_routed,
                                               check_norm_router, check_route)

    patch_interpreter_for_numpy2()
    f32 = torch.float32
    check_route(5, 8, 2, True, f32, "cpu")
    check_route(3, 60, 4, False, f32, "cpu", seed=1)  # experts not a power of two
    check_route(2, 8, 1, True, f32, "cpu", seed=2)  # top-1: weight 1
    check_align(7, 8, 2, 16, "cpu")
    check_align(75, 64, 8, 16, "cpu", seed=1)  # 600 assignments: several programs, each counting and placing
    check_align(75, 64, 8, 32, "cpu", seed=4, skew=True)  # several programs, runs spanning programs, unused experts
    check_align(300, 8, 2, 32, "cpu", seed=2, skew=True)  # unused experts, one long run
    check_align(1, 8, 2, 16, "cpu", seed=3)
    for path in ("gemv", "grouped"):
        check_fused(1, 8, 2, 80, 48, f32, "cpu", path=path)
        check_fused(7, 8, 2, 64, 40, f32, "cpu", path=path, seed=1)
    check_fused(33, 6, 3, 48, 72, f32, "cpu", seed=2)  # auto: grouped
    check_fused(20, 4, 2, 32, 32, f32, "cpu", path="grouped", seed=3,
                config=dict(BLOCK_M=16, BLOCK_N=16, GATE_BLOCK_N=16, BLOCK_K=16, GROUP_M=2))  # several groups
    check_fused(3, 8, 2, 80, 48, f32, "cpu", path="gemv", seed=4,  # the sweep's gemv tiles: K in several steps,
                config=dict(GATE_BLOCK_N=2, GATE_BLOCK_K=32, BLOCK_N=8, BLOCK_K=16, num_warps=2))  # masked tails
    check_fused(7, 8, 2, 64, 40, f32, "cpu", path="torch", seed=1)  # torch._grouped_mm between the passes
    check_fused_routed(1, 8, 2, 80, 48, f32, "cpu")  # the routing inside the gate_up kernel
    check_fused_routed(2, 16, 4, 64, 40, f32, "cpu", renormalize=False, path="gemv", seed=5,
                       config=dict(GATE_BLOCK_N=4, GATE_BLOCK_K=32, BLOCK_N=2, BLOCK_K=16))  # K in several steps
    check_fused_routed(1, 60, 4, 48, 24, f32, "cpu", seed=6)  # experts not a power of two
    check_fused_routed(5, 8, 2, 48, 24, f32, "cpu", seed=7)  # auto: grouped, routed first
    check_fused_routed(5, 8, 2, 48, 24, f32, "cpu", path="gemv", seed=8)  # gemv with several tokens
    check_fenced_equals_loops(1, 8, 2, 80, 48, f32, "cpu", (True, True))  # masked tile tails
    check_fenced_equals_loops(2, 16, 8, 64, 40, f32, "cpu", (True, True), seed=1)  # top-8: narrower down rows
    check_fenced_equals_loops(1, 8, 2, 4096, 24, f32, "cpu", (False, True), seed=2)  # gate_up in two K steps
    check_norm_router(3, 8, 2, 96, 32, f32, "cpu")  # the router in the post-attention norm's kernel
    check_norm_router(1, 60, 4, 64, 24, f32, "cpu", seed=1)  # experts not a power of two
    print("fused moe kernels ok")


if __name__ == "__main__":
    main()
