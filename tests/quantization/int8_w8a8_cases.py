"""Checks of the CUDA W8A8 kernels (kernels/quant_act.int8_per_token, kernels/w8a8_gemm for int8 and FP8) against
the torch form of `quantization.kernels` (shared by the interpreter run in CI, tests/quantization/interpret_int8.py, and
the GPU tests, tests/gpu/test_int8_w8a8_gpu.py)."""
from __future__ import annotations

import torch

from pagedllm.quantization.kernels import quantize_int8_per_token


def check_activation_quant(device: str, ks=(64, 300, 9000)) -> None:
    """Per-token int8 quantization equals the torch reference exactly: the scale (amax / 127), every value,
    ties rounded to even, the clamp, a zero row, and one static scale (values past the int8 range clamp)."""
    from pagedllm.kernels.quant_act import int8_per_token

    gen = torch.Generator().manual_seed(0)
    for k in ks:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = torch.randn(5, k, generator=gen) * 3
            x[1] = 0.0
            # row 2: amax 127 -> scale exactly 1, so x / scale is x: halves are ties, both parities
            x[2, :8] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, -126.5])
            x[2, 8:] = x[2, 8:].clamp(-100, 100).round() + 0.5
            x = x.to(dtype)
            want_q, want_s = quantize_int8_per_token(x)
            q, s = int8_per_token(x.to(device))
            assert torch.equal(s.cpu(), want_s), (k, dtype)
            assert torch.equal(q.cpu(), want_q), (k, dtype, (q.cpu().int() - want_q.int()).abs().max())
            static = torch.tensor([0.01])
            want_q, want_s = quantize_int8_per_token(x, static)
            q, s = int8_per_token(x.to(device), static.to(device))
            assert torch.equal(q.cpu(), want_q) and torch.equal(s.cpu(), want_s.expand(x.shape[0], 1)), (k, dtype)
            assert (want_q == 127).any() and (want_q == -128).any()  # the static scale clamps


def check_norm_quant(device: str, hiddens=(64, 300), rows: int = 5,
                     dtypes=(torch.float32, torch.bfloat16, torch.float16)) -> None:
    """kernels/norm.rms_norm_quant equals its two kernels (the norm, then quant_act's per-token quantization of its
    output) bit for bit: the output, the new residual, the quantized values and the scales; int8 and FP8, with and
    without the residual, Llama's and Gemma's (float32 product) norms, every activation dtype, a zero row."""
    from pagedllm.kernels.norm import fused_add_rms_norm, rms_norm, rms_norm_quant
    from pagedllm.kernels.quant_act import fp8_per_token, int8_per_token

    gen = torch.Generator().manual_seed(4)
    for hidden in hiddens:
        for dtype in dtypes:
            x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype).to(device)
            w = (torch.randn(hidden, generator=gen) * 0.5 + 1).to(dtype).to(device)
            r = torch.randn(rows, hidden, generator=gen).to(dtype).to(device)
            x[1] = 0
            r[1] = 0
            for quant_dtype, quantize in ((torch.int8, int8_per_token), (torch.float8_e4m3fn, fp8_per_token)):
                for residual in (None, r):
                    for fp32_product in (False, True):
                        label = (hidden, dtype, quant_dtype, residual is not None, fp32_product)
                        out, new_res, (q, scale) = rms_norm_quant(x, residual, w, 1e-6, fp32_product, quant_dtype)
                        if residual is None:
                            want, want_res = rms_norm(x, w, 1e-6, fp32_product), None
                        else:
                            want, want_res = fused_add_rms_norm(x, residual, w, 1e-6, fp32_product)
                        assert torch.equal(out, want), label
                        assert new_res is None if residual is None else torch.equal(new_res, want_res), label
                        want_q, want_scale = quantize(want)
                        assert torch.equal(scale, want_scale), label
                        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)), label
                        assert scale[1].item() == torch.tensor(1e-12).item(), label  # the zero row


def reference_linear(x_q, x_scale, weight, weight_scale, bias, dtype):
    """The torch form's arithmetic: exact int32 sums, then its fp32 epilogue. The sums in float64 on the tensors'
    device (exact: at most 128 * 128 * K < 2 ** 53), which is fast on a GPU where an int64 matmul is not."""
    acc = (x_q.double() @ weight.double().t()).to(torch.int32)
    out = acc.float() * x_scale.reshape(-1, 1) * weight_scale.reshape(1, -1)
    out = out if bias is None else out + bias.float()
    return out.to(dtype)


GPU_OUTPUTS = ((torch.bfloat16, False), (torch.float16, True), (torch.bfloat16, True))
# Triton's interpreter narrows fp32 to bf16 by truncation (a GPU rounds to nearest): fp32 and fp16 there
INTERPRETER_OUTPUTS = ((torch.float32, False), (torch.float16, True), (torch.float32, True))


def check_gemm(device: str, shapes, configs, exact_bias: bool = True, outputs=GPU_OUTPUTS) -> None:
    """w8a8_gemm (int8; tiles or the GEMV) against `reference_linear`: rows past a tile, columns past a tile, K not
    a multiple of the K step, split K (the counters back at zero after every call), with and without bias, in each
    (out dtype, bias) of `outputs`. Exact without bias; with bias exact where `exact_bias` (a GPU may fuse the
    scale product and the bias add into one FMA)."""
    from pagedllm.kernels.w8a8_gemm import counters_for, w8a8_gemm

    gen = torch.Generator().manual_seed(1)
    for m, n, k in shapes:
        x_q = torch.randint(-128, 128, (m, k), generator=gen, dtype=torch.int8)
        w = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        x_scale = torch.rand(m, 1, generator=gen) * 0.01 + 1e-4
        w_scale = torch.rand(n, generator=gen) * 0.01 + 1e-4
        bias = torch.randn(n, generator=gen)
        counters = counters_for(n, torch.device(device))
        for cfg in configs:
            for dtype, with_bias in outputs:
                b = bias.to(dtype=dtype, device=device) if with_bias else None
                args = (x_q.to(device), x_scale.to(device), w.to(device), w_scale.to(device), b)
                want = reference_linear(*args, dtype).cpu()
                got = w8a8_gemm(*args[:4], b, dtype, counters, cfg).cpu()
                label = (m, n, k, cfg, dtype, with_bias)
                if with_bias and not exact_bias:
                    torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-3, msg=str(label))
                else:
                    assert torch.equal(got, want), (label, (got.float() - want.float()).abs().max())
                assert int(counters.abs().sum()) == 0, label


def check_fp8_gemm(device: str, shapes, configs, outputs=GPU_OUTPUTS) -> None:
    """w8a8_gemm on E4M3 operands against float64 sums of the same values with the torch form's epilogue: rows and
    columns past a tile, K past the K step, split K (counters back at zero). FP8 sums are the tensor cores' (fp32
    between 32-deep steps), so the bound is a fraction of the sum of |x| |w| plus the output's rounding."""
    from pagedllm.kernels.w8a8_gemm import counters_for, w8a8_gemm

    gen = torch.Generator().manual_seed(3)
    for m, n, k in shapes:
        x_q = (torch.randn(m, k, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
        w = (torch.randn(n, k, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
        x_scale = torch.rand(m, 1, generator=gen) * 0.01 + 1e-4
        w_scale = torch.rand(n, generator=gen) * 0.01 + 1e-4
        bias = torch.randn(n, generator=gen)
        sums = x_q.double() @ w.double().t()
        # Hopper's FP8 MMA adds with ~14-bit alignment within each 32-deep step: 2^-12 of the sum of |products|
        bound = (x_q.double().abs() @ w.double().abs().t()) * 2.0 ** -12 * x_scale.double() * w_scale.double()
        counters = counters_for(n, torch.device(device))
        for cfg in configs:
            for dtype, with_bias in outputs:
                b = bias.to(dtype) if with_bias else None
                want = sums.float() * x_scale * w_scale.reshape(1, -1)
                want = want if b is None else want + b.float()
                got = w8a8_gemm(x_q.to(device), x_scale.to(device), w.to(device), w_scale.to(device),
                                None if b is None else b.to(device), dtype, counters, cfg).cpu()
                rounding = want.abs() * {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}.get(dtype, 2.0 ** -22)
                err = (got.double() - want.double()).abs()
                label = (m, n, k, cfg, dtype, with_bias)
                assert (err <= bound + rounding.double() + 1e-6).all(), (label, float((err - bound).max()))
                assert int(counters.abs().sum()) == 0, label
