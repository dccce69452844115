"""Triton paged-attention kernels and backend against the pure-torch references (GPU only)."""
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
    pytest.mark.usefixtures("stale_cuda_memory"),  # outputs and split partials start as NaN (conftest.py)
]

from pagedllm.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pagedllm.kernels.paged_attention import (  # noqa: E402
    paged_attention_ref,
    paged_decode_attention,
    paged_prefill_attention,
)
from pagedllm.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref  # noqa: E402

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# (head_size, num_heads, num_kv_heads, block_size, dtype): GQA ratios 1..8, head sizes 64/80/96/128.
CONFIGS = [
    (128, 32, 8, 16, BF16),  # Llama-3-8B: GQA 4
    (128, 8, 8, 32, BF16),  # MHA
    (64, 16, 8, 16, BF16),  # GQA 2
    (64, 32, 4, 32, BF16),  # GQA 8
    (128, 16, 2, 16, FP16),  # GQA 8, fp16
    (96, 12, 4, 16, BF16),  # padded head size, GQA 3
    (80, 10, 2, 32, BF16),  # padded head size, GQA 5
    (128, 32, 8, 16, FP32),
    (64, 8, 1, 32, FP32),  # MQA-like GQA 8
]
CONFIG_IDS = config_ids(CONFIGS)

# (cached_len, query_len): fresh prefills, prefix-cache hits / later chunks, decodes, block edges.
MIXED_SPECS = [(0, 37), (100, 50), (500, 1), (0, 1), (31, 200), (16, 16), (1000, 129), (3, 1), (0, 300),
               (63, 2), (127, 1)]


def _check_cache_and_output(batch, out, dtype):
    ref, ref_cache = reference(batch)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref.float(), **tolerances(dtype))
    return ref_cache


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_reshape_and_cache(cfg):
    head_size, num_heads, num_kv_heads, block_size, dtype = cfg
    batch = build_batch([(5, 40), (0, 17), (33, 1)], num_heads, num_kv_heads, head_size, block_size, dtype, DEVICE)
    ref_cache = batch.kv_cache.clone()
    reshape_and_cache_ref(batch.key, batch.value, ref_cache, batch.metadata.slot_mapping)
    reshape_and_cache(batch.key, batch.value, batch.kv_cache, batch.metadata.slot_mapping)
    torch.testing.assert_close(batch.kv_cache, ref_cache, rtol=0, atol=0, equal_nan=True)


def test_reshape_and_cache_skips_negative_slots():
    batch = build_batch([(0, 8)], 8, 2, 64, 16, BF16, DEVICE)
    slots = batch.metadata.slot_mapping.clone()
    slots[5:] = -1  # padding rows
    before = batch.kv_cache.clone()
    reshape_and_cache(batch.key, batch.value, batch.kv_cache, slots)
    ref = before.clone()
    reshape_and_cache_ref(batch.key, batch.value, ref, slots)
    torch.testing.assert_close(batch.kv_cache, ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_mixed_batch(cfg):
    head_size, num_heads, num_kv_heads, block_size, dtype = cfg
    batch = build_batch(MIXED_SPECS, num_heads, num_kv_heads, head_size, block_size, dtype, DEVICE)
    out = TritonAttentionBackend().forward(batch.query, batch.key, batch.value, batch.kv_cache,
                                           batch.metadata, batch.scale)
    ref_cache = _check_cache_and_output(batch, out, dtype)
    torch.testing.assert_close(batch.kv_cache, ref_cache, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("max_query_len_specs", [
    [(0, 3), (10, 2), (40, 4), (7, 1)],  # speculative-decoding-like short chunks (small tiles)
    [(0, 1), (5, 1), (0, 2)],
])
@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[3], CONFIGS[7]], ids=[CONFIG_IDS[0], CONFIG_IDS[3], CONFIG_IDS[7]])
def test_short_chunks(cfg, max_query_len_specs):
    head_size, num_heads, num_kv_heads, block_size, dtype = cfg
    batch = build_batch(max_query_len_specs, num_heads, num_kv_heads, head_size, block_size, dtype, DEVICE)
    out = TritonAttentionBackend().forward(batch.query, batch.key, batch.value, batch.kv_cache,
                                           batch.metadata, batch.scale)
    _check_cache_and_output(batch, out, dtype)


@pytest.mark.skipif(DEVICE != "cuda", reason="too large for the interpreter")
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_long_prefill(dtype):
    specs = [(0, 2048), (4096, 512), (1, 1), (20000, 1)]
    batch = build_batch(specs, 32, 8, 128, 16, dtype, DEVICE)
    out = TritonAttentionBackend().forward(batch.query, batch.key, batch.value, batch.kv_cache,
                                           batch.metadata, batch.scale)
    _check_cache_and_output(batch, out, dtype)


DECODE_LENS = [1, 2, 15, 16, 17, 63, 64, 65, 129, 1000, 4097]


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_decode(cfg):
    head_size, num_heads, num_kv_heads, block_size, dtype = cfg
    specs = [(n - 1, 1) for n in DECODE_LENS]
    batch = build_batch(specs, num_heads, num_kv_heads, head_size, block_size, dtype, DEVICE)
    md = batch.metadata
    out = TritonAttentionBackend().forward(batch.query, batch.key, batch.value, batch.kv_cache, md, batch.scale)
    _check_cache_and_output(batch, out, dtype)
    # Every split count gives the same answer (1 = direct write, others go through the reducer).
    for num_splits in (1, 3, 64):
        out2 = paged_decode_attention(batch.query, batch.kv_cache, md.block_table, md.seq_lens, batch.scale,
                                      num_seqs=md.num_reqs, num_splits=num_splits)
        _check_cache_and_output(batch, out2, dtype)
    # An order (longest context first, or any other permutation) only changes the programs' start order.
    by_len = torch.argsort(md.seq_lens, descending=True, stable=True).to(torch.int32)
    shuffled = torch.randperm(md.num_reqs, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    # (16 splits with 32-position tiles is the tiny-context launch.)
    for num_splits, block_n in ((1, None), (4, None), (16, 32)):
        plain = paged_decode_attention(batch.query, batch.kv_cache, md.block_table, md.seq_lens, batch.scale,
                                       num_seqs=md.num_reqs, num_splits=num_splits, block_n=block_n)
        _check_cache_and_output(batch, plain, dtype)
        for order in (by_len, shuffled.to(DEVICE)):
            out4 = paged_decode_attention(batch.query, batch.kv_cache, md.block_table, md.seq_lens, batch.scale,
                                          num_seqs=md.num_reqs, num_splits=num_splits, block_n=block_n, order=order)
            torch.testing.assert_close(out4, plain, atol=0, rtol=0)  # same programs, same arithmetic
    # The mixed kernel handles the same decode rows too.
    out3 = paged_prefill_attention(batch.query, batch.kv_cache, md.block_table, md.seq_lens, md.query_start_loc,
                                   batch.scale, num_seqs=md.num_reqs, max_query_len=1)
    _check_cache_and_output(batch, out3, dtype)


@pytest.mark.skipif(DEVICE != "cuda", reason="too large for the interpreter")
@pytest.mark.parametrize("num_seqs,ctx", [(1, 32768), (3, 16384), (200, 300), (64, 2048)])
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_decode_long_and_wide(num_seqs, ctx, dtype):
    specs = [(ctx - 1 - (i * 7) % 50, 1) for i in range(num_seqs)]
    batch = build_batch(specs, 32, 8, 128, 16, dtype, DEVICE)
    out = TritonAttentionBackend().forward(batch.query, batch.key, batch.value, batch.kv_cache,
                                           batch.metadata, batch.scale)
    _check_cache_and_output(batch, out, dtype)


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_decode_zero_length_rows_give_zeros(dtype):
    """CUDA-graph padding requests have seq_len 0: zero output, no cache reads, no NaN."""
    batch = build_batch([(10, 1), (300, 1), (0, 1), (0, 1)], 32, 8, 128, 16, dtype, DEVICE)
    md = batch.metadata
    seq_lens = md.seq_lens.clone()
    seq_lens[2:] = 0
    for num_splits in (1, 4):
        reshape_and_cache(batch.key, batch.value, batch.kv_cache, md.slot_mapping)
        out = paged_decode_attention(batch.query, batch.kv_cache, md.block_table, seq_lens, batch.scale,
                                     num_seqs=4, num_splits=num_splits)
        assert torch.count_nonzero(out[2:]) == 0
        ref = paged_attention_ref(batch.query, batch.kv_cache, md.block_table, seq_lens, md.query_start_loc,
                                  batch.scale)
        torch.testing.assert_close(out.float(), ref.float(), **tolerances(dtype))


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("num_seqs", [1, 8, 128])
def test_decode_cuda_graph_replay(num_seqs):
    """Capture one decode forward, then replay it with new seq_lens, block tables and inputs."""
    num_heads, num_kv_heads, head_size, block_size, dtype = 32, 8, 128, 16, BF16
    q, k, v, kv_cache, out, md, backend = decode_graph_inputs(num_seqs, num_heads, num_kv_heads, head_size,
                                                              block_size, dtype, 4096)
    seq_lens, block_table, slot_mapping, qsl = md.seq_lens, md.block_table, md.slot_mapping, md.query_start_loc
    num_blocks, max_blocks = kv_cache.shape[1], block_table.shape[1]
    scale = head_size ** -0.5

    def fill(step: int) -> None:
        gen = torch.Generator().manual_seed(step)
        lens = torch.randint(1, 4096, (num_seqs,), generator=gen)
        if step == 0:
            lens[0] = 4095
        perm = torch.randperm(num_blocks - 1, generator=gen) + 1
        table = perm[: num_seqs * max_blocks].view(num_seqs, max_blocks).to(torch.int32)
        kv_cache.fill_(float("nan"))
        # Context before the new token: random K/V at its slots.
        for i, n in enumerate(lens.tolist()):
            pos = torch.arange(n - 1)
            slots = (table[i, pos // block_size].long() * block_size + pos % block_size).cuda()
            kv_cache.view(2, -1, num_kv_heads, head_size)[:, slots] = torch.randn(
                2, n - 1, num_kv_heads, head_size, device="cuda").to(dtype)
        last = lens - 1
        new_slots = table[torch.arange(num_seqs), last // block_size].long() * block_size + last % block_size
        seq_lens.copy_(lens)
        block_table.copy_(table)
        slot_mapping.copy_(new_slots)
        q.copy_(torch.randn_like(q, dtype=torch.float32))
        k.copy_(torch.randn_like(k, dtype=torch.float32))
        v.copy_(torch.randn_like(v, dtype=torch.float32))

    fill(0)
    graph = capture_graph(lambda: backend.forward(q, k, v, kv_cache, md, scale, output=out))
    for step in range(1, 4):
        fill(step)
        graph.replay()
        torch.cuda.synchronize()
        ref_cache = kv_cache.clone()
        ref = paged_attention_ref(q, ref_cache, block_table, seq_lens, qsl, scale)
        assert not torch.isnan(out).any()
        torch.testing.assert_close(out.float(), ref.float(), **tolerances(dtype))
        # The graph wrote the new tokens' K/V.
        flat = kv_cache.view(2, -1, num_kv_heads, head_size)
        torch.testing.assert_close(flat[0, slot_mapping], k, rtol=0, atol=0)
        torch.testing.assert_close(flat[1, slot_mapping], v, rtol=0, atol=0)


def test_decode_splits_follow_the_context_bucket():
    """Short contexts cap the split count (empty split programs are not free); graphs are captured per bucket."""
    from pagedllm.kernels.paged_attention import (SHORT_CONTEXT_LEN, SHORT_CONTEXT_MAX_SPLITS, TINY_CONTEXT_LEN,
                                                  decode_block_n, decode_num_splits, decode_num_stages)

    dev = torch.device(DEVICE)
    full = decode_num_splits(1, 8, dev, 64)
    assert full == 64 or DEVICE != "cuda"  # 132 SMs on an H200
    assert decode_num_splits(1, 8, dev, 64, max_seq_len=300) == min(full, SHORT_CONTEXT_MAX_SPLITS)
    assert decode_num_splits(1, 8, dev, 64, max_seq_len=SHORT_CONTEXT_LEN + 1) == full
    assert decode_num_splits(256, 8, dev, 64, max_seq_len=300) == 1
    backend = TritonAttentionBackend()
    # Split launches at tiny contexts also read K/V in smaller tiles: three buckets at batch 1.
    assert decode_block_n(torch.bfloat16, 128, 16, TINY_CONTEXT_LEN) == 32
    assert decode_block_n(torch.bfloat16, 128, 16, TINY_CONTEXT_LEN + 1) == 64
    assert decode_block_n(torch.bfloat16, 128, 1, 100) == 64  # one split per request: full tiles
    # An E4M3 cache: tiles of twice the positions (the same bytes), 2 pipeline stages when the context is split.
    fp8 = torch.float8_e4m3fn
    assert decode_block_n(torch.bfloat16, 128, 2, 4096, fp8) == 128
    assert decode_block_n(torch.bfloat16, 128, 16, TINY_CONTEXT_LEN, fp8) == 32
    assert decode_num_stages(fp8, 2) == 2 and decode_num_stages(fp8, 1) == 3
    assert decode_num_stages(torch.bfloat16, 2) == 3
    assert backend.graph_seq_len_buckets(1, 8, 8192, dev) == [TINY_CONTEXT_LEN, SHORT_CONTEXT_LEN, 8192]
    assert backend.graph_seq_len_buckets(1, 8, 1024, dev) == [TINY_CONTEXT_LEN, 1024]
    assert backend.graph_seq_len_buckets(1, 8, 400, dev) == [400]
    assert backend.graph_seq_len_buckets(256, 8, 8192, dev) == [8192]  # one split, full tiles either way


def test_decode_start_order_rule():
    """One split per request always reads the longest-first order; split launches only for many requests."""
    from pagedllm.attention.triton_backend import ORDERED_SPLIT_MIN_REQS, decode_uses_order

    assert decode_uses_order(1, 1) and decode_uses_order(256, 1)
    assert not decode_uses_order(1, 64)  # batch-1 latency: no extra dependent load
    assert not decode_uses_order(ORDERED_SPLIT_MIN_REQS - 1, 4)
    assert decode_uses_order(ORDERED_SPLIT_MIN_REQS, 4) and decode_uses_order(64, 2)
