"""kernels/qgemv_mma.py's weight layout: the round trip, and an emulation of what csrc/qgemv_mma.cu does with it on
the CPU (each lane's lop3 unpacking and the mma.m16n8k16 fragment maps of the PTX ISA), which must give x @ W^T.
The kernel itself runs in tests/gpu/test_qgemv_mma_gpu.py."""
from __future__ import annotations

import functools

import pytest

import torch

from pagedllm.kernels.qgemv_mma import CHUNK, dequantize_mma, from_mma_layout, to_mma_layout


def test_layout_round_trip():
    q = torch.randint(0, 16, (48, 256), generator=torch.Generator().manual_seed(0))
    words = to_mma_layout(q)
    assert words.shape == (3, 4, 32, 4) and words.dtype == torch.int32
    assert torch.equal(from_mma_layout(words), q.to(torch.int32))


@functools.lru_cache(maxsize=None)
def _half(bits: int, fp16: bool) -> float:
    """The value of a 16-bit pattern as the kernel's lop3 makes it (the MMA operand's real encoding)."""
    return torch.tensor([bits - (1 << 16) if bits >= 1 << 15 else bits], dtype=torch.int16).view(
        torch.float16 if fp16 else torch.bfloat16).item()


def _emulate(words, x, scales, zeros, group_size, fp16=False):
    """out[m, n] as the kernel computes it: per chunk and lane, A fragments from the word's nibble pairs: a0 = w &
    0x000F000F and a2 = (w >> 8) & 0x000F000F as (off + q); a1 / a3 = (w >> 4) / (w >> 12) & 0x000F000F (bf16), or in
    place for f16, w & 0x00F000F0 / (w >> 8) & 0x00F000F0 as (off + 16 q); plus -(off + zero) (a0 / a2: row g's zero)
    or -(off + mult zero) (a1 / a3: row g + 8's), and row g + 8's scale divided by mult; B fragments from 16 consecutive channels of row g, and the fragment maps
    a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..), b0 (2t..2t+1, col g), b1 (2t+8.., g),
    c0 (g, 2t), c1 (g, 2t+1), c2 (g+8, 2t), c3 (g+8, 2t+1)."""
    off, hi_mult, magic = (1024.0, 16, 0x6400) if fp16 else (128.0, 1, 0x4300)
    nt, chunks = words.shape[:2]
    m_rows = x.shape[0]
    xp = torch.zeros(8, x.shape[1], dtype=torch.float64)
    xp[:m_rows] = x.double()
    out = torch.zeros(8, nt * 16, dtype=torch.float64)
    for tile in range(nt):
        for c in range(chunks):
            grp = c * CHUNK // group_size
            z = zeros[grp, tile * 16: tile * 16 + 16].double()
            d = torch.zeros(16, 8, dtype=torch.float64)
            for j in range(4):
                a = torch.zeros(16, 16, dtype=torch.float64)
                b = torch.zeros(16, 8, dtype=torch.float64)
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    w = int(words[tile, c, lane, j]) & 0xFFFFFFFF
                    if fp16:  # a1 / a3 hold their nibbles 4 bits up: 16 q
                        regs = [w & 0x000F000F, w & 0x00F000F0, (w >> 8) & 0x000F000F, (w >> 8) & 0x00F000F0]
                    else:
                        regs = [(w >> (4 * r)) & 0x000F000F for r in range(4)]
                    for r, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
                        mult = hi_mult if r & 1 else 1
                        neg_zero = -(off + mult * z[row])  # za for a0 / a2, zb for a1 / a3
                        a[row, col] = _half(magic | (regs[r] & 0xFFFF), fp16) + neg_zero
                        a[row, col + 1] = _half(magic | (regs[r] >> 16), fp16) + neg_zero
                    xs = xp[g, c * CHUNK + 16 * t: c * CHUNK + 16 * t + 16]  # the lane's 16 channels of row g
                    b[2 * t, g], b[2 * t + 1, g] = xs[4 * j], xs[4 * j + 1]  # b0 = xr[2j]
                    b[2 * t + 8, g], b[2 * t + 9, g] = xs[4 * j + 2], xs[4 * j + 3]  # b1 = xr[2j + 1]
                d += a @ b
            scale = scales[grp, tile * 16: tile * 16 + 16].double().clone()
            scale[8:] /= hi_mult  # column n_hi's products are hi_mult (q - zero) x
            out[:, tile * 16: tile * 16 + 16] += (d * scale[:, None]).t()
    return out[:m_rows]


@pytest.mark.parametrize("fp16", [False, True])
def test_kernel_fragment_maps_give_the_product(fp16):
    gen = torch.Generator().manual_seed(1)
    n, k, group = 32, 256, 128
    q = torch.randint(0, 16, (n, k), generator=gen)
    scales = torch.rand(k // group, n, generator=gen) * 0.1
    zeros = torch.randint(0, 16, (k // group, n), generator=gen).double()
    x = torch.randn(3, k, generator=gen)
    words = to_mma_layout(q)
    dense = dequantize_mma(words, scales, zeros, group, None, dtype=torch.float64)
    torch.testing.assert_close(dense, (q.double() - zeros.t().repeat_interleave(group, 1))
                               * scales.double().t().repeat_interleave(group, 1))
    torch.testing.assert_close(_emulate(words, x, scales, zeros, group, fp16), x.double() @ dense.t())


def test_dequantize_with_act_order_perm():
    gen = torch.Generator().manual_seed(2)
    n, k, group = 16, 128, 64
    q = torch.randint(0, 16, (n, k), generator=gen)
    scales, zeros = torch.rand(2, n, generator=gen), torch.randint(0, 16, (2, n), generator=gen).float()
    perm = torch.randperm(k, generator=gen)
    dense = dequantize_mma(to_mma_layout(q), scales, zeros, group, perm)
    layout = dequantize_mma(to_mma_layout(q), scales, zeros, group, None)
    torch.testing.assert_close(dense[:, perm], layout)  # layout channel j is input channel perm[j]


# ---------------------------------------------------------------- the layer conversion (quantization/tiled.py)

from pagedllm.quantization.awq import AWQConfig  # noqa: E402
from pagedllm.quantization.gptq import GPTQConfig  # noqa: E402
from pagedllm.quantization.tiled import mma_layout_unsupported, use_mma_layout  # noqa: E402
from tests.quantization.test_tiled_layout import _layer as tiled_layer  # noqa: E402


def _layer(config, k, n, act_order=False, dtype=torch.bfloat16):
    return tiled_layer(config, k, n, act_order, dtype=dtype)


MMA_CASES = [
    ("gptq g128 sym", GPTQConfig(4, 128, desc_act=False, sym=True), False),
    ("gptq g64 act-order asym", GPTQConfig(4, 64, desc_act=True, sym=False), True),
    ("gptq g-1", GPTQConfig(4, -1, desc_act=False, sym=False), False),
    ("awq g128", AWQConfig(4, 128, zero_point=True), False),
]


@pytest.mark.parametrize("name,config,act_order", MMA_CASES, ids=[c[0] for c in MMA_CASES])
def test_mma_layer_equals_internal_layout(name, config, act_order):
    """A loaded layer converted to the mma layout dequantizes to exactly the same weight and computes the same
    product (off CUDA through the dense reference; tests/gpu/test_qgemv_mma_gpu.py runs the kernel)."""
    layer = _layer(config, 512, 48, act_order)
    assert layer.quant_layout == "internal"  # CPU: loaded as is
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    dense = layer.linear_method.dequantized_weight(layer).float().clone()
    want = layer.linear_method.apply(layer, x)
    assert use_mma_layout(layer)
    assert layer.quant_layout == "mma" and layer.g_idx is None and (layer.quant_perm is not None) == act_order
    assert layer.qweight.shape == (3, 8, 32, 4)
    torch.testing.assert_close(layer.linear_method.dequantized_weight(layer).float(), dense, atol=0, rtol=0)
    torch.testing.assert_close(layer.linear_method.apply(layer, x).float(), want.float(), atol=2e-2, rtol=2e-2)


def test_mma_layout_refusals():
    """What the kernel cannot hold keeps its layout (the tiled / internal kernels take it), with the reason."""
    assert "4-bit" in mma_layout_unsupported(_layer(GPTQConfig(8, 128, desc_act=False, sym=True), 512, 48))
    assert "group_size 32" in mma_layout_unsupported(_layer(GPTQConfig(4, 32, desc_act=False, sym=True), 512, 48))
    assert "N % 16" in mma_layout_unsupported(_layer(GPTQConfig(4, 128, desc_act=False, sym=True), 512, 40))
    fp32 = _layer(GPTQConfig(4, 128, desc_act=False, sym=True), 512, 48, dtype=torch.float32)
    assert "float32 scales" in mma_layout_unsupported(fp32)
    assert not use_mma_layout(fp32) and fp32.quant_layout == "internal"


def test_unknown_launch_options_are_refused():
    """A launch option the kernel does not have (e.g. one of the dropped sweep variants) is refused, not ignored."""
    from pagedllm.kernels.qgemv_mma import quant_gemv_mma

    words = to_mma_layout(torch.zeros(16, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="unknown qgemv_mma launch options \\['l2pf'\\]"):
        quant_gemv_mma(torch.zeros(1, 64, dtype=torch.bfloat16), words, torch.ones(1, 16, dtype=torch.bfloat16),
                       torch.zeros(1, 16, dtype=torch.bfloat16), -1, config={"l2pf": True, "depth": 3})
