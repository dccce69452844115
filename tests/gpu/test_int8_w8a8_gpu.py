"""The W8A8 kernels on the GPU (kernels/quant_act.int8_per_token; kernels/w8a8_gemm for INT8 and FP8) at
model-layer shapes, with the engine's launch configs, against the torch form (the same checks run in Triton's interpreter in CI:
tests/quantization/test_int8_w8a8_kernels.py)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (installed with CUDA torch)")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "quantization"))
from int8_w8a8_cases import check_activation_quant, check_fp8_gemm, check_gemm, check_norm_quant  # noqa: E402


def test_activation_quant_matches_torch():
    check_activation_quant("cuda", ks=(64, 300, 4096, 14336))


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (1000, 3000)])
def test_gemm_default_launches_match_torch(n, k):
    # (1-4 rows: the GEMV on int32 words, 5 on: the tiles)
    check_gemm("cuda", [(m, n, k) for m in (1, 2, 4, 5, 7, 16, 33, 64, 200, 1024)], [None], exact_bias=False)
    # the GEMV past its rows, on int32 words (dp4a) and byte by byte
    check_gemm("cuda", [(m, n, k) for m in (1, 3, 8)], [dict(GEMV=True, WORDS=False), dict(GEMV=True, WORDS=True)],
               exact_bias=False)


def test_linear_against_torch_form():
    """int8_w8a8_linear on CUDA (the two kernels) equals its torch form (torch._int_mm), dynamic and static
    activation scales, 3-D input."""
    from pagedllm.kernels.w8a8_gemm import counters_for
    from pagedllm.quantization.kernels import int8_w8a8_linear, int8_w8a8_linear_torch

    gen = torch.Generator().manual_seed(2)
    w = torch.randint(-128, 128, (512, 1024), generator=gen, dtype=torch.int8).cuda()
    ws = (torch.rand(512, generator=gen) * 0.01 + 1e-4).cuda()
    counters = counters_for(512, torch.device("cuda"))
    for rows in (1, 12, 96):
        x = (torch.randn(2, rows, 1024, generator=gen) * 2).to(torch.bfloat16).cuda()
        for static in (None, torch.tensor([0.02], device="cuda")):
            got = int8_w8a8_linear(x, w, ws, None, static, counters)
            want = int8_w8a8_linear_torch(x.reshape(-1, 1024), w, ws, None, static).reshape(2, rows, 512)
            assert torch.equal(got, want), (rows, static)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 tensor cores: compute capability 8.9+")
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (1000, 3000)])
def test_fp8_gemm_default_launches(n, k):
    check_fp8_gemm("cuda", [(m, n, k) for m in (1, 2, 7, 16, 33, 64, 200)], [None])


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 tensor cores: compute capability 8.9+")
def test_fp8_linear_triton_against_scaled_mm():
    """fp8_linear's Triton GEMM (a few rows) and torch._scaled_mm give the same product to fp32 summation order:
    dynamic and static activation scales, bias, 3-D input; the split-K counters back at zero."""
    from pagedllm.kernels.w8a8_gemm import counters_for
    from pagedllm.quantization.fp8 import quantize_weight_fp8_per_channel
    from pagedllm.quantization.kernels import fp8_linear

    gen = torch.Generator().manual_seed(4)
    w, ws = quantize_weight_fp8_per_channel((torch.randn(1536, 4096, generator=gen) * 0.02).cuda())
    bias = (torch.randn(1536, generator=gen) * 0.1).to(torch.bfloat16).cuda()
    counters = counters_for(1536, torch.device("cuda"))
    for rows in (1, 9, 32):
        x = (torch.randn(2, rows, 4096, generator=gen) * 2).to(torch.bfloat16).cuda()
        for static in (None, torch.tensor([0.02], device="cuda")):
            for b in (None, bias):
                got = fp8_linear(x, w, ws, b, static, counters, backend="triton")
                want = fp8_linear(x, w, ws, b, static, backend="scaled_mm")
                assert got.shape == want.shape == (2, rows, 1536)
                # the outputs are ~2.5: up to one bf16 step (1/64) apart where the two summation orders round apart
                torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1.6e-2)
                assert int(counters.abs().sum()) == 0


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 tensor cores: compute capability 8.9+")
def test_norm_quant_matches_two_kernels():
    """kernels/norm.rms_norm_quant at model hidden sizes equals the norm then quant_act's kernel, bit for bit (every
    activation dtype: Triton's interpreter in CI)."""
    check_norm_quant("cuda", hiddens=(4096, 5120), rows=7, dtypes=(torch.bfloat16,))


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 tensor cores: compute capability 8.9+")
def test_norms_quantize_for_their_w8a8_layers(tiny_llama_dir, monkeypatch):
    """An FP8 model on CUDA: each decoder layer's two norms quantize for qkv_proj / gate_up_proj (linked at load),
    so only o_proj and down_proj run the activation kernel (half the calls), and the greedy tokens are those of
    the unfused model."""
    import gc

    from pagedllm import LLM, SamplingParams
    from pagedllm.kernels import quant_act
    from pagedllm.layers import layernorm

    calls = []
    per_token = quant_act._per_token

    def counted(*args):
        calls.append(1)
        return per_token(*args)

    monkeypatch.setattr(quant_act, "_per_token", counted)
    prompts = [{"prompt_token_ids": p} for p in ([5, 9, 3, 17, 2, 11, 30, 8], [40, 2, 2, 7], [3] * 20)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = {}
    for fuse in (False, True):
        monkeypatch.setattr(layernorm, "FUSE_NORM_QUANT", fuse)
        llm = LLM(model=tiny_llama_dir, dtype="bfloat16", device="cuda", quantization="fp8", enforce_eager=True,
                  num_gpu_blocks_override=64)
        layers = llm.engine.worker.model.model.layers
        for layer in layers:
            assert (layer.input_layernorm.quant_consumer is layer.self_attn.qkv_proj) == fuse
            assert (layer.post_attention_layernorm.quant_consumer is layer.mlp.gate_up_proj) == fuse
        calls.clear()
        outs = llm.generate(prompts, params, use_tqdm=False)
        got[fuse] = ([list(o.outputs[0].token_ids) for o in outs], len(calls))
        assert not any("_prequantized" in m.__dict__ for m in llm.engine.worker.model.modules())  # all taken
        del llm, layers, outs
        gc.collect()
        torch.cuda.empty_cache()
    assert got[True][0] == got[False][0]
    assert got[False][1] > 0 and got[True][1] * 2 == got[False][1], got
