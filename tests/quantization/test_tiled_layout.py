"""The CUDA kernels' tiled 4/8-bit layout (quantization/tiled.py), on the CPU: GPTQ (act-order, v1 zeros, 4 and 8
bits), AWQ and compressed-tensors layers converted to it compute the same products and dequantize to the same
weight as the internal layout; where it cannot hold a weight the layer keeps the internal layout. The kernels over
it run in Triton's interpreter (subprocess, when triton is installed); on a GPU, tests/gpu/test_quant_tiled.py."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from pagedllm.layers.linear import RowParallelLinear
from pagedllm.quantization.awq import AWQConfig
from pagedllm.quantization.gptq import GPTQConfig
from pagedllm.quantization.tiled import tiled_layout_problem, to_tiled, use_tiled_layout


def _random_fill(layer, gen):
    for name, p in layer.named_parameters():
        if name == "g_idx":
            continue
        if p.dtype == torch.int32:
            p.data.copy_(torch.randint(-2**31, 2**31 - 1, p.shape, generator=gen, dtype=torch.int64).to(torch.int32))
        else:
            p.data.copy_(torch.rand(p.shape, generator=gen) * 0.02 + 0.001)


def _layer(config, k, n, act_order=False, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    layer = RowParallelLinear(k, n, bias=False, params_dtype=dtype, quant_config=config, prefix="proj")
    _random_fill(layer, gen)
    if act_order:
        layer.g_idx.data.copy_(torch.argsort(torch.randperm(k, generator=gen)) // config.group_size)
    layer.linear_method.process_weights_after_loading(layer)
    return layer


CASES = [
    ("gptq 4-bit g128", GPTQConfig(4, 128, desc_act=False, sym=True), False),
    ("gptq 4-bit g32 act-order asym", GPTQConfig(4, 32, desc_act=True, sym=False), True),
    ("gptq 8-bit g64 act-order", GPTQConfig(8, 64, desc_act=True, sym=True), True),
    ("gptq 4-bit g-1", GPTQConfig(4, -1, desc_act=False, sym=False), False),
    ("awq g128", AWQConfig(4, 128, zero_point=True), False),
    ("awq g16", AWQConfig(4, 16, zero_point=True), False),
]


@pytest.fixture(autouse=True)
def _tiled_on(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_QUANT_TILED", raising=False)  # the default


@pytest.mark.parametrize("name,config,act_order", CASES, ids=[c[0] for c in CASES])
def test_tiled_layer_equals_internal_layout(name, config, act_order):
    layer = _layer(config, 512, 48, act_order)
    assert layer.quant_layout == "internal"  # CPU: loaded as is
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(3))
    dense = layer.linear_method.dequantized_weight(layer).clone()
    want = layer.linear_method.apply(layer, x)
    assert use_tiled_layout(layer)
    assert layer.quant_layout == "tiled" and (layer.quant_perm is not None) == act_order
    assert layer.g_idx is None and not layer.quant_counters.any()
    torch.testing.assert_close(layer.linear_method.dequantized_weight(layer), dense, atol=0, rtol=0)
    torch.testing.assert_close(layer.linear_method.apply(layer, x), want, atol=1e-5, rtol=1e-5)


def test_tiled_layout_order():
    """Value i of word row t*16 + r holds input channel t*16*pack + i*16 + r."""
    k, n, bits = 256, 3, 4
    values = (torch.arange(k)[:, None] % 16).expand(k, n).to(torch.uint8)  # channel k has value k % 16
    internal = torch.zeros(k // 8, n, dtype=torch.int32)
    for i in range(8):
        internal |= values[i::8].to(torch.int32) << (4 * i)
    tiled, perm = to_tiled(internal, bits, 128, torch.zeros(2, n), None)
    assert perm is None
    for row in (0, 5, 16, 31):
        t, r = divmod(row, 16)
        got = [(int(tiled[row, 0]) >> (4 * i)) & 15 for i in range(8)]
        assert got == [(t * 128 + i * 16 + r) % 16 for i in range(8)]


def test_layout_refusals_keep_internal_layout(monkeypatch):
    zeros = torch.zeros(4, 8)
    assert "multiple of 128" in tiled_layout_problem(64 * 3, 8, 4, 64, zeros[:3], None)
    assert "fractional" in tiled_layout_problem(512, 8, 4, 128, zeros + 0.5, None)
    uneven = torch.tensor([0] * 200 + [1] * 56 + [2] * 128 + [3] * 128, dtype=torch.int32)
    assert "unequal" in tiled_layout_problem(512, 8, 4, 128, zeros, uneven)
    assert tiled_layout_problem(512, 8, 4, 128, zeros, None) is None
    layer = _layer(GPTQConfig(4, 128, desc_act=False, sym=True), 512, 48)
    monkeypatch.setenv("PAGEDLLM_QUANT_TILED", "0")
    assert not use_tiled_layout(layer) and layer.quant_layout == "internal"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton package (interpreter)")
def test_kernels_in_triton_interpreter():
    """tests/gpu/test_quant_tiled.py's small cases at 3 rows (GEMV) and 20 (tensor-core kernel), every bit width /
    group size / act-order case, in Triton's interpreter on this CPU (the whole small set: run that file itself).
    On Triton 3.9 the interpreter needs tests/gpu/conftest.py's comparison fix (it loads with that file)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PAGEDLLM_TEST_DEVICE="cpu", TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                           os.path.join(root, "tests", "gpu", "test_quant_tiled.py"), "-k", "small_shapes and (-3] or -20])"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "10 passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]  # 2 row counts x 5 cases


# ---------------------------------------------------------------- against the quantizer libraries' own formats
# Weights packed by AutoGPTQ's QuantLinear.pack (v1 zeros, act-order g_idx) or in AutoAWQ's GEMM layout, read by
# our loader (internal layout), repacked into the tiled layout: the tiled weight must dequantize to what the
# LIBRARY dequantizes (its own forward / dequantize_gemm), and x @ W must follow. Realistic magnitudes: a random
# weight at transformers' init scale (std 0.05) quantized on min/max grids as GPTQ does.
LIBRARY_CASES = [  # (format, bits, group_size, act_order)
    ("gptq", 4, 32, True), ("gptq", 4, 64, False), ("gptq", 4, 128, True), ("gptq", 4, -1, False),
    ("gptq", 8, 32, False), ("gptq", 8, 64, True), ("gptq", 8, 128, False), ("gptq", 8, -1, False),
    ("awq", 4, 32, False), ("awq", 4, 64, False), ("awq", 4, 128, False), ("awq", 4, -1, False),
]
LIBRARY_IDS = [f"{f}-{b}bit-g{g}{'-act-order' if a else ''}" for f, b, g, a in LIBRARY_CASES]
K, N = 512, 96


def _library_layer(fmt, bits, group_size, act_order, seed=0):
    """-> (our layer in the tiled layout, the library's dense weight [N, K] fp32)."""
    from tests.quantization.checkpoints import library_dequantized, load_library_file, minmax_quant_params

    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(N, K, generator=gen) * 0.05
    gs = K if group_size == -1 else group_size
    g_idx = torch.arange(K) // gs
    if act_order:
        g_idx = torch.argsort(torch.randperm(K, generator=gen)) // gs  # channel perm[j] is quantized j-th
    sym = fmt == "gptq" and group_size == 64  # one symmetric GPTQ grid per bit width, the rest asymmetric
    scales, zeros = minmax_quant_params(weight, g_idx, K // gs, bits, sym=sym)
    q = (torch.round(weight / scales[:, g_idx]).long() + zeros[:, g_idx]).clamp(0, 2 ** bits - 1)
    grid = ((q - zeros[:, g_idx]) * scales[:, g_idx]).float()  # on the grid: packing is exact
    if fmt == "gptq":
        lib = load_library_file("auto_gptq-0.7.1", "auto_gptq/nn_modules/qlinear/qlinear_cuda.py", "autogptq_qlinear")
        linear = torch.nn.Linear(K, N, bias=False)
        linear.weight.data = grid
        ql = lib.QuantLinear(bits, group_size, K, N, bias=False, weight_dtype=torch.float16)
        ql.pack(linear, scales, zeros.to(torch.int32), g_idx.to(torch.int32))
        tensors = {"qweight": ql.qweight, "qzeros": ql.qzeros, "scales": ql.scales.half(), "g_idx": ql.g_idx}
        reference = library_dequantized(ql, K)
        config = GPTQConfig(bits, group_size, desc_act=act_order, sym=sym)
    else:
        from pagedllm.quantization.awq import AWQ_PACK_ORDER
        from pagedllm.quantization.packed import pack_int32

        lib = load_library_file("autoawq-0.2.9", "awq/utils/packing_utils.py", "autoawq_packing_utils")
        tensors = {"qweight": pack_int32(q.t(), 4, dim=1, order=AWQ_PACK_ORDER),
                   "qzeros": pack_int32(zeros.t(), 4, dim=1, order=AWQ_PACK_ORDER),
                   "scales": scales.t().contiguous().half()}
        reference = lib.dequantize_gemm(tensors["qweight"], tensors["qzeros"], tensors["scales"].float(), 4, gs).t()
        config = AWQConfig(4, group_size, zero_point=True)
    torch.testing.assert_close(reference, grid, atol=1e-6, rtol=1e-6)  # the library reads back the grid
    layer = RowParallelLinear(K, N, bias=False, params_dtype=torch.float32, quant_config=config, prefix="proj")
    for name, value in tensors.items():
        getattr(layer, name).data.copy_(value)
    layer.linear_method.process_weights_after_loading(layer)
    assert use_tiled_layout(layer) and layer.quant_layout == "tiled"
    assert (layer.quant_perm is not None) == act_order
    return layer, reference.float()


@pytest.mark.parametrize("fmt,bits,group_size,act_order", LIBRARY_CASES, ids=LIBRARY_IDS)
def test_tiled_layout_dequantizes_to_the_library_weight(fmt, bits, group_size, act_order):
    from pagedllm.kernels.tiled_layout import dequantize_tiled

    layer, reference = _library_layer(fmt, bits, group_size, act_order)
    dense = dequantize_tiled(layer.qweight, layer.scales.float(), layer.zeros.float(), layer.quant_bits,
                             layer.quant_group_size, layer.quant_perm)
    # fp16 scales on disk: the only rounding is the library's own (both read the same fp16 values)
    torch.testing.assert_close(dense, reference, atol=1e-6, rtol=1e-6)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(layer.linear_method.apply(layer, x), x @ reference.t(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt,bits,group_size,act_order", LIBRARY_CASES, ids=LIBRARY_IDS)
def test_quant_gemv_reference_reproduces_the_library_product(fmt, bits, group_size, act_order):
    """kernels/qgemv.py's quant_gemv_ref (what the GPU tests of the tiled kernels trust) over the tiled layout,
    against x @ W of the library's weight, with a bias, in fp32 and rounded once to bf16."""
    qgemv = pytest.importorskip("pagedllm.kernels.qgemv", reason="kernels/qgemv.py imports triton")
    layer, reference = _library_layer(fmt, bits, group_size, act_order, seed=1)
    gen = torch.Generator().manual_seed(4)
    x, bias = torch.randn(3, K, generator=gen), torch.randn(N, generator=gen)
    args = (layer.qweight, layer.scales, layer.zeros, layer.quant_bits, layer.quant_group_size, layer.quant_perm)
    want = x @ reference.t() + bias
    torch.testing.assert_close(qgemv.quant_gemv_ref(x, *args, bias), want, atol=1e-5, rtol=1e-5)
    got16 = qgemv.quant_gemv_ref(x.to(torch.bfloat16), *args, bias)
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16.float(), x.to(torch.bfloat16).float() @ reference.t() + bias,
                               atol=1e-2, rtol=1e-2)
