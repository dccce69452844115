"""The 4/8-bit dequant matmul Triton kernel against its torch reference. On the GPU over the Qwen3-0.6B and
Llama-3-8B layer shapes and rows 1..512; on a CPU in Triton's interpreter at small shapes:
    PAGEDLLM_TEST_DEVICE=cpu TRITON_INTERPRET=1 pytest -m gpu tests/gpu/test_dequant_gemm.py"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (installed with CUDA torch)")

from attention_cases import kernel_test_device  # noqa: E402

DEVICE = kernel_test_device()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("stale_cuda_memory"),  # outputs and split-K partials start as NaN (conftest.py)
]

from pagedllm.kernels.dequant_gemm import dequant_matmul, dequant_matmul_ref  # noqa: E402
from quant_cases import random_packed_weights  # noqa: E402


def _weights(k, n, bits, group_size, act_order, dtype, seed=0):
    return [t.to(DEVICE) if t is not None else None
            for t in random_packed_weights(k, n, bits, group_size, act_order, dtype, seed)]


def _check(m, k, n, bits, group_size, act_order, dtype, bias=False, num_sms=None):
    qweight, scales, zeros, g_idx = _weights(k, n, bits, group_size, act_order, dtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    b = torch.randn(n).to(dtype).to(DEVICE) if bias else None
    out = dequant_matmul(x, qweight, scales, zeros, bits, group_size, g_idx, b, num_sms=num_sms)
    ref = dequant_matmul_ref(x, qweight, scales, zeros, bits, group_size, g_idx, b)
    scale = ref.float().abs().amax().item() + 1e-6
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (out.float() - ref.float()).abs().max().item() <= tol * scale


SMALL = [(m, k, n) for m in (1, 3, 8, 20) for k, n in ((256, 96),)] + [(70, 128, 64)]


@pytest.mark.parametrize("m,k,n", SMALL)
@pytest.mark.parametrize("bits,group_size,act_order", [(4, 32, False), (8, 64, True), (4, 256, False)])
def test_small_shapes(m, k, n, bits, group_size, act_order):
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    group_size = min(group_size, k)
    _check(m, k, n, bits, group_size, act_order, dtype, bias=m == 3)


@pytest.mark.parametrize("m", [1, 5, 12])
def test_split_k(m):
    from pagedllm.kernels.dequant_gemm import launch_config
    assert launch_config(m, 64, 2048, num_sms=64)["SPLIT_K"] > 1
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    _check(m, 2048, 64, 4, 128, False, dtype, bias=True, num_sms=64)


# (K, N) of every linear layer: Qwen3-0.6B (qkv, o, gate_up, down) and Llama-3-8B.
SHAPES_06B = [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024)]
SHAPES_8B = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]


@pytest.mark.skipif(DEVICE != "cuda", reason="model shapes: GPU only")
@pytest.mark.parametrize("k,n", SHAPES_06B + SHAPES_8B)
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16, 64, 512])
@pytest.mark.parametrize("bits,group_size,act_order", [(4, 128, False), (8, 128, False), (4, 128, True)])
def test_model_shapes(k, n, m, bits, group_size, act_order):
    _check(m, k, n, bits, group_size, act_order, torch.bfloat16)
