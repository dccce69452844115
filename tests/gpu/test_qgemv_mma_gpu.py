"""The tensor-core int4 GEMV (kernels/qgemv_mma.py, csrc/qgemv_mma.cu) on the GPU against the fp32 product of the
dequantized weight: the Qwen3-0.6B and Llama-3-8B layer shapes, 1..300 rows (row tiles of 8, several row blocks),
group sizes 64 / 128 / 256 / whole K, act-order, bias, fp16 and bf16, launch configs, CUDA-graph replay, and a
layer converted at load (quantization/tiled.py: use_mma_layout) against its internal layout."""
from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from pagedllm.kernels.qgemv_mma import dense_weight, dequantize_mma, quant_gemv_mma, to_mma_layout  # noqa: E402

SHAPES = [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024),  # Qwen3-0.6B qkv, o, gate_up, down
          (4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # Llama-3-8B


def _run(m, k, n, group=128, dtype=torch.bfloat16, perm=False, bias=False, config=None, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randint(0, 16, (n, k), device="cuda", generator=gen)
    groups = k // (k if group == -1 else group)
    scales = (torch.rand(groups, n, device="cuda", generator=gen) * 0.02).to(dtype)
    zeros = torch.randint(0, 16, (groups, n), device="cuda", generator=gen).to(dtype)
    p = torch.randperm(k, device="cuda", generator=gen).to(torch.int32) if perm else None
    words = to_mma_layout(q)
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    b = torch.randn(n, device="cuda", generator=gen).to(dtype) if bias else None
    ref = x.float() @ dequantize_mma(words, scales, zeros, group, p).t() + (b.float() if bias else 0)
    out = quant_gemv_mma(x, words, scales, zeros, group, p, b, config)
    assert out.shape == (m, n) and out.dtype == dtype
    err = (out.float() - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= 1e-2 * scale, (err, scale)
    return out


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("m", [1, 5, 8])
def test_model_shapes(k, n, m):
    _run(m, k, n, bias=m == 5)


@pytest.mark.parametrize("m", [9, 16, 33, 64, 100, 300])
def test_row_tiles_and_blocks(m):
    _run(m, 4096, 1024, perm=m == 33, bias=m == 100)


@pytest.mark.parametrize("group", [64, 128, 256, -1])
@pytest.mark.parametrize("perm", [False, True])
def test_group_sizes_and_act_order(group, perm):
    _run(3, 2048, 512, group=group, perm=perm)


@pytest.mark.parametrize("m", [2, 20])
def test_groups_of_three_chunks(m):
    """Group 192 (3 chunks, not a power of two): the kernel's group index takes the division path, units of 1 chunk."""
    _run(m, 1536, 512, group=192, perm=m == 20, bias=True)


@pytest.mark.parametrize("m", [1, 7, 40])
def test_fp16(m):
    _run(m, 4096, 2048, dtype=torch.float16, bias=True, perm=m == 7)


@pytest.mark.parametrize("config", [{"warps": 1, "unit": 1}, {"warps": 4, "unit": 2}, {"warps": 16, "unit": 4},
                                    {"warps": 8, "unit": 2, "mt": 2}, {"warps": 4, "depth": 8},
                                    {"warps": 16, "unit": 1, "depth": 3}, {"warps": 4, "ct": 2},
                                    {"warps": 2, "ct": 4, "depth": 3}, {"ct": 8, "mt": 2}, {"ct": 3}])
@pytest.mark.parametrize("m", [6, 20])
def test_launch_configs(config, m):
    """Every launch variant (warps, unit, units in flight, column tiles per block) gives the product; K = 4096
    leaves some warps fewer units than others at depth > 2; ct 3 (not a power of two) divides the 48 tiles."""
    _run(m, 4096, 768, group=256, config=config, perm=m == 20)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_zero_points_at_the_ends_of_the_range(dtype):
    """q - zero is made in the A registers by one paired add: exact for every (q, zero) pair, 0 and 15 included."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    k, n = 1024, 256
    q = torch.randint(0, 16, (n, k), device="cuda", generator=gen)
    q[:, :64] = 0
    q[:, 64:128] = 15
    groups = k // 64
    zeros = torch.randint(0, 16, (groups, n), device="cuda", generator=gen).to(dtype)
    zeros[0], zeros[1] = 15, 0
    scales = (torch.rand(groups, n, device="cuda", generator=gen) * 0.02 + 0.001).to(dtype)
    words = to_mma_layout(q)
    x = torch.randn(9, k, device="cuda", generator=gen).to(dtype)
    ref = x.float() @ dequantize_mma(words, scales, zeros, 64, None).t()
    out = quant_gemv_mma(x, words, scales, zeros, 64, None, None, {"depth": 3})
    assert (out.float() - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [64, 128, -1])
def test_dense_weight_of_the_many_rows_path(dtype, group):
    """csrc/qgemv_mma.cu's dequant_mma: exactly the fp32 dequantized weight rounded once to the dtype."""
    k, n = 2048, 768
    gen = torch.Generator(device="cuda").manual_seed(7)
    groups = k // (k if group == -1 else group)
    words = to_mma_layout(torch.randint(0, 16, (n, k), device="cuda", generator=gen))
    scales = (torch.rand(groups, n, device="cuda", generator=gen) * 0.02).to(dtype)
    zeros = torch.randint(0, 16, (groups, n), device="cuda", generator=gen).to(dtype)
    got = dense_weight(words, scales, zeros, group)
    assert got.shape == (n, k) and got.dtype == dtype
    torch.testing.assert_close(got, dequantize_mma(words, scales, zeros, group, None).to(dtype), atol=0, rtol=0)


def test_cuda_graph_replay():
    """Captured once, replayed on new inputs: the same answers as eager calls (no state between launches)."""
    k, n = 4096, 2048
    gen = torch.Generator(device="cuda").manual_seed(5)
    words = to_mma_layout(torch.randint(0, 16, (n, k), device="cuda", generator=gen))
    scales = (torch.rand(k // 128, n, device="cuda", generator=gen) * 0.02).bfloat16()
    zeros = torch.full((k // 128, n), 8.0, device="cuda").bfloat16()
    x = torch.randn(2, k, device="cuda", generator=gen).bfloat16()
    quant_gemv_mma(x, words, scales, zeros, 128)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = quant_gemv_mma(x, words, scales, zeros, 128)
    for _ in range(3):
        x.copy_(torch.randn(2, k, device="cuda", generator=gen).bfloat16())
        graph.replay()
        torch.testing.assert_close(out, quant_gemv_mma(x, words, scales, zeros, 128), atol=0, rtol=0)


def test_layer_converted_at_load_matches_internal_layout(monkeypatch):
    """A GPTQ layer loaded onto the GPU takes the mma layout; its product equals the internal layout's (the
    general dequant kernel, PAGEDLLM_QUANT_TILED=0) at decode and prefill row counts."""
    from pagedllm.layers.linear import RowParallelLinear
    from pagedllm.quantization.gptq import GPTQConfig

    def layer(act_order):
        gen = torch.Generator().manual_seed(0)
        with torch.device("cuda"):
            lin = RowParallelLinear(1024, 512, bias=False, params_dtype=torch.bfloat16,
                                    quant_config=GPTQConfig(4, 128, desc_act=act_order, sym=False), prefix="proj")
        for name, p in lin.named_parameters():
            if p.dtype == torch.int32 and name != "g_idx":
                p.data.copy_(torch.randint(-2**31, 2**31 - 1, p.shape, generator=gen, dtype=torch.int64).to(torch.int32))
            elif name != "g_idx":
                p.data.copy_(torch.rand(p.shape, generator=gen) * 0.02 + 0.001)
        if act_order:
            lin.g_idx.data.copy_(torch.argsort(torch.randperm(1024, generator=gen)).cuda() // 128)
        lin.linear_method.process_weights_after_loading(lin)
        return lin

    for act_order in (False, True):
        monkeypatch.setenv("PAGEDLLM_QUANT_TILED", "1")
        fast = layer(act_order)
        assert fast.quant_layout == "mma"
        monkeypatch.setenv("PAGEDLLM_QUANT_TILED", "0")
        slow = layer(act_order)
        assert slow.quant_layout == "internal"
        for rows in (1, 4, 40, 300):
            x = torch.randn(rows, 1024, device="cuda").bfloat16()
            want = slow.linear_method.apply(slow, x).float()
            got = fast.linear_method.apply(fast, x).float()
            assert (got - want).abs().max().item() <= 1e-2 * want.abs().max().item()
