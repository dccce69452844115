"""kernels/csrc/gemv_mma.cu emulated on the CPU: each lane's loads of the plain weight and of x, the fragments it
hands the MMA (mma.m16n8k16's fragment maps of the PTX ISA) and where it stores each accumulator must give
x @ W^T (gated: silu(gate) * up). The kernel itself runs in tests/gpu/test_gemv_mma_gpu.py."""
from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.gemv_mma import CHUNK, MAX_ROWS, layout_problem


def _word_channels(pair: int, t: int) -> tuple[int, int]:
    """The chunk channels of `word(v, pair)` for lane t: v[0] holds [8 t, 8 t + 8), v[1] [32 + 8 t, +8); a word is
    one channel pair."""
    base = (pair >> 2) * 32 + 8 * t + 2 * (pair & 3)
    return base, base + 1


def _emulate(x: torch.Tensor, w: torch.Tensor, bias, gated: bool, mt_tiles: int, ct: int) -> torch.Tensor:
    m_rows, k = x.shape
    n_total = w.shape[0]
    n_out = n_total // 2 if gated else n_total
    tiles = 2 if gated else ct
    blocks = n_out // 16 if gated else n_out // (16 * ct)
    row_blocks = (m_rows + 8 * mt_tiles - 1) // (8 * mt_tiles)
    xd, wd = x.double(), w.double()
    out = torch.full((m_rows, n_out), float("nan"), dtype=torch.float64)
    for bx in range(blocks):
        n0 = bx * (16 if gated else 16 * ct)
        for by in range(row_blocks):
            m0 = by * 8 * mt_tiles
            acc = torch.zeros(tiles, mt_tiles, 32, 4, dtype=torch.float64)  # [ct][mt][lane][e]
            for c in range(k // CHUNK):
                for tile in range(tiles):
                    first_row = n0 + (n_out if gated and tile else 16 * tile if not gated else 0)
                    for mt in range(mt_tiles):
                        for j in range(4):
                            a = torch.zeros(16, 16, dtype=torch.float64)
                            b = torch.zeros(16, 8, dtype=torch.float64)
                            for lane in range(32):
                                g, t = lane // 4, lane % 4
                                # a0 = word(lo, 2j) (g, 2t..), a1 = word(hi, 2j) (g+8, 2t..),
                                # a2 = word(lo, 2j+1) (g, 2t+8..), a3 = word(hi, 2j+1) (g+8, 2t+8..)
                                for reg, (row, col, pair) in enumerate([(g, 2 * t, 2 * j), (g + 8, 2 * t, 2 * j),
                                                                        (g, 2 * t + 8, 2 * j + 1),
                                                                        (g + 8, 2 * t + 8, 2 * j + 1)]):
                                    ch = _word_channels(pair, t)
                                    a[row, col] = wd[first_row + row, c * CHUNK + ch[0]]
                                    a[row, col + 1] = wd[first_row + row, c * CHUNK + ch[1]]
                                m = m0 + 8 * mt + g
                                xr = xd[m if m < m_rows else 0]  # a row past M reads row 0 (never stored)
                                for reg_row, pair in ((2 * t, 2 * j), (2 * t + 8, 2 * j + 1)):  # b0, b1
                                    ch = _word_channels(pair, t)
                                    b[reg_row, g] = xr[c * CHUNK + ch[0]]
                                    b[reg_row + 1, g] = xr[c * CHUNK + ch[1]]
                            d = a @ b  # [16 output columns, 8 rows]
                            for lane in range(32):
                                g, t = lane // 4, lane % 4
                                acc[tile, mt, lane] += torch.stack([d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t],
                                                                    d[g + 8, 2 * t + 1]])
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for mt in range(mt_tiles):
                    for e in range(4):
                        n = n0 + g + (0 if e < 2 else 8)
                        m = m0 + 8 * mt + 2 * t + (e & 1)
                        if m >= m_rows:
                            continue
                        if gated:
                            gate, up = acc[0, mt, lane, e].item(), acc[1, mt, lane, e].item()
                            if bias is not None:
                                gate, up = gate + float(bias[n]), up + float(bias[n_out + n])
                            gate_t = torch.tensor(gate, dtype=torch.float64)
                            out[m, n] = torch.nn.functional.silu(gate_t) * up
                        else:
                            for tile in range(tiles):
                                v = acc[tile, mt, lane, e].item()
                                if bias is not None:
                                    v += float(bias[n + 16 * tile])
                                out[m, n + 16 * tile] = v
    return out


@pytest.mark.parametrize("rows, mt_tiles, ct, gated, with_bias", [
    (1, 1, 1, False, False), (5, 1, 1, False, True), (8, 1, 2, False, False), (11, 2, 1, False, False),
    (3, 1, 2, True, False), (16, 2, 2, True, True), (27, 4, 1, False, True), (20, 4, 2, True, False),
])
def test_lane_maps_give_the_product(rows, mt_tiles, ct, gated, with_bias):
    gen = torch.Generator().manual_seed(rows)
    n_out, k = 32, 128
    n_total = 2 * n_out if gated else n_out
    w = torch.randn(n_total, k, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    bias = torch.randn(n_total, generator=gen) if with_bias else None
    y = torch.nn.functional.linear(x.double(), w.double(), None if bias is None else bias.double())
    if gated:
        y = torch.nn.functional.silu(y[:, :n_out]) * y[:, n_out:]
    got = _emulate(x, w, bias, gated, mt_tiles, ct)
    assert not got.isnan().any()  # every output written
    torch.testing.assert_close(got, y)


def test_layout_problems_are_named():
    assert layout_problem(torch.zeros(32, 128, dtype=torch.bfloat16)) is None
    assert "K %" in layout_problem(torch.zeros(32, 96, dtype=torch.bfloat16))
    assert "N % 16" in layout_problem(torch.zeros(24, 128, dtype=torch.bfloat16))
    assert "N % 16" in layout_problem(torch.zeros(48, 128, dtype=torch.bfloat16), gated=True)
    assert "fp16 / bf16" in layout_problem(torch.zeros(32, 128))
    assert "contiguous" in layout_problem(torch.zeros(32, 256, dtype=torch.bfloat16)[:, :128].t().contiguous().t())
    assert MAX_ROWS == 32
