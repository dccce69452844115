"""FP8 (E4M3) KV cache in the Triton kernels: reshape_and_cache narrows to E4M3, the prefill and decode kernels
widen what they read; against the torch backend over the same FP8 cache. GPU only: with triton 3.6 and numpy 2.4
the interpreter (TRITON_INTERPRET=1) cannot run these attention kernels (a loaded scalar as a loop bound fails,
and patched past that, even the bf16 kernels return garbage), and its float -> E4M3 conversion rounds ~1% of
values wrongly."""
from __future__ import annotations

import pytest
import torch

from attention_cases import build_batch, kernel_test_device

DEVICE = kernel_test_device()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

E4M3 = torch.float8_e4m3fn
SMALL = [(0, 19), (21, 5), (40, 1), (3, 1)]
LARGE = [(0, 300), (900, 64), (2000, 1), (700, 1), (31, 1), (0, 1)]


def _check_written(cache, ref_cache):
    """The E4M3 bytes the kernels wrote equal torch's rounding of the same values."""
    diff = cache.view(torch.uint8) != ref_cache.view(torch.uint8)
    assert not diff.any(), int(diff.sum())


def _tolerance():
    return dict(atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("specs", [SMALL, LARGE])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_backend_reads_and_writes_fp8_kv(specs, dtype):
    from pagedllm.attention.torch_backend import TorchAttentionBackend
    from pagedllm.attention.triton_backend import TritonAttentionBackend

    batch = build_batch(specs, 8, 2, 64, 16, dtype, DEVICE, poison=False)
    cache = batch.kv_cache.to(E4M3)
    ref_cache = cache.clone()
    ref = TorchAttentionBackend().forward(batch.query, batch.key, batch.value, ref_cache, batch.metadata, batch.scale)
    out = TritonAttentionBackend().forward(batch.query, batch.key, batch.value, cache, batch.metadata, batch.scale)
    _check_written(cache, ref_cache)
    torch.testing.assert_close(out.float(), ref.float(), **_tolerance())


def test_decode_only_batch_fp8(dtype=torch.bfloat16):
    from pagedllm.attention.torch_backend import TorchAttentionBackend
    from pagedllm.attention.triton_backend import TritonAttentionBackend

    batch = build_batch([(37, 1), (5, 1), (90, 1)], 8, 2, 64, 16, dtype, DEVICE, poison=False)
    cache = batch.kv_cache.to(E4M3)
    ref_cache = cache.clone()
    ref = TorchAttentionBackend().forward(batch.query, batch.key, batch.value, ref_cache, batch.metadata, batch.scale)
    out = TritonAttentionBackend().forward(batch.query, batch.key, batch.value, cache, batch.metadata, batch.scale)
    torch.testing.assert_close(out.float(), ref.float(), **_tolerance())


@pytest.mark.xfail(reason="k/v scales stay 1.0 (no calibration yet): on the H200 the FP8 pool kept 17, 0 and 10 of 24 "
                          "greedy tokens before the first difference (2026-12-01); issue 14 stays open for it",
                   strict=False)
def test_engine_fp8_kv_on_gpu(smollm2_gguf_path):
    """The whole GPU path (fused qkv write, CUDA graphs, decode/prefill kernels) with an FP8 pool: greedy tokens
    stay close to the bf16 pool's."""
    from pagedllm import LLM, SamplingParams

    prompts = ["The capital of France is", "Write a haiku about the sea.", "List three colors:"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    runs = {}
    for kv in ("auto", "fp8"):
        llm = LLM(model=smollm2_gguf_path, kv_cache_dtype=kv, gpu_memory_utilization=0.3, max_model_len=1024)
        runs[kv] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    agree = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r))
             for r, g in zip(runs["auto"], runs["fp8"])]
    print("fp8 KV greedy agreement on GPU (tokens before the first difference):", agree)
    assert sum(agree) >= 0.5 * sum(len(r) for r in runs["auto"]), agree
