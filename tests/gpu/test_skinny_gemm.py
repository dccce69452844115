"""The Triton skinny GEMM (decode-sized linear layers) against an fp32 reference, and its cuBLAS-vs-Triton
selector (GPU only; PAGEDLLM_TEST_DEVICE=cpu runs the kernel in Triton's interpreter)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attention_cases import kernel_test_device

DEVICE = kernel_test_device()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from pagedllm.kernels.skinny_gemm import SkinnyGemmSelector, skinny_gemm  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("n,k,bias", [(4096, 4096, False), (6144, 1024, True), (1000, 3000, False), (33, 200, True)])
def test_skinny_gemm_matches_fp32_reference(rows, n, k, bias, dtype):
    gen = torch.Generator().manual_seed(rows * 7 + n)
    x = torch.randn(rows, k, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None
    out = skinny_gemm(x, w, b)
    ref = x.float() @ w.float().T + (b.float() if bias else 0)
    assert out.dtype == dtype and out.shape == (rows, n)
    # fp32 accumulation, one rounding to the output dtype (as cuBLAS).
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=1e-2)


def test_skinny_gemm_strided_rows():
    x = torch.randn(4, 512, device=DEVICE).to(torch.float16)[:, :256]  # rows strided by 512
    w = torch.randn(64, 256, device=DEVICE).to(torch.float16)
    torch.testing.assert_close(skinny_gemm(x, w).float(), x.float() @ w.float().T, atol=5e-2, rtol=1e-2)


@pytest.mark.skipif(DEVICE != "cuda", reason="times kernels under CUDA graphs")
def test_selector_decides_once_per_bucket_and_never_while_capturing():
    sel = SkinnyGemmSelector()
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(3, 4096, device="cuda", dtype=torch.bfloat16)
    first = sel.use_skinny(x, w, None)
    assert isinstance(first, bool) and len(sel._wins) == 1
    assert sel.use_skinny(x[:4], w, None) == first and len(sel._wins) == 1  # 3 and 4 rows share bucket 4
    # Not for fp32, big batches or CPU tensors.
    assert not sel.use_skinny(x.float(), w.float(), None)
    assert not sel.use_skinny(torch.randn(17, 4096, device="cuda", dtype=torch.bfloat16), w, None)
    # During a capture an unseen shape falls back to cuBLAS without timing anything.
    x1 = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decided = sel.use_skinny(x1, w, None)
        y = F.linear(x1, w)
    assert decided is False and len(sel._wins) == 1
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y.float(), (x1.float() @ w.float().T), atol=0.1, rtol=2e-2)
