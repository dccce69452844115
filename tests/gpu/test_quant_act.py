"""The one-kernel per-token FP8 activation quantization equals the torch reference bit for bit (values and
scales), short and long rows (one-pass and two-pass forms), odd sizes, zero rows. GPU only: Triton's CPU
interpreter rounds fp32 -> E4M3 wrongly next to powers of two (e.g. 31.36 -> 16), so it cannot check this kernel."""
from __future__ import annotations

import pytest
import torch

DEVICE = "cuda"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _reference(x: torch.Tensor):
    from pagedllm.quantization.kernels import FP8_INV_MAX

    scale = (x.abs().amax(dim=-1, keepdim=True).float() * FP8_INV_MAX).clamp(min=1e-12)
    return (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("rows,k", [(1, 1024), (7, 4096), (3, 14336), (5, 100), (2, 9000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_per_token_equals_torch(rows, k, dtype):
    from pagedllm.kernels.quant_act import fp8_per_token

    g = torch.Generator().manual_seed(rows * k)
    x = (torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 30).to(dtype)
    x[0, :] = 0 if rows > 3 else x[0, :]  # an all-zero row: the smallest scale
    x = x.to(DEVICE)
    q, scale = fp8_per_token(x)
    ref_q, ref_scale = _reference(x)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


def test_zero_rows_and_strided_input():
    from pagedllm.kernels.quant_act import fp8_per_token

    q, scale = fp8_per_token(torch.empty(0, 64, device=DEVICE))
    assert q.shape == (0, 64) and scale.shape == (0, 1)
    x = torch.randn(6, 256, device=DEVICE)[:, :128]  # rows with a stride of 256
    q, scale = fp8_per_token(x)
    ref_q, ref_scale = _reference(x)
    assert torch.equal(scale, ref_scale) and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
