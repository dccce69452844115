"""The GGUF-block / int8-row CPU kernels (kernels/csrc/gguf_ops.cpp): dequantizers against the `gguf` package's
own `dequantize`, and every matmul path (AVX-512 VNNI, AVX2, portable) against dequantize-then-matmul, over
all block types, odd shapes, 1..65 activation rows and 1 or 2 threads.

The int8 activations make the product inexact; the check is the rigorous bound that rounding implies: each x is
off by at most half its 32-block's step (amax / 127 / 2), so |out - ref| <= sum_i |w_i| * step_i / 2 (+ float
accumulation slack)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import envs
from pagedllm.kernels.cpu_ops import cpu_ops

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
I8_ROW = 1000  # pagedllm's per-channel int8 rows: [float32 scale][K int8]


@pytest.fixture(scope="module")
def ops():
    ops = cpu_ops()
    if ops is None:
        if not envs.PAGEDLLM_CPU_KERNELS:
            pytest.skip("PAGEDLLM_CPU_KERNELS=0")
        pytest.fail("the CPU kernels did not build on this machine (see the log warning)")
    return ops


def impls(ops) -> list[int]:
    best = ops.gguf_best_impl()  # 2: AVX-512 VNNI, 1: AVX2, 0: portable only
    return [0, 2] + ([1] if best >= 1 else [])


def make_weight(qtype, rows: int, k: int, seed: int) -> np.ndarray:
    """Packed GGUF rows [rows, row_bytes]: gguf's own quantizer where it has one, else random blocks with
    small, finite fp16 scales (the K-quant formats: every bit pattern of the quants is valid)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, k)).astype(np.float32)
    try:
        return quantize(w, qtype)
    except NotImplementedError:
        pass
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, k // elems, nbytes), dtype=np.uint8)
    scales = (rng.random((rows, k // elems, 2)) * 0.02 + 1e-3).astype(np.float16).view(np.uint8)
    if qtype == Q.Q6_K:
        blocks[..., 208:210] = scales[..., 0:2]  # d (the int8 sub-scales are random)
    else:
        blocks[..., 0:4] = scales.reshape(rows, k // elems, 4)  # d, dmin
    return blocks.reshape(rows, -1)


def int8_rows(rows: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    q = rng.integers(-127, 128, (rows, k), dtype=np.int8)
    scale = (rng.random(rows) * 0.01 + 1e-4).astype(np.float32)
    packed = np.concatenate([scale.view(np.uint8).reshape(rows, 4), q.view(np.uint8)], axis=1)
    return packed, q.astype(np.float32) * scale[:, None]


def reference_dequant(packed: np.ndarray, qtype) -> np.ndarray:
    return np.asarray(dequantize(packed, qtype), dtype=np.float32)


def check_product(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias=None) -> None:
    x64, w64 = x.double(), w.double()
    ref = x64 @ w64.T + (0 if bias is None else bias.double())
    k = x.shape[1]
    blocks = -(-k // 32)
    padded = torch.zeros(x.shape[0], blocks * 32, dtype=torch.float64)
    padded[:, :k] = x64.abs()
    step = padded.view(x.shape[0], blocks, 32).amax(-1) / 127.0
    half_step = step.repeat_interleave(32, dim=1)[:, :k] / 512  # two int8 digits: steps of amax / 127 / 256
    bound = half_step @ w64.abs().T * 1.001 + 1e-5 * (x64.abs() @ w64.abs().T) + 1e-6
    err = (out.double() - ref).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error exceeds the int8-rounding bound by {worst:.3f}x"


def check_dequantizes_as_the_file(ops, layout, type_id, packed, qtype) -> None:
    """A regrouped layout's rows (all, and picked by id) are exactly the file's; an id past them is an error."""
    rows, k = packed.shape[0], reference_dequant(packed, qtype).shape[1]
    out = torch.empty(rows, k)
    ops.gguf_dequantize_rows(out, layout, type_id, None)
    assert torch.equal(out, torch.from_numpy(reference_dequant(packed, qtype)))
    ids = torch.tensor([rows - 1, 0, 7, 7, rows // 2])
    picked = torch.empty(5, k)
    ops.gguf_dequantize_rows(picked, layout, type_id, ids)
    assert torch.equal(picked, out[ids])
    with pytest.raises(RuntimeError, match="out of range"):
        ops.gguf_dequantize_rows(torch.empty(1, k), layout, type_id, torch.tensor([rows]))


def check_mixed_parts(ops, parts, k, regroup, offset, threads, seed) -> None:
    """gguf_linear over parts side by side, each (type, rows, regrouped: by regroup, type id offset + type, else the
    file's layout): bias, a row-strided x, 1 / 6 / 33 rows on every implementation, and bf16 / fp16 activations;
    every output written once (NaN-filled out)."""
    packed, types, dense = [], [], []
    for i, (t, rows, regrouped) in enumerate(parts):
        p = make_weight(t, rows, k, seed=seed + i)
        dense.append(torch.from_numpy(reference_dequant(p, t)))
        packed.append(regroup(torch.from_numpy(p), int(t)) if regrouped else torch.from_numpy(p))
        types.append(offset + int(t) if regrouped else int(t))
    w = torch.cat(dense)
    bias = torch.randn(w.shape[0])
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in (1, 6, 33):
            x = torch.randn(m, 2 * k)[:, :k]
            for impl in impls(ops):
                out = torch.full((m, w.shape[0]), float("nan"))
                ops.gguf_linear(out, x, packed, types, bias, impl)
                check_product(out, x, w, bias)
            for dtype in (torch.bfloat16, torch.float16):
                out = torch.empty(m, w.shape[0])
                ops.gguf_linear(out, x.to(dtype), packed, types, bias, 0)
                check_product(out, x.to(dtype).float(), w, bias)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf(ops, qtype):
    k = 512 if GGML_QUANT_SIZES[qtype][0] == 256 else 96  # 96: an odd number of 32-blocks (a half chunk)
    packed = make_weight(qtype, 13, k, seed=int(qtype))
    out = torch.empty(13, k)
    ops.gguf_dequantize_rows(out, torch.from_numpy(packed), int(qtype), None)
    assert torch.equal(out, torch.from_numpy(reference_dequant(packed, qtype)))
    ids = torch.tensor([12, 0, 5, 5])
    rows = torch.empty(4, k)
    ops.gguf_dequantize_rows(rows, torch.from_numpy(packed), int(qtype), ids)
    assert torch.equal(rows, out[ids])


def test_dequantize_rejects_bad_ids_and_shapes(ops):
    packed = torch.from_numpy(make_weight(Q.Q8_0, 4, 64, seed=1))
    with pytest.raises(RuntimeError, match="out of range"):
        ops.gguf_dequantize_rows(torch.empty(1, 64), packed, int(Q.Q8_0), torch.tensor([4]))
    with pytest.raises(RuntimeError, match="multiple of the block size"):
        ops.gguf_dequantize_rows(torch.empty(4, 48), packed, int(Q.Q8_0), None)
    with pytest.raises(RuntimeError, match="unsupported"):
        ops.gguf_dequantize_rows(torch.empty(4, 64), packed, int(Q.Q2_K), None)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_linear_all_paths_against_dequantized_matmul(ops, qtype, threads):
    k = 512 if GGML_QUANT_SIZES[qtype][0] == 256 else 160  # 160: 2.5 chunks of 64
    n = 37
    packed = torch.from_numpy(make_weight(qtype, n, k, seed=int(qtype) + 7))
    w = torch.from_numpy(reference_dequant(packed.numpy(), qtype))
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in (1, 2, 3, 4, 5, 7, 17, 64, 65):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            x[0, :7] *= 50  # an outlier block
            for impl in impls(ops):
                out = torch.empty(m, n)
                ops.gguf_linear(out, x, [packed], [int(qtype)], None, impl)
                check_product(out, x, w)
    finally:
        torch.set_num_threads(old)


def test_linear_parts_of_different_types_bias_and_strided_rows(ops):
    k = 256
    parts = [(Q.Q4_1, 48), (Q.Q6_K, 16), (Q.Q8_0, 9)]
    packed = [torch.from_numpy(make_weight(t, r, k, seed=i)) for i, (t, r) in enumerate(parts)]
    w = torch.cat([torch.from_numpy(reference_dequant(p.numpy(), t)) for p, (t, _) in zip(packed, parts)])
    bias = torch.randn(w.shape[0])
    wide = torch.randn(6, 2 * k)
    x = wide[:, :k]  # row-strided, as a fused projection's slice is
    for impl in impls(ops):
        out = torch.empty(6, w.shape[0])
        ops.gguf_linear(out, x, packed, [int(t) for t, _ in parts], bias, impl)
        check_product(out, x, w, bias)
    for dtype in (torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        out = torch.empty(6, w.shape[0])
        ops.gguf_linear(out, xd, packed, [int(t) for t, _ in parts], bias, 0)
        check_product(out, xd.float(), w, bias)


@pytest.mark.parametrize("k", [100, 576])
def test_int8_rows_any_width(ops, k):
    packed, w = int8_rows(29, k, seed=k)
    packed = torch.from_numpy(packed)
    w = torch.from_numpy(w)
    full = torch.empty(29, k)
    ops.gguf_dequantize_rows(full, packed, I8_ROW, None)
    assert torch.equal(full, w)
    for m in (1, 4, 9):
        x = torch.randn(m, k)
        for impl in impls(ops):
            out = torch.empty(m, 29)
            ops.gguf_linear(out, x, [packed], [I8_ROW], None, impl)
            check_product(out, x, w)


@pytest.mark.parametrize("qtype", TYPES + ["i8row"], ids=lambda t: getattr(t, "name", t))
def test_one_activation_row_bits_do_not_depend_on_row_grouping(ops, qtype):
    """A decode step's product (one activation row) on the AVX2 register path: every output must have the same
    bits however its rows were grouped (threads taking pieces of the rows, a part's slices at any offset, a
    batch of several activation rows), and stay within the rounding bound of the reference. (The VNNI kernels
    switch to float products from 2 activation rows: there only the bound is checked.)"""
    n = 11
    if qtype == "i8row":
        k = 100
        packed, w = (torch.from_numpy(a) for a in int8_rows(n, k, seed=5))
        type_id = I8_ROW
    else:
        k = 512 if GGML_QUANT_SIZES[qtype][0] == 256 else 96  # 96: the last chunk half empty
        packed = torch.from_numpy(make_weight(qtype, n, k, seed=int(qtype) + 3))
        w = torch.from_numpy(reference_dequant(packed.numpy(), qtype))
        type_id = int(qtype)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(2))
    x[0, 3] *= 40
    old = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            full = torch.empty(1, n)
            ops.gguf_linear(full, x[:1], [packed], [type_id], None, 0)
            results.append(full)
        check_product(results[0], x[:1], w)
        if ops.gguf_best_impl() != 1:
            return
        assert torch.equal(results[0], results[1])
        for start, stop in ((0, 1), (1, 4), (3, 11), (5, 10), (10, 11)):  # tails and groups at other offsets
            part = torch.empty(1, stop - start)
            ops.gguf_linear(part, x[:1], [packed[start:stop].contiguous()], [type_id], None, 0)
            assert torch.equal(part, results[0][:, start:stop]), (start, stop)
        pair = torch.empty(2, n)
        ops.gguf_linear(pair, x, [packed], [type_id], None, 0)
        assert torch.equal(pair[:1], results[0])
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("rows,k", [(1, 32), (7, 96), (33, 640), (5, 2048)])
def test_q5_0_widened_to_q8_0_holds_the_same_values(ops, rows, k):
    from pagedllm.kernels.gguf_ops import widen_packed
    rng = np.random.default_rng(rows + k)
    data = rng.standard_normal((rows, k)).astype(np.float32)
    data[0, :5] *= 30
    packed = quantize(data, Q.Q5_0)
    wide = ops.gguf_q5_0_to_q8_0(torch.from_numpy(packed))
    assert wide.shape == (rows, k // 32 * 34)
    assert np.array_equal(reference_dequant(wide.numpy(), Q.Q8_0), reference_dequant(packed, Q.Q5_0))
    tensor, qtype = widen_packed(torch.from_numpy(packed), int(Q.Q5_0))
    if ops.gguf_best_impl() == 1 and envs.PAGEDLLM_GGUF_WIDEN_Q5_0:  # AVX2 without VNNI: the Q8_0 kernels
        assert qtype == int(Q.Q8_0) and torch.equal(tensor, wide)
    else:
        assert qtype == int(Q.Q5_0) and np.array_equal(tensor.numpy(), packed)
    x = torch.randn(3, k)
    out = torch.empty(3, rows)
    ops.gguf_linear(out, x, [wide], [int(Q.Q8_0)], None, 0)
    check_product(out, x, torch.from_numpy(reference_dequant(packed, Q.Q5_0)))


def test_linear_rejects_mismatched_inputs(ops):
    packed = torch.from_numpy(make_weight(Q.Q4_0, 8, 64, seed=3))
    with pytest.raises(RuntimeError, match="contiguous uint8"):
        ops.gguf_linear(torch.empty(1, 8), torch.randn(1, 96), [packed], [int(Q.Q4_0)], None, 0)
    with pytest.raises(RuntimeError, match="columns"):
        ops.gguf_linear(torch.empty(1, 9), torch.randn(1, 64), [packed], [int(Q.Q4_0)], None, 0)


# ---- the 16-row tiled layouts (gguf_tile): the file's bytes regrouped for the register-tiled VNNI kernel
TILEABLE = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
TILED = 2000  # type id offset of a tiled layout


@pytest.mark.parametrize("qtype", TILEABLE, ids=lambda t: t.name)
def test_tiled_layout_dequantizes_exactly_as_the_file(ops, qtype):
    k = 512 if GGML_QUANT_SIZES[qtype][0] == 256 else 96
    packed = make_weight(qtype, 48, k, seed=int(qtype) + 3)
    tiled = ops.gguf_tile(torch.from_numpy(packed), int(qtype))
    assert tiled.dtype == torch.uint8 and tiled.shape[0] == 3
    if GGML_QUANT_SIZES[qtype][0] == 32 or qtype == Q.Q6_K:
        assert tiled.shape[1] == 16 * packed.shape[1]  # the same bytes, regrouped
    else:  # K-quants: 6-bit sub-block scales widened to bytes
        assert 16 * packed.shape[1] < tiled.shape[1] <= 1.03 * 16 * packed.shape[1]
    check_dequantizes_as_the_file(ops, tiled, TILED + int(qtype), packed, qtype)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("qtype", TILEABLE, ids=lambda t: t.name)
def test_tiled_linear_against_dequantized_matmul(ops, qtype, threads):
    k = 512 if GGML_QUANT_SIZES[qtype][0] == 256 else 160  # 160: 5 blocks of 32
    n = 64  # 4 groups of 16 rows
    packed = make_weight(qtype, n, k, seed=int(qtype) + 11)
    tiled = ops.gguf_tile(torch.from_numpy(packed), int(qtype))
    w = torch.from_numpy(reference_dequant(packed, qtype))
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in (1, 2, 3, 5, 8, 9, 17, 64, 65, 130):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            x[0, :7] *= 50  # an outlier block
            outs = []
            for impl in impls(ops):
                out = torch.empty(m, n)
                ops.gguf_linear(out, x, [tiled], [TILED + int(qtype)], None, impl)
                check_product(out, x, w)
                outs.append(out)
            # The vector kernel and the portable one compute the same integer sums and float terms.
            assert all(torch.equal(outs[0], o) for o in outs[1:])
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("threads", [1, 2])
def test_tiled_parts_beside_row_parts_bias_and_dtypes(ops, threads):
    """A tiled part whose first output column is not a multiple of 16 (after a 9-row Q6_K part), another after
    it, bias, a row-strided x and bf16 / fp16 activations: every group written once, by whichever thread."""
    k = 256
    parts = [(Q.Q6_K, 9, False), (Q.Q4_1, 48, True), (Q.Q4_K, 16, True), (Q.Q8_0, 32, True), (Q.Q5_0, 7, False),
             (Q.Q6_K, 32, True)]
    check_mixed_parts(ops, parts, k, ops.gguf_tile, TILED, threads, seed=40)


def test_tile_rejects_what_has_no_tiled_layout(ops):
    q4 = torch.from_numpy(make_weight(Q.Q4_0, 24, 64, seed=5))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.gguf_tile(q4, int(Q.Q4_0))
    with pytest.raises(RuntimeError, match="no tiled layout"):
        ops.gguf_tile(torch.from_numpy(make_weight(Q.Q4_0, 16, 64, seed=5)), int(Q.Q2_K))
    with pytest.raises(RuntimeError, match="K a multiple of 32"):
        ops.gguf_tile(torch.from_numpy(int8_rows(16, 100, seed=1)[0]), I8_ROW)
    tiled = ops.gguf_tile(q4[:16].contiguous(), int(Q.Q4_0))
    with pytest.raises(RuntimeError, match="rows / 16"):
        ops.gguf_linear(torch.empty(1, 16), torch.randn(1, 96), [tiled], [TILED + int(Q.Q4_0)], None, 0)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("k", [96, 576])
def test_tiled_int8_rows(ops, k, threads):
    """The int8 rows (--quantization int8 on CPU) tiled: exact dequantization, products within the bound, the
    vector kernel equal to the portable one."""
    packed, w = int8_rows(48, k, seed=k + 1)
    tiled = ops.gguf_tile(torch.from_numpy(packed), I8_ROW)
    assert tiled.shape == (3, 16 * (k + 4))
    w = torch.from_numpy(w)
    full = torch.empty(48, k)
    ops.gguf_dequantize_rows(full, tiled, TILED + I8_ROW, None)
    assert torch.equal(full, w)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in (1, 2, 9, 33):
            x = torch.randn(m, k)
            outs = []
            for impl in impls(ops):
                out = torch.empty(m, 48)
                ops.gguf_linear(out, x, [tiled], [TILED + I8_ROW], None, impl)
                check_product(out, x, w)
                outs.append(out)
            assert all(torch.equal(outs[0], o) for o in outs[1:])
    finally:
        torch.set_num_threads(old)


# ---- the AVX2 row layout (gguf_a2pack): each row's bytes regrouped for shuffle-free int16 products
A2_ABLE = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K]
A2_KQUANTS = (Q.Q4_K, Q.Q6_K)
A2 = 3000  # type id offset of the AVX2 row layout
# K: for the 32-block types one block, a half chunk (odd block counts), whole groups of 8 blocks, a last group of 2
# (576) or of 1 (800: 25 blocks); for the K-quants (groups are their super-blocks) one to six super-blocks.
A2_KS = [(t, k) for t in A2_ABLE for k in ([256, 512, 1536] if t in A2_KQUANTS else [32, 96, 256, 576, 800, 1536])]


@pytest.mark.parametrize("qtype,k", A2_KS, ids=lambda v: getattr(v, "name", str(v)))
def test_a2_layout_dequantizes_exactly_as_the_file(ops, qtype, k):
    """Even block counts take exactly the file's bytes, odd ones a padded half chunk and scale; Q4_K 148 bytes per
    super-block for 144 (its 6-bit scales as bytes), Q6_K the file's 210."""
    packed = make_weight(qtype, 21, k, seed=int(qtype) + k)
    a2 = ops.gguf_a2pack(torch.from_numpy(packed), int(qtype))
    assert a2.dtype == torch.uint8 and a2.shape[0] == 21
    if qtype in A2_KQUANTS:
        assert a2.shape[1] == k // 256 * (148 if qtype == Q.Q4_K else 210)
    else:
        nb, halves = k // 32, 2 if qtype == Q.Q4_1 else 1
        quant_bytes = GGML_QUANT_SIZES[qtype][1] - 2 * halves
        assert a2.shape[1] == packed.shape[1] + (nb % 2) * (quant_bytes + 2 * halves)
    check_dequantizes_as_the_file(ops, a2, A2 + int(qtype), packed, qtype)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("qtype", A2_ABLE, ids=lambda t: t.name)
def test_a2_linear_against_dequantized_matmul(ops, qtype, threads):
    """Within the rounding bound for 1..130 activation rows; the AVX2 kernel and the portable one give the same
    bits (the portable one replays its float operations lane by lane), and so does the file layout's integer
    kernel up to float summation order."""
    n = 37
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for k in ((256, 1024) if qtype in A2_KQUANTS else (96, 576, 800)):
            packed = make_weight(qtype, n, k, seed=int(qtype) + 11 + k)
            a2 = ops.gguf_a2pack(torch.from_numpy(packed), int(qtype))
            w = torch.from_numpy(reference_dequant(packed, qtype))
            for m in (1, 2, 3, 4, 5, 9, 17, 130):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k))
                x[0, :7] *= 50  # an outlier block
                outs = []
                for impl in impls(ops):
                    out = torch.full((m, n), float("nan"))
                    ops.gguf_linear(out, x, [a2], [A2 + int(qtype)], None, impl)
                    check_product(out, x, w)
                    outs.append(out)
                assert all(torch.equal(outs[0], o) for o in outs[1:])
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("qtype", A2_ABLE, ids=lambda t: t.name)
def test_a2_one_activation_row_bits_do_not_depend_on_row_grouping(ops, qtype):
    """A decode row's outputs keep their bits whatever else is computed with them: thread count, the part's rows
    taken in slices, and other activation rows in the same call (a batch)."""
    n, k = 11, 768 if qtype in A2_KQUANTS else 576
    packed = torch.from_numpy(make_weight(qtype, n, k, seed=int(qtype) + 3))
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(2))
    x[0, 3] *= 40
    a2 = ops.gguf_a2pack(packed, int(qtype))
    old = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            full = torch.empty(1, n)
            ops.gguf_linear(full, x[:1], [a2], [A2 + int(qtype)], None, 0)
            results.append(full)
        assert torch.equal(results[0], results[1])
        for start, stop in ((0, 1), (3, 11), (5, 10)):
            part = torch.empty(1, stop - start)
            ops.gguf_linear(part, x[:1], [ops.gguf_a2pack(packed[start:stop].contiguous(), int(qtype))],
                            [A2 + int(qtype)], None, 0)
            assert torch.equal(part, results[0][:, start:stop]), (start, stop)
        for m in (2, 4, 5, 6):
            batch = torch.empty(m, n)
            ops.gguf_linear(batch, x[:m], [a2], [A2 + int(qtype)], None, 0)
            assert torch.equal(batch[:1], results[0]), m
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("threads", [1, 2])
def test_a2_parts_beside_other_layouts_bias_and_dtypes(ops, threads):
    """Row-layout parts beside file-layout parts (a fused projection of mixed types), bias, a row-strided x and
    bf16 / fp16 activations; every output written once."""
    k = 768  # 24 blocks, three super-blocks
    parts = [(Q.Q4_1, 9, True), (Q.Q5_1, 16, False), (Q.Q8_0, 5, True), (Q.Q4_K, 7, True), (Q.Q6_K, 7, False),
             (Q.Q6_K, 3, True), (Q.Q4_0, 16, True)]
    check_mixed_parts(ops, parts, k, ops.gguf_a2pack, A2, threads, seed=60)


def test_a2pack_rejects_what_has_no_row_layout(ops):
    with pytest.raises(RuntimeError, match="no AVX2 row layout"):
        ops.gguf_a2pack(torch.from_numpy(make_weight(Q.Q5_0, 4, 64, seed=5)), int(Q.Q5_0))
    with pytest.raises(RuntimeError, match="contiguous uint8"):
        ops.gguf_a2pack(torch.zeros(4, 19, dtype=torch.uint8), int(Q.Q4_0))
    q4k = ops.gguf_a2pack(torch.from_numpy(make_weight(Q.Q4_K, 4, 256, seed=5)), int(Q.Q4_K))
    with pytest.raises(RuntimeError, match="multiple of the block size 256"):
        ops.gguf_linear(torch.empty(1, 4), torch.randn(1, 128), [q4k], [A2 + int(Q.Q4_K)], None, 0)
    a2 = ops.gguf_a2pack(torch.from_numpy(make_weight(Q.Q4_0, 4, 64, seed=5)), int(Q.Q4_0))
    with pytest.raises(RuntimeError, match="contiguous uint8"):  # a K that does not match the layout's bytes
        ops.gguf_linear(torch.empty(1, 4), torch.randn(1, 96), [a2], [A2 + int(Q.Q4_0)], None, 0)
    with pytest.raises(RuntimeError, match="unsupported weight type 3006"):  # Q5_0 has no row layout
        ops.gguf_dequantize_rows(torch.empty(4, 64), a2, A2 + int(Q.Q5_0), None)


def test_packed_weights_take_this_machines_fastest_layout(ops, monkeypatch):
    """tile_packed: the AVX2 row layout on AVX2 machines (Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K, any row count; not
    Q5_K), the 16-row tiles on AVX-512 VNNI ones (row counts of 16), the file's layout elsewhere or with
    PAGEDLLM_GGUF_TILED=0."""
    from pagedllm.kernels.gguf_ops import A2_BASE, TILED_BASE, base_type, tile_packed
    best = ops.gguf_best_impl()
    for qtype, rows in ((Q.Q4_1, 7), (Q.Q8_0, 16), (Q.Q4_K, 16), (Q.Q6_K, 16), (Q.Q5_K, 16)):
        k = 256
        packed = torch.from_numpy(make_weight(qtype, rows, k, seed=rows))
        tensor, type_id = tile_packed(packed, int(qtype))
        if best == 1 and qtype != Q.Q5_K:
            assert type_id == A2_BASE + int(qtype)
        elif best == 2 and rows % 16 == 0:
            assert type_id == TILED_BASE + int(qtype)
        else:
            assert type_id == int(qtype) and tensor is packed
        assert base_type(type_id) == int(qtype)
        out = torch.empty(rows, k)
        ops.gguf_dequantize_rows(out, tensor, type_id, None)
        assert torch.equal(out, torch.from_numpy(reference_dequant(packed.numpy(), qtype)))
    monkeypatch.setenv("PAGEDLLM_GGUF_TILED", "0")
    packed = torch.from_numpy(make_weight(Q.Q4_1, 16, 256, seed=1))
    assert tile_packed(packed, int(Q.Q4_1)) == (packed, int(Q.Q4_1))


def test_layout_ids_name_their_layout_and_base_type():
    """Every regrouped type id is told apart as the C++ kernels tell it (membership, not ranges): the tiled int8 row
    id (TILED_BASE + I8_ROW) equals A2_BASE, and it once read as untiled, sending 16+ row products of an online
    int8 layer on an AVX-512 VNNI CPU to the dense path, which cannot read tiles."""
    from pagedllm.kernels import gguf_ops as g

    for t in g._TILEABLE:
        assert g.is_tiled(g.TILED_BASE + t) and not g.is_a2(g.TILED_BASE + t) and g.base_type(g.TILED_BASE + t) == t
    for t in g._A2_ABLE:
        assert g.is_a2(g.A2_BASE + t) and not g.is_tiled(g.A2_BASE + t) and g.base_type(g.A2_BASE + t) == t
    for t in (0, 1, 2, 8, 12, 14, g.I8_ROW):
        assert not g.is_tiled(t) and not g.is_a2(t) and g.base_type(t) == t
    assert g.is_tiled(g.TILED_BASE + g.I8_ROW) and g.TILED_BASE + g.I8_ROW == g.A2_BASE
