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


def _layer(config, k, n, act_order=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    layer = RowParallelLinear(k, n, bias=False, params_dtype=torch.float32, quant_config=config, prefix="proj")
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
    monkeypatch.setenv("PAGEDLLM_QUANT_TILED", "1")  # opt-in (its kernels are unverified on a GPU)


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
