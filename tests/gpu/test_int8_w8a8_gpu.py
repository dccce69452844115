"""The W8A8 INT8 kernels on the GPU (kernels/quant_act.int8_per_token, kernels/int8_gemm) at model-layer shapes,
with the engine's launch configs, against the torch form (the same checks run in Triton's interpreter in CI:
tests/quantization/test_int8_w8a8_kernels.py)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (installed with CUDA torch)")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "quantization"))
from int8_w8a8_cases import check_activation_quant, check_gemm  # noqa: E402


def test_activation_quant_matches_torch():
    check_activation_quant("cuda", ks=(64, 300, 4096, 14336))


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (1000, 3000)])
def test_gemm_default_launches_match_torch(n, k):
    check_gemm("cuda", [(m, n, k) for m in (1, 7, 16, 33, 64, 200, 1024)], [None], exact_bias=False)


def test_linear_against_torch_form():
    """int8_w8a8_linear on CUDA (the two kernels) equals its torch form (torch._int_mm), dynamic and static
    activation scales, 3-D input."""
    from pagedllm.kernels.int8_gemm import counters_for
    from pagedllm.quantization.kernels import int8_w8a8_linear, int8_w8a8_linear_torch

    gen = torch.Generator().manual_seed(2)
    w = torch.randint(-128, 128, (512, 1024), generator=gen, dtype=torch.int8).cuda()
    ws = (torch.rand(512, generator=gen) * 0.01 + 1e-4).cuda()
    counters = counters_for(512, torch.device("cuda"))
    for rows in (1, 12, 96):
        x = (torch.randn(2, rows, 1024, generator=gen) * 2).to(torch.bfloat16).cuda()
        for static in (None, torch.tensor([0.02], device="cuda")):
            got = int8_w8a8_linear(x, w, ws, None, static, counters)
            want = int8_w8a8_linear_torch(x.reshape(-1, 1024), w, ws, None, static).reshape(2, rows, 512)
            assert torch.equal(got, want), (rows, static)
