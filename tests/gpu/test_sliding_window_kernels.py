"""Sliding-window attention in the Triton kernels and backend against the torch references (GPU; small fp32 cases
also run in Triton's interpreter: TRITON_INTERPRET=1 PAGEDLLM_TEST_DEVICE=cpu).

Blocks wholly before a row's window are what the KV manager frees: their block-table entries point at block 0 here,
which build_batch leaves NaN, so a kernel that reads them (or lets them into its sums) fails."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (installed with CUDA torch)")

from attention_cases import (build_batch, capture_graph, config_ids, decode_graph_inputs, kernel_test_device,
                             reference, tolerances)

DEVICE = kernel_test_device()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("stale_cuda_memory"),
]

from pagedllm.attention.backend import QKVSpec  # noqa: E402
from pagedllm.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from pagedllm.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pagedllm.kernels.paged_attention import (  # noqa: E402
    paged_attention_ref,
    paged_decode_attention,
    paged_prefill_attention,
)
from pagedllm.kernels.reshape_and_cache import reshape_and_cache_ref  # noqa: E402

BF16, FP32 = torch.bfloat16, torch.float32
INTERPRETED = DEVICE != "cuda"
# (head_size, num_heads, num_kv_heads, block_size, dtype)
CONFIGS = [(64, 8, 2, 16, FP32)] if INTERPRETED else [
    (128, 32, 8, 16, BF16), (64, 32, 4, 32, BF16), (96, 12, 4, 16, BF16), (128, 16, 2, 16, torch.float16),
    (128, 32, 8, 16, FP32), (64, 8, 1, 32, FP32)]
CONFIG_IDS = config_ids(CONFIGS)
# (cached_len, query_len): chunks longer than the window, after cached context, decodes before / past the window.
MIXED = [(0, 37), (100, 50), (500, 1), (0, 1), (31, 70), (16, 16), (3, 1), (63, 2), (200, 130)]
WINDOWS = [1, 16, 45, 128] if not INTERPRETED else [16, 45]


def _stale_before_window(batch, window):
    """Point the table entries of blocks wholly before each row's window at block 0 (NaN)."""
    md = batch.metadata
    bs = batch.kv_cache.shape[2]
    table = md.block_table.cpu()
    for i, (seq_len, q0, q1) in enumerate(zip(md.seq_lens_cpu, md.query_start_loc_cpu, md.query_start_loc_cpu[1:])):
        first_seen = max(0, seq_len - (q1 - q0) - window + 1)
        table[i, :first_seen // bs] = 0
    md.block_table = table.to(md.block_table.device)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_windowed_mixed_batch(cfg, window):
    head_size, num_heads, num_kv_heads, block_size, dtype = cfg
    batch = build_batch(MIXED, num_heads, num_kv_heads, head_size, block_size, dtype, DEVICE)
    _stale_before_window(batch, window)
    ref, _ = reference(batch, window)
    out = TritonAttentionBackend().forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata,
                                           batch.scale, sliding_window=window)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref.float(), **tolerances(dtype))
    # Every query tile size gives the same answer (mixed-step CUDA graphs fix the tile; small ones for decodes).
    md = batch.metadata
    for block_m in (16, 64):
        out2 = paged_prefill_attention(batch.query, batch.kv_cache, md.block_table, md.seq_lens, md.query_start_loc,
                                       batch.scale, num_seqs=md.num_reqs, max_query_len=md.max_query_len,
                                       block_m=block_m, sliding_window=window)
        torch.testing.assert_close(out2.float(), ref.float(), **tolerances(dtype))


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_windowed_decode(cfg, window):
    head_size, num_heads, num_kv_heads, block_size, dtype = cfg
    lens = [1, 2, 15, 16, 17, 63, 64, 65, 129, 300] + ([1000, 4097] if not INTERPRETED else [])
    batch = build_batch([(n - 1, 1) for n in lens], num_heads, num_kv_heads, head_size, block_size, dtype, DEVICE)
    _stale_before_window(batch, window)
    ref, _ = reference(batch, window)
    md = batch.metadata
    reshape_and_cache_ref(batch.key, batch.value, batch.kv_cache, md.slot_mapping)
    by_len = torch.argsort(md.seq_lens, descending=True, stable=True).to(torch.int32)
    for num_splits, block_n in ((1, None), (3, None), (16, 32)) + (((64, None),) if not INTERPRETED else ()):
        for order in (None, by_len):
            out = paged_decode_attention(batch.query, batch.kv_cache, md.block_table, md.seq_lens, batch.scale,
                                         num_seqs=md.num_reqs, num_splits=num_splits, block_n=block_n, order=order,
                                         sliding_window=window)
            assert not torch.isnan(out).any()
            torch.testing.assert_close(out.float(), ref.float(), **tolerances(dtype))
    out = paged_prefill_attention(batch.query, batch.kv_cache, md.block_table, md.seq_lens, md.query_start_loc,
                                  batch.scale, num_seqs=md.num_reqs, max_query_len=1, sliding_window=window)
    torch.testing.assert_close(out.float(), ref.float(), **tolerances(dtype))


def test_window_wider_than_every_context_is_full_attention():
    head_size, num_heads, num_kv_heads, block_size, dtype = CONFIGS[0]
    batch = build_batch(MIXED, num_heads, num_kv_heads, head_size, block_size, dtype, DEVICE)
    ref, _ = reference(batch, None)
    out = TritonAttentionBackend().forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata,
                                           batch.scale, sliding_window=10_000)
    torch.testing.assert_close(out.float(), ref.float(), **tolerances(dtype))
    narrow = TritonAttentionBackend().forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(),
                                              batch.metadata, batch.scale, sliding_window=8)
    assert (narrow.float() - ref.float()).abs().max() > 0.05  # the window changes the answer


@pytest.mark.skipif(INTERPRETED, reason="the interpreter cannot run the FP8 kernels (test_kv_fp8_kernels.py)")
@pytest.mark.parametrize("specs", [MIXED, [(n - 1, 1) for n in (5, 17, 64, 65, 1000)]], ids=["mixed", "decode"])
def test_windowed_fp8_cache(specs):
    batch = build_batch(specs, 8, 2, 64, 16, BF16, DEVICE, poison=False)
    cache = batch.kv_cache.to(torch.float8_e4m3fn)
    ref_cache = cache.clone()
    ref = TorchAttentionBackend().forward(batch.query, batch.key, batch.value, ref_cache, batch.metadata, batch.scale,
                                          sliding_window=24)
    out = TritonAttentionBackend().forward(batch.query, batch.key, batch.value, cache, batch.metadata, batch.scale,
                                           sliding_window=24)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(INTERPRETED, reason="the fused qkv kernel is checked on the GPU")
def test_windowed_fused_qkv_path_matches_unfused():
    from pagedllm.kernels.rotary import apply_rotary_ref
    from pagedllm.layers.rotary_embedding import get_rope

    num_heads, num_kv_heads, head_size, block_size, dtype, window = 16, 8, 128, 16, BF16, 40
    batch = build_batch(MIXED, num_heads, num_kv_heads, head_size, block_size, dtype, DEVICE)
    _stale_before_window(batch, window)
    md = batch.metadata
    num_tokens = batch.query.shape[0]
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size,
                      generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    positions = torch.cat([torch.arange(seq_len - q_len, seq_len) for (_, q_len), seq_len
                           in zip(MIXED, md.seq_lens_cpu)]).to(DEVICE)
    cos_sin = get_rope(head_size, 8192, {"rope_type": "default", "rope_theta": 1e6}).cos_sin_cache.to(DEVICE)
    backend = TritonAttentionBackend()
    cache_a = batch.kv_cache.clone()
    spec = QKVSpec(num_heads, num_kv_heads, head_size, batch.scale, sliding_window=window)
    out_a = backend.forward_qkv(qkv.clone(), positions, cos_sin, cache_a, md, spec)
    assert out_a is not None and not torch.isnan(out_a).any()
    q, k, v = (t.reshape(num_tokens, -1, head_size) for t in qkv.split(
        [num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], -1))
    q, k = apply_rotary_ref(positions, q, k, cos_sin, head_size)
    out_b = backend.forward(q, k, v, batch.kv_cache.clone(), md, batch.scale, sliding_window=window)
    torch.testing.assert_close(out_a.float(), out_b.float(), **tolerances(dtype))


@pytest.mark.skipif(INTERPRETED, reason="CUDA graphs need a GPU")
def test_windowed_decode_cuda_graph_replay():
    """A decode forward with a window captured once, replayed with new lengths and tables (stale before windows)."""
    num_seqs, num_heads, num_kv_heads, head_size, block_size, dtype, window = 8, 32, 8, 128, 16, BF16, 100
    q, k, v, kv_cache, out, md, backend = decode_graph_inputs(num_seqs, num_heads, num_kv_heads, head_size,
                                                              block_size, dtype, 1024)
    seq_lens, block_table, slot_mapping, qsl = md.seq_lens, md.block_table, md.slot_mapping, md.query_start_loc
    num_blocks, max_blocks = kv_cache.shape[1], block_table.shape[1]
    scale = head_size ** -0.5

    def fill(step: int) -> None:
        gen = torch.Generator().manual_seed(step)
        lens = torch.randint(1, 1024, (num_seqs,), generator=gen)
        table = (torch.randperm(num_blocks - 1, generator=gen) + 1)[:num_seqs * max_blocks].view(num_seqs, -1)
        kv_cache.fill_(float("nan"))
        for i, n in enumerate(lens.tolist()):
            pos = torch.arange(max(0, n - window), n - 1)
            slots = (table[i, pos // block_size].long() * block_size + pos % block_size).cuda()
            kv_cache.view(2, -1, num_kv_heads, head_size)[:, slots] = torch.randn(
                2, len(pos), num_kv_heads, head_size, device="cuda").to(dtype)
            table[i, :max(0, n - window) // block_size] = 0  # freed: block 0 is NaN
        last = lens - 1
        slot_mapping.copy_(table[torch.arange(num_seqs), last // block_size].long() * block_size + last % block_size)
        seq_lens.copy_(lens)
        block_table.copy_(table.to(torch.int32))
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, generator=gen).to(dtype))

    fill(0)
    graph = capture_graph(lambda: backend.forward(q, k, v, kv_cache, md, scale, output=out, sliding_window=window))
    for step in range(1, 4):
        fill(step)
        graph.replay()
        torch.cuda.synchronize()
        ref = paged_attention_ref(q, kv_cache, block_table, seq_lens, qsl, scale, sliding_window=window)
        assert not torch.isnan(out).any()
        torch.testing.assert_close(out.float(), ref.float(), **tolerances(dtype))
