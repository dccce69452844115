"""Soft-capped attention (Gemma 2's attn_logit_softcapping: scores s -> c * tanh(s / c) before the softmax) in the
Triton kernels and backend against the torch reference (GPU; small fp32 cases also run in Triton's interpreter:
TRITON_INTERPRET=1 PAGEDLLM_TEST_DEVICE=cpu). The queries are scaled up so most scores sit past the cap, where a
kernel that does not cap (or caps in the wrong units) is far off."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (installed with CUDA torch)")

from attention_cases import build_batch, kernel_test_device, reference, tolerances

DEVICE = kernel_test_device()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("stale_cuda_memory"),
]

from pagedllm.attention.backend import QKVSpec  # noqa: E402
from pagedllm.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pagedllm.kernels.paged_attention import paged_decode_attention, paged_prefill_attention  # noqa: E402
from pagedllm.kernels.reshape_and_cache import reshape_and_cache_ref  # noqa: E402

BF16, FP32 = torch.bfloat16, torch.float32
INTERPRETED = DEVICE != "cuda"
# (head_size, num_heads, num_kv_heads, block_size, dtype)
CONFIGS = [(64, 8, 2, 16, FP32)] if INTERPRETED else [
    (256, 8, 4, 16, BF16),  # Gemma 2 2B/9B's head size
    (128, 32, 16, 16, BF16), (64, 8, 1, 32, torch.float16), (128, 16, 8, 16, FP32)]
CONFIG_IDS = [f"d{d}-h{h}-kv{kv}-bs{bs}-{str(dt).split('.')[-1]}" for d, h, kv, bs, dt in CONFIGS]
MIXED = [(0, 37), (100, 50), (500, 1), (0, 1), (31, 70), (16, 16), (3, 1), (63, 2), (200, 130)]
CAP = 4.0
Q_GAIN = 6.0  # scores ~ N(0, 6^2): most are past the cap of 4


def _batch(specs, cfg):
    head_size, num_heads, num_kv_heads, block_size, dtype = cfg
    batch = build_batch(specs, num_heads, num_kv_heads, head_size, block_size, dtype, DEVICE)
    batch.query.mul_(Q_GAIN)  # a view into the batch's qkv tensor: scaled in place
    return batch


@pytest.mark.parametrize("window", [None, 45])
@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_soft_capped_mixed_batch(cfg, window):
    dtype = cfg[4]
    batch = _batch(MIXED, cfg)
    ref, _ = reference(batch, window, CAP)
    uncapped, _ = reference(batch, window)
    assert (ref.float() - uncapped.float()).abs().max() > 0.3  # the cap changes the answer
    out = TritonAttentionBackend().forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata,
                                           batch.scale, sliding_window=window, logits_soft_cap=CAP)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref.float(), **tolerances(dtype))
    md = batch.metadata
    for block_m in (16, 64):  # every query tile size (mixed-step CUDA graphs fix the tile)
        out2 = paged_prefill_attention(batch.query, batch.kv_cache, md.block_table, md.seq_lens, md.query_start_loc,
                                       batch.scale, num_seqs=md.num_reqs, max_query_len=md.max_query_len,
                                       block_m=block_m, sliding_window=window, logits_soft_cap=CAP)
        torch.testing.assert_close(out2.float(), ref.float(), **tolerances(dtype))


@pytest.mark.parametrize("window", [None, 45])
@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_soft_capped_decode(cfg, window):
    dtype = cfg[4]
    lens = [1, 2, 15, 16, 17, 63, 64, 65, 129, 300] + ([1000, 4097] if not INTERPRETED else [])
    batch = _batch([(n - 1, 1) for n in lens], cfg)
    ref, _ = reference(batch, window, CAP)
    md = batch.metadata
    reshape_and_cache_ref(batch.key, batch.value, batch.kv_cache, md.slot_mapping)
    by_len = torch.argsort(md.seq_lens, descending=True, stable=True).to(torch.int32)
    for num_splits, block_n in ((1, None), (3, None), (16, 32)) + (((64, None),) if not INTERPRETED else ()):
        for order in (None, by_len):
            out = paged_decode_attention(batch.query, batch.kv_cache, md.block_table, md.seq_lens, batch.scale,
                                         num_seqs=md.num_reqs, num_splits=num_splits, block_n=block_n, order=order,
                                         sliding_window=window, logits_soft_cap=CAP)
            assert not torch.isnan(out).any()
            torch.testing.assert_close(out.float(), ref.float(), **tolerances(dtype))


@pytest.mark.skipif(INTERPRETED, reason="the fused qkv kernel is checked on the GPU")
def test_soft_capped_fused_qkv_path_matches_unfused():
    from pagedllm.kernels.rotary import apply_rotary_ref
    from pagedllm.layers.rotary_embedding import get_rope

    num_heads, num_kv_heads, head_size, block_size, dtype = 8, 4, 256, 16, BF16
    batch = build_batch(MIXED, num_heads, num_kv_heads, head_size, block_size, dtype, DEVICE)
    md = batch.metadata
    num_tokens = batch.query.shape[0]
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size,
                      generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    qkv[:, :num_heads * head_size] *= Q_GAIN
    positions = torch.cat([torch.arange(seq_len - q_len, seq_len) for (_, q_len), seq_len
                           in zip(MIXED, md.seq_lens_cpu)]).to(DEVICE)
    cos_sin = get_rope(head_size, 8192, {"rope_type": "default", "rope_theta": 1e4}).cos_sin_cache.to(DEVICE)
    backend = TritonAttentionBackend()
    spec = QKVSpec(num_heads, num_kv_heads, head_size, batch.scale, logits_soft_cap=CAP)
    out_a = backend.forward_qkv(qkv.clone(), positions, cos_sin, batch.kv_cache.clone(), md, spec)
    assert out_a is not None and not torch.isnan(out_a).any()
    q, k, v = (t.reshape(num_tokens, -1, head_size) for t in qkv.split(
        [num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], -1))
    q, k = apply_rotary_ref(positions, q, k, cos_sin, head_size)
    out_b = backend.forward(q, k, v, batch.kv_cache.clone(), md, batch.scale, logits_soft_cap=CAP)
    torch.testing.assert_close(out_a.float(), out_b.float(), **tolerances(dtype))
    uncapped = backend.forward(q, k, v, batch.kv_cache.clone(), md, batch.scale)
    assert (out_b.float() - uncapped.float()).abs().max() > 0.3
