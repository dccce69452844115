"""The few-query split-KV attention kernel (`paged_few_query_attention`: verify rows of speculative decoding, a few
query tokens per request) against the torch reference, directly and through the Triton backend (eager and with a
mixed-graph tile id). GPU; small fp32 cases also run in Triton's interpreter (TRITON_INTERPRET=1
PAGEDLLM_TEST_DEVICE=cpu, which tests/unit/test_few_query_interpreted.py starts)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (installed with CUDA torch)")

from attention_cases import build_batch, config_ids, kernel_test_device, reference, tolerances

DEVICE = kernel_test_device()
INTERPRETED = DEVICE != "cuda"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("stale_cuda_memory"),
]

from pagedllm.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pagedllm.forward_context import AttentionMetadata  # noqa: E402
from pagedllm.kernels.paged_attention import (  # noqa: E402
    FEW_QUERY_MAX_LEN,
    few_query_pad,
    paged_few_query_attention,
)
from pagedllm.kernels.reshape_and_cache import reshape_and_cache  # noqa: E402

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
CONFIGS = [(64, 8, 2, 16, FP32), (32, 4, 4, 16, FP32)] if INTERPRETED else [
    (128, 32, 8, 16, BF16),  # Llama-3-8B: GQA 4
    (128, 8, 8, 32, BF16),  # MHA: 16 query tokens per tile at least
    (64, 32, 4, 32, BF16),  # GQA 8
    (96, 12, 4, 16, BF16),  # padded head size, GQA 3
    (128, 16, 2, 16, FP16),
    (128, 32, 8, 16, FP32),
]
CONFIG_IDS = config_ids(CONFIGS)
# (cached_len, query_len): verify rows of k = 4 at contexts shorter than a tile, across block and tile edges and
# long; decodes and shorter verify rows (a request near max_tokens) in the same step.
VERIFY = [(0, 5), (27, 5), (59, 5), (63, 5), (200, 5), (1000, 5), (3, 1), (130, 3), (64, 2)]
if not INTERPRETED:
    VERIFY += [(4096, 5), (2043, 5)]


def _run(batch, q_pad=None, **kw):
    md = batch.metadata
    reshape_and_cache(batch.key, batch.value, batch.kv_cache, md.slot_mapping)
    if q_pad is None:
        q_pad = few_query_pad(md.max_query_len, batch.query.shape[1], batch.kv_cache.shape[3])
    return paged_few_query_attention(batch.query, batch.kv_cache, md.block_table, md.seq_lens, md.query_start_loc,
                                     batch.scale, num_seqs=md.num_reqs, q_pad=q_pad, **kw)


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_every_split_count_gives_the_reference(cfg):
    head_size, num_heads, num_kv_heads, block_size, dtype = cfg
    batch = build_batch(VERIFY, num_heads, num_kv_heads, head_size, block_size, dtype, DEVICE)
    ref, _ = reference(batch)
    for num_splits, block_n in ((1, None), (3, None), (16, 32), (64, 64)):
        out = _run(batch, num_splits=num_splits, block_n=block_n)
        assert not torch.isnan(out).any(), num_splits
        torch.testing.assert_close(out.float(), ref.float(), **tolerances(dtype))


@pytest.mark.parametrize("cfg", CONFIGS[:1], ids=CONFIG_IDS[:1])
def test_wider_tiles_and_graph_padding_rows(cfg):
    """A tile of more query tokens than any request has (a graph captured for k + 1 = 16), and request rows past
    the step's requests (no query tokens: their query_start_loc entries repeat the token count) with stale block
    tables and lengths, as a padded mixed-graph step has."""
    head_size, num_heads, num_kv_heads, block_size, dtype = cfg
    batch = build_batch(VERIFY[:6], num_heads, num_kv_heads, head_size, block_size, dtype, DEVICE)
    ref, _ = reference(batch)
    md = batch.metadata
    pad = 3
    n = batch.query.shape[0]
    md.query_start_loc = torch.cat([md.query_start_loc, torch.full((pad,), n, dtype=torch.int32, device=DEVICE)])
    md.seq_lens = torch.cat([md.seq_lens, torch.full((pad,), 77, dtype=torch.int32, device=DEVICE)])
    md.block_table = torch.cat([md.block_table, md.block_table[:pad]])
    md.num_reqs += pad
    for num_splits in (1, 8):
        out = _run(batch, q_pad=16, num_splits=num_splits)
        torch.testing.assert_close(out.float(), ref.float(), **tolerances(dtype))


@pytest.mark.parametrize("window", [16, 45, 300])
def test_sliding_window_and_soft_cap(window):
    head_size, num_heads, num_kv_heads, block_size, dtype = CONFIGS[0]
    batch = build_batch(VERIFY, num_heads, num_kv_heads, head_size, block_size, dtype, DEVICE)
    # Blocks wholly before a request's first window are never read: point them at NaN block 0.
    md = batch.metadata
    table = md.block_table.cpu()
    for i, (seq_len, q0, q1) in enumerate(zip(md.seq_lens_cpu, md.query_start_loc_cpu, md.query_start_loc_cpu[1:])):
        table[i, :max(0, seq_len - (q1 - q0) - window + 1) // block_size] = 0
    md.block_table = table.to(DEVICE)
    ref, _ = reference(batch, sliding_window=window, logits_soft_cap=30.0)
    for num_splits in (1, 4):
        out = _run(batch, num_splits=num_splits, sliding_window=window, logits_soft_cap=30.0)
        assert not torch.isnan(out).any()
        torch.testing.assert_close(out.float(), ref.float(), **tolerances(dtype))


def test_tile_sizes():
    assert few_query_pad(5, 32, 8) == 8  # 8 tokens x GQA 4 = 32 rows
    assert few_query_pad(1, 32, 8) == 4  # at least 16 rows for the MMA
    assert few_query_pad(3, 8, 8) == 16
    assert few_query_pad(FEW_QUERY_MAX_LEN, 32, 8) == 16
    assert few_query_pad(FEW_QUERY_MAX_LEN + 1, 32, 8) is None
    assert few_query_pad(9, 64, 8) is None  # 16 x 8 rows: too many


@pytest.mark.parametrize("cfg", CONFIGS[:1], ids=CONFIG_IDS[:1])
def test_backend_takes_few_query_steps(cfg, monkeypatch):
    """The backend runs steps of short requests through the few-query kernel (eager: from max_query_len; in a
    mixed graph: from a negative tile id), and longer ones through the prefill kernel, all equal to the
    reference."""
    import pagedllm.attention.triton_backend as tb

    head_size, num_heads, num_kv_heads, block_size, dtype = cfg
    calls = []
    real = tb.paged_few_query_attention
    monkeypatch.setattr(tb, "paged_few_query_attention", lambda *a, **k: calls.append(k["q_pad"]) or real(*a, **k))
    for specs, tile, expect in ((VERIFY, None, [8]), (VERIFY[:4], -16, [16]), ([(10, 40), (5, 5)], None, [])):
        batch = build_batch(specs, num_heads, num_kv_heads, head_size, block_size, dtype, DEVICE)
        md = batch.metadata
        if tile is not None:
            md = AttentionMetadata(**{**md.__dict__, "graph_prefill_tile": tile})
        calls.clear()
        out = TritonAttentionBackend().forward(batch.query, batch.key, batch.value, batch.kv_cache, md, batch.scale)
        assert calls == expect, specs
        ref, _ = reference(batch)
        torch.testing.assert_close(out.float(), ref.float(), **tolerances(dtype))


def test_switch_off_uses_the_prefill_kernel(monkeypatch):
    """PAGEDLLM_FEW_QUERY_ATTENTION=0: no few-query tile for mixed graphs, and eager verify rows go through the
    prefill kernel (the same answer)."""
    import pagedllm.attention.triton_backend as tb

    head_size, num_heads, num_kv_heads, block_size, dtype = CONFIGS[0]
    calls = []
    few, prefill = tb.paged_few_query_attention, tb.paged_prefill_attention
    monkeypatch.setattr(tb, "paged_few_query_attention", lambda *a, **k: calls.append("few") or few(*a, **k))
    monkeypatch.setattr(tb, "paged_prefill_attention", lambda *a, **k: calls.append("prefill") or prefill(*a, **k))
    monkeypatch.setenv("PAGEDLLM_FEW_QUERY_ATTENTION", "0")
    backend = TritonAttentionBackend()
    assert backend.few_query_tile(num_heads, num_kv_heads, 5) is None
    batch = build_batch(VERIFY, num_heads, num_kv_heads, head_size, block_size, dtype, DEVICE)
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata, batch.scale)
    assert calls == ["prefill"]
    ref, _ = reference(batch)
    torch.testing.assert_close(out.float(), ref.float(), **tolerances(dtype))
    monkeypatch.setenv("PAGEDLLM_FEW_QUERY_ATTENTION", "1")
    assert backend.few_query_tile(num_heads, num_kv_heads, 5) == -few_query_pad(5, num_heads, num_kv_heads)


@pytest.mark.skipif(INTERPRETED, reason="E4M3 caches: CUDA only")
def test_fp8_cache_matches_the_prefill_kernel():
    """An E4M3 cache read by the few-query kernel gives what the prefill kernel gives from the same cache."""
    from pagedllm.kernels.paged_attention import paged_prefill_attention

    batch = build_batch(VERIFY, 32, 8, 128, 16, BF16, DEVICE, poison=False)
    md = batch.metadata
    reshape_and_cache(batch.key, batch.value, batch.kv_cache, md.slot_mapping)
    cache = batch.kv_cache.to(torch.float8_e4m3fn)
    q_pad = few_query_pad(md.max_query_len, 32, 8)
    want = paged_prefill_attention(batch.query, cache, md.block_table, md.seq_lens, md.query_start_loc, batch.scale,
                                   num_seqs=md.num_reqs, max_query_len=md.max_query_len)
    for num_splits in (1, 8):
        got = paged_few_query_attention(batch.query, cache, md.block_table, md.seq_lens, md.query_start_loc,
                                        batch.scale, num_seqs=md.num_reqs, q_pad=q_pad, num_splits=num_splits)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
