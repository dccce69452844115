"""The tiled-layout 4/8-bit kernels (kernels/qgemv.py: CUDA-core few-row GEMV; kernels/qgemm.py: tensor cores)
against the torch reference over the same weights. On the GPU: the Qwen3-0.6B and Llama-3-8B layer shapes, rows
1..512, group sizes 32 / 64 / 128 / -1, 4 and 8 bits, act-order, bias, CUDA-graph replay (the split-K counters
must be back at zero after every launch). Expected on an H200: the non-model-shape tests well under a minute,
test_model_shapes 1-2 minutes (mostly Triton compiles). On a CPU in Triton's interpreter at small shapes:
    PAGEDLLM_TEST_DEVICE=cpu TRITON_INTERPRET=1 pytest -m gpu tests/gpu/test_quant_tiled.py -k small"""
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

from pagedllm.kernels.qgemm import quant_gemm  # noqa: E402
from pagedllm.kernels.qgemv import QGEMV_MAX_ROWS, counters_for, quant_gemv  # noqa: E402
from pagedllm.quantization.packed import dequantize_packed  # noqa: E402
from pagedllm.quantization.tiled import to_tiled  # noqa: E402
from quant_cases import random_packed_weights  # noqa: E402


def _weights(k, n, bits, group_size, act_order, dtype, seed=0):
    """Random internal-layout weights -> (tiled qweight, scales, zeros, perm, dense [N, K] fp32 reference)."""
    group_size = k if group_size == -1 else group_size
    qweight, scales, zeros, g_idx = random_packed_weights(k, n, bits, group_size, act_order, dtype, seed)
    dense = dequantize_packed(qweight, scales.float(), zeros.float(), bits, group_size, g_idx)
    tiled, perm = to_tiled(qweight, bits, group_size, zeros, g_idx)
    move = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return move(tiled), move(scales), move(zeros), move(perm), group_size, dense.to(DEVICE)


def _run(kernel, m, k, n, bits, group_size, act_order, dtype, bias=False, config=None):
    qweight, scales, zeros, perm, group_size, dense = _weights(k, n, bits, group_size, act_order, dtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE) if bias else None
    counters = counters_for(n, x.device)
    out = kernel(x, qweight, scales, zeros, bits, group_size, perm, b, counters, config)
    ref = x.float() @ dense.t() + (b.float() if bias else 0)
    scale = ref.abs().amax().item() + 1e-6
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    err = (out.float() - ref).abs().max().item()
    assert err <= tol * scale, (err, scale)
    assert not counters.any(), "split-K counters must be back at zero"
    return out


def _pick(m):
    return quant_gemv if m <= QGEMV_MAX_ROWS else quant_gemm


SMALL_CFG_V = {"block_n": 32, "num_warps": 1, "programs_per_sm": 4, "max_split": 4}
SMALL_CFG_D = {"block_m": 16, "block_n": 32, "num_warps": 4, "programs_per_sm": 4, "max_split": 4}


@pytest.mark.parametrize("m", [1, 3, 8, 20])
@pytest.mark.parametrize("bits,group_size,act_order", [(4, 128, False), (4, 32, True), (8, 64, False),
                                                       (8, 16, True), (4, -1, False)])
def test_small_shapes(m, bits, group_size, act_order):
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    kernel = _pick(m)
    cfg = SMALL_CFG_V if kernel is quant_gemv else SMALL_CFG_D
    _run(kernel, m, 512, 96, bits, group_size, act_order, dtype, bias=m == 3, config=cfg)


@pytest.mark.parametrize("m", [1, 2, 4, 7, 8])
def test_small_gemm_at_gemv_sizes(m):
    """The tensor-core kernel at every row count the GEMV covers (the dispatch threshold is tunable)."""
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    _run(quant_gemm, m, 256, 64, 4, 64, False, dtype, bias=True, config=SMALL_CFG_D)


# (K, N) of every linear layer: Qwen3-0.6B (qkv, o, gate_up, down) and Llama-3-8B.
SHAPES_06B = [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024)]
SHAPES_8B = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]
gpu_only = pytest.mark.skipif(DEVICE != "cuda", reason="model shapes: GPU only")


# Few row counts and configs: every distinct launch config is a compile, and the GPU host compiles slowly.
@gpu_only
@pytest.mark.parametrize("k,n", SHAPES_06B + SHAPES_8B)
@pytest.mark.parametrize("m", [1, 2, 16, 64, 512])
@pytest.mark.parametrize("bits,group_size,act_order", [(4, 128, False), (4, 128, True)])
def test_model_shapes(k, n, m, bits, group_size, act_order):
    _run(_pick(m), m, k, n, bits, group_size, act_order, torch.bfloat16, bias=m == 16)


@gpu_only
@pytest.mark.parametrize("m", [1, 64])
def test_8bit_model_shape(m):
    _run(_pick(m), m, 14336, 4096, 8, 128, False, torch.bfloat16)


@gpu_only
@pytest.mark.parametrize("m", [1, 2, 8])
@pytest.mark.parametrize("group_size", [32, 64, -1])
def test_group_sizes_gemv(m, group_size):
    _run(quant_gemv, m, 4096, 4096, 4, group_size, False, torch.bfloat16)


@gpu_only
@pytest.mark.parametrize("m", [16, 64, 256])
@pytest.mark.parametrize("group_size", [32, 64, -1])
def test_group_sizes_gemm(m, group_size):
    _run(quant_gemm, m, 4096, 4096, 4, group_size, False, torch.bfloat16)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp16_and_bf16(dtype):
    for m in (1, 4, 32):
        _run(_pick(m), m, 2048, 1024, 4, 128, False, dtype, bias=True)


@gpu_only
@pytest.mark.parametrize("m", [1, 4, 16, 64])
def test_cuda_graph_replay(m):
    """Captured once, replayed on new inputs: the outputs follow the inputs and the counters stay consistent."""
    qweight, scales, zeros, perm, group_size, dense = _weights(4096, 4096, 4, 128, True, torch.bfloat16)
    counters = counters_for(4096, torch.device(DEVICE))
    kernel = _pick(m)
    x = torch.randn(m, 4096, device=DEVICE, dtype=torch.bfloat16)
    kernel(x, qweight, scales, zeros, 4, group_size, perm, None, counters)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel(x, qweight, scales, zeros, 4, group_size, perm, None, counters)
    for seed in range(3):
        x.copy_(torch.randn(m, 4096, generator=torch.Generator().manual_seed(seed)).to(x))
        graph.replay()
        torch.cuda.synchronize()
        ref = (x.float() @ dense.t()).to(torch.bfloat16)
        torch.testing.assert_close(out.float(), ref.float(), atol=1e-2 * ref.float().abs().max().item(), rtol=0)
        assert not counters.any()


@gpu_only
@pytest.mark.parametrize("m,k,n", [(1, 4096, 6144), (2, 4096, 28672)])
def test_split_k_partials_complete_under_repeats(m, k, n):
    """The shapes where the split-K GEMV once summed a stale partial (the last split counted itself done before
    another warp's partial stores were published): many back-to-back launches, every output exact to the
    reference. A race shows up in some launches only, hence the repeats."""
    qweight, scales, zeros, perm, group_size, dense = _weights(k, n, 4, 128, False, torch.bfloat16)
    counters = counters_for(n, torch.device(DEVICE))
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEVICE) for _ in range(8)]
    refs = [x.float() @ dense.t() for x in xs]
    outs = [quant_gemv(xs[i % 8], qweight, scales, zeros, 4, group_size, perm, None, counters) for i in range(64)]
    torch.cuda.synchronize()
    for i, out in enumerate(outs):
        ref = refs[i % 8]
        err = (out.float() - ref).abs().max().item()
        assert err <= 1e-2 * ref.abs().amax().item(), (i, err)
    assert not counters.any()
