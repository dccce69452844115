"""FP8 (E4M3) KV cache, --kv-cache-dtype fp8: the torch backend (the CPU path) reads and writes it with the
per-layer scales; the engine doubles (fp32: quadruples) its token capacity and stays close to the full-precision
cache; unsupported combinations are refused."""
from __future__ import annotations

import os
import re
import sys

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.attention.torch_backend import TorchAttentionBackend

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "gpu"))
from attention_cases import build_batch  # noqa: E402

E4M3 = torch.float8_e4m3fn
SPECS = [(0, 37), (100, 50), (500, 1), (0, 1), (31, 20), (3, 1)]  # prefills, prefix hits, decodes


def _batch():
    return build_batch(SPECS, 8, 2, 64, 16, torch.float32, "cpu", poison=False)


def test_torch_backend_fp8_cache_equals_attention_over_e4m3_rounded_kv():
    batch = _batch()
    fp8_cache = batch.kv_cache.to(E4M3)
    out = TorchAttentionBackend().forward(batch.query, batch.key, batch.value, fp8_cache, batch.metadata, batch.scale)
    # Reference: the same attention in fp32 over K/V rounded to E4M3 (cached and new alike).
    ref_cache = fp8_cache.float()
    ref = TorchAttentionBackend().forward(batch.query, batch.key.to(E4M3).float(), batch.value.to(E4M3).float(),
                                          ref_cache, batch.metadata, batch.scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(fp8_cache.float(), ref_cache)  # the new tokens were written as E4M3
    full = TorchAttentionBackend().forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(),
                                           batch.metadata, batch.scale)
    err = (out - full).abs()
    assert err.max() < 0.25 and err.mean() < 0.02  # FP8 (3 mantissa bits) against the full-precision cache


def test_per_layer_scales(monkeypatch):
    """With k_scale / v_scale the cache holds K / k_scale, V / v_scale: small values keep their precision."""
    from pagedllm.forward_context import set_forward_context
    from pagedllm.layers.attention import Attention

    batch = _batch()
    layer = Attention(8, 64, batch.scale, 2)
    small = 1e-3  # values this small are E4M3 subnormals at scale 1 (few significant bits)
    t = batch.query.shape[0]
    q, k, v = batch.query.reshape(t, -1), batch.key.reshape(t, -1) * small, batch.value.reshape(t, -1) * small
    outs = {}
    for k_scale in (1.0, small):
        layer.kv_cache = torch.zeros_like(batch.kv_cache, dtype=E4M3)
        layer.kv_scales.fill_(k_scale)
        layer.kv_scale_source = "checkpoint"
        with set_forward_context(batch.metadata, TorchAttentionBackend()):
            outs[k_scale] = layer(q, k, v)
    layer.kv_cache = torch.zeros_like(batch.kv_cache)
    layer.kv_scales.fill_(1.0)
    layer.kv_scale_source = None
    with set_forward_context(batch.metadata, TorchAttentionBackend()):
        exact = layer(q, k, v)
    assert (outs[small] - exact).abs().max() < 0.2 * (outs[1.0] - exact).abs().max()


def _greedy(llm, prompts, n):
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _kv_tokens(caplog) -> int:
    ready = next(r.getMessage() for r in caplog.records if "tokens of KV cache" in r.getMessage())
    return int(re.search(r"= (\d+) tokens of KV cache", ready).group(1))


def test_engine_fp8_kv_capacity_and_greedy_agreement(smollm2_gguf_path, caplog):
    caplog.set_level("INFO", logger="pagedllm")
    prompts = ["The capital of France is", "Write a haiku about the sea."]
    budget = 24 << 20  # 546 tokens at fp32
    full = LLM(model=smollm2_gguf_path, kv_cache_memory_bytes=budget, max_model_len=512)
    ref_tokens = _greedy(full, prompts, 10)
    full_tokens = _kv_tokens(caplog)
    caplog.clear()
    fp8 = LLM(model=smollm2_gguf_path, kv_cache_memory_bytes=budget, max_model_len=512, kv_cache_dtype="fp8")
    got = _greedy(fp8, prompts, 10)
    assert any("KV cache in float8_e4m3fn" in r.getMessage() for r in caplog.records)
    assert _kv_tokens(caplog) == 4 * full_tokens  # fp32 model on the CPU: 4 bytes -> 1 per value
    # Greedy agreement: identical prefixes for most of each continuation (reported, see docs/benchmarks.md).
    agree = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r)) for r, g in zip(ref_tokens, got)]
    print("fp8 KV greedy agreement (tokens before the first difference):", agree)
    assert sum(agree) >= 0.6 * sum(len(r) for r in ref_tokens), agree
    answer = fp8.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=6),
                          use_tqdm=False)[0].outputs[0].text
    assert "Paris" in answer, answer


def test_cpu_backend_with_fp8_kv_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="The cpu attention backend cannot use an FP8 KV cache"):
        LLM(model=tiny_llama_dir, kv_cache_dtype="fp8", attention_backend="cpu", kv_cache_memory_bytes=1 << 20)


def test_fp8_write_saturates():
    """Values past E4M3's range are stored as +-448 (torch's own cast would give NaN from 480 on)."""
    from pagedllm.attention.torch_backend import write_kv_cache

    cache = torch.zeros(2, 1, 4, 1, 2, dtype=E4M3)
    key = torch.tensor([[[1000.0, -600.0]], [[1.0, 2.0]]])
    write_kv_cache(key, -key, cache, torch.tensor([0, 1]), 2)
    assert cache[0, 0, 0, 0].float().tolist() == [448.0, -448.0]
    assert cache[1, 0, 0, 0].float().tolist() == [-448.0, 448.0]
    assert not cache.float().isnan().any()
