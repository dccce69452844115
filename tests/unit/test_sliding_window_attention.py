"""Sliding-window paged attention: the torch backend, the C++ CPU kernels (per-op and the fused decode stack's
attention) and the kernels' torch reference against a dense per-request attention over contiguous K/V.

Blocks wholly before a row's window are what the KV manager frees: their block-table entries are made stale here
(pointing at a NaN-filled block, or at an id outside the pool), so a backend that reads them fails."""
from __future__ import annotations

import random

import pytest
import torch

from pagedllm import envs
from pagedllm.attention.torch_backend import TorchAttentionBackend
from pagedllm.forward_context import AttentionMetadata
from pagedllm.kernels.cpu_ops import cpu_ops


def dense_attention(q, k, v, scale, window):
    """q [Q, H, D]: the last Q positions of a context k/v [S, KVH, D]; a query at p sees p - window < k <= p."""
    num_q, heads, _ = q.shape
    seq_len, kv_heads, _ = k.shape
    g = heads // kv_heads
    k, v = k.double().repeat_interleave(g, dim=1), v.double().repeat_interleave(g, dim=1)
    scores = torch.einsum("qhd,shd->hqs", q.double(), k) * scale
    qpos = torch.arange(num_q)[:, None] + (seq_len - num_q)
    kpos = torch.arange(seq_len)[None, :]
    seen = kpos <= qpos
    if window is not None:
        seen &= kpos > qpos - window
    scores = scores.masked_fill(~seen, float("-inf"))
    return torch.einsum("hqs,shd->qhd", scores.softmax(-1), v)


def _window_batch(backend, reqs, window, heads, kv_heads, head_size, block_size, dtype, seed, stale="nan",
                  cache_dtype=None):
    """Write each request's context through `backend` (step 1), make the table entries of blocks before each
    row's window stale, then attend the last query_len tokens (step 2). Returns (output, dense reference)."""
    g = torch.Generator().manual_seed(seed)
    blocks_of = [-(-s // block_size) for _, s in reqs]
    num_blocks = sum(blocks_of) + 2
    poison = num_blocks - 1  # never a real block: NaN everywhere
    perm = torch.randperm(num_blocks - 1, generator=g)
    table = torch.zeros(len(reqs), max(blocks_of) + 1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_of):
        table[i, :n] = perm[used:used + n].int()
        used += n
    kv_cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_size, dtype=cache_dtype or dtype)
    kv_cache[:, poison] = float("nan")
    total = sum(s for _, s in reqs)
    keys = torch.randn(total, kv_heads, head_size, generator=g).to(dtype)
    values = torch.randn(total, kv_heads, head_size, generator=g).to(dtype)
    query = torch.randn(total, heads, head_size, generator=g).to(dtype)
    # what the cache holds (an FP8 cache rounds K/V to E4M3)
    cached_k, cached_v = (t if cache_dtype is None else t.to(cache_dtype).to(dtype) for t in (keys, values))
    starts = [sum(s for _, s in reqs[:i]) for i in range(len(reqs))]
    scale = head_size ** -0.5
    out = None
    for step in (1, 2):
        spans = [(0, s - q) if step == 1 else (s - q, s) for q, s in reqs]
        keep = [i for i, (lo, hi) in enumerate(spans) if hi > lo]
        if not keep:
            continue
        if step == 2:
            for i in keep:  # what the KV manager frees: blocks whose positions all precede the row's window
                q_len, seq_len = reqs[i]
                first_seen = max(0, seq_len - q_len - window + 1)
                if first_seen // block_size:
                    table[i, :first_seen // block_size] = poison if stale == "nan" else 10 ** 6
        idx = torch.cat([torch.arange(starts[i] + spans[i][0], starts[i] + spans[i][1]) for i in keep])
        slots = torch.cat([table[i, p // block_size].long() * block_size + p % block_size
                           for i in keep for p in [torch.arange(*spans[i])]])
        qlens = [spans[i][1] - spans[i][0] for i in keep]
        seq_lens = [spans[i][1] for i in keep]
        qsl = [0]
        for n in qlens:
            qsl.append(qsl[-1] + n)
        md = AttentionMetadata(num_actual_tokens=len(idx), num_reqs=len(keep), max_query_len=max(qlens),
                               max_seq_len=max(seq_lens), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                               seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                               block_table=table[keep].contiguous(), slot_mapping=slots, query_start_loc_cpu=qsl,
                               seq_lens_cpu=seq_lens)
        out = backend.forward(query[idx], keys[idx], values[idx], kv_cache, md, scale, sliding_window=window)
        if step == 2:
            refs = []
            for i in keep:
                q_len, seq_len = reqs[i]
                ctx = slice(starts[i], starts[i] + seq_len)
                refs.append(dense_attention(query[ctx][-q_len:], cached_k[ctx], cached_v[ctx], scale, window))
            return out, torch.cat(refs).to(dtype)
    raise AssertionError("no query tokens")


# (query_len, seq_len): decodes before / at / past the window, prefills and chunks longer than the window, block
# edges; a window longer than the context (no key hidden).
REQS = [(1, 5), (1, 16), (1, 17), (1, 83), (40, 40), (7, 100), (25, 61), (16, 48), (3, 3), (1, 200), (33, 33)]
TOL = {torch.float32: dict(atol=3e-5, rtol=3e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _backends():
    yield "torch", TorchAttentionBackend
    if cpu_ops() is not None:
        from pagedllm.attention.cpu_backend import CpuAttentionBackend
        yield "cpu", CpuAttentionBackend
    elif envs.PAGEDLLM_CPU_KERNELS:
        pytest.fail("the CPU kernels did not build on this machine (see the log warning)")


@pytest.mark.parametrize("window", [1, 5, 16, 31, 64])
@pytest.mark.parametrize("heads,kv_heads,head_size,block_size", [(4, 2, 32, 16), (8, 1, 64, 8), (6, 6, 16, 32)])
def test_windowed_mixed_batch_matches_dense(window, heads, kv_heads, head_size, block_size):
    for name, cls in _backends():
        out, ref = _window_batch(cls(), REQS, window, heads, kv_heads, head_size, block_size, torch.float32, window)
        torch.testing.assert_close(out, ref, **TOL[torch.float32], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_windowed_random_batches(dtype):
    rng = random.Random(7)
    for trial in range(4):
        reqs = []
        for _ in range(rng.randint(1, 8)):
            seq_len = rng.randint(1, 300)
            kind = rng.choice(["decode", "prefill", "chunk"])
            reqs.append((1 if kind == "decode" else seq_len if kind == "prefill" else rng.randint(1, seq_len),
                         seq_len))
        window = rng.choice([3, 16, 50, 128])
        for name, cls in _backends():
            out, ref = _window_batch(cls(), reqs, window, 8, 2, 64, 16, dtype, trial)
            torch.testing.assert_close(out, ref, **TOL[dtype], msg=lambda m: f"{name} {reqs} w={window}: {m}")


def test_windowed_long_chunks_on_the_cpu_sdpa_path():
    """Chunks of LONG_QUERY_LEN tokens or more go through the CPU backend's gather + SDPA path."""
    from pagedllm.attention import cpu_backend
    if cpu_ops() is None:
        pytest.skip("no CPU kernels")
    n = cpu_backend.LONG_QUERY_LEN
    reqs = [(n + 5, n + 5), (n, n + 300), (1, 700), (9, 900)]
    out, ref = _window_batch(cpu_backend.CpuAttentionBackend(), reqs, 100, 4, 2, 32, 16, torch.float32, 1)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_cpu_kernel_never_reads_blocks_before_the_window():
    """Stale entries holding an id outside the pool would fail the kernel's block-id check if read."""
    if cpu_ops() is None:
        pytest.skip("no CPU kernels")
    from pagedllm.attention.cpu_backend import CpuAttentionBackend
    out, ref = _window_batch(CpuAttentionBackend(), REQS, 16, 4, 2, 32, 16, torch.float32, 3, stale="outside")
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_full_attention_differs_from_the_window():
    """The comparison can fail: without the window the same batch gives other outputs."""
    out, ref = _window_batch(TorchAttentionBackend(), [(40, 100)], 16, 4, 2, 32, 16, torch.float32, 0)
    full, _ = _window_batch(TorchAttentionBackend(), [(40, 100)], 1000, 4, 2, 32, 16, torch.float32, 0)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    assert (full - out).abs().max() > 0.1


def test_kernel_reference_matches_dense():
    """kernels/paged_attention.paged_attention_ref, the GPU kernels' reference, with a window."""
    pytest.importorskip("triton")
    from pagedllm.kernels.paged_attention import paged_attention_ref

    class RefBackend(TorchAttentionBackend):
        def forward(self, query, key, value, kv_cache, metadata, scale, sliding_window=None):
            super().forward(query, key, value, kv_cache, metadata, scale)  # writes the K/V
            return paged_attention_ref(query, kv_cache, metadata.block_table, metadata.seq_lens,
                                       metadata.query_start_loc, scale, sliding_window=sliding_window)

    for window in (1, 16, 37):
        out, ref = _window_batch(RefBackend(), REQS, window, 4, 2, 32, 16, torch.float32, window)
        torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_windowed_fp8_cache_on_the_torch_backend():
    """An FP8 KV cache (on a CPU the torch backend's): the window over the E4M3 values the cache holds."""
    out, ref = _window_batch(TorchAttentionBackend(), REQS, 16, 4, 2, 32, 16, torch.float32, 4,
                             cache_dtype=torch.float8_e4m3fn)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
