"""The C++ CPU kernels (kernels/csrc/cpu_ops.cpp) against their plain-torch references, over many shapes."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from pagedllm import envs
from pagedllm.attention.torch_backend import TorchAttentionBackend
from pagedllm.forward_context import AttentionMetadata
from pagedllm.kernels.cpu_ops import cpu_ops
from pagedllm.layers.activation import GeluAndMul, SiluAndMul
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.rotary_embedding import get_rope
from tests.conftest import skip_without_onednn_bf16


@pytest.fixture(scope="module")
def ops():
    ops = cpu_ops()
    if ops is None:
        if not envs.PAGEDLLM_CPU_KERNELS:
            pytest.skip("PAGEDLLM_CPU_KERNELS=0")
        pytest.fail("the CPU kernels did not build on this machine (see the log warning)")
    return ops


TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [64, 576, 1000])
def test_rms_norm_and_fused_add(ops, dtype, hidden):
    torch.manual_seed(hidden)
    norm = RMSNorm(hidden, eps=1e-5, params_dtype=dtype)
    norm.weight.data.normal_()
    wide = torch.randn(37, hidden * 2, dtype=dtype)
    x = wide[:, :hidden]  # a row-strided view, as a fused projection's output slice is
    residual = torch.randn(37, hidden, dtype=dtype)
    out = torch.empty(37, hidden, dtype=dtype)
    ops.rms_norm(out, x, norm.weight, 1e-5)
    torch.testing.assert_close(out, norm.forward_native(x), **TOL[dtype])
    out2, res2 = torch.empty_like(out), torch.empty_like(out)
    ops.add_rms_norm(out2, res2, x, residual, norm.weight, 1e-5)
    ref_out, ref_res = norm.forward_native(x, residual)
    assert torch.equal(res2, ref_res)
    torch.testing.assert_close(out2, ref_out, **TOL[dtype])


def test_rms_norm_per_head_on_a_strided_3d_view(ops):
    qkv = torch.randn(5, 9 * 64 + 2 * 3 * 64)
    q = qkv[:, :9 * 64].view(5, 9, 64)  # Qwen3's per-head q norm sees exactly this
    norm = RMSNorm(64, eps=1e-6)
    norm.weight.data.normal_()
    torch.testing.assert_close(norm(q), norm.forward_native(q), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1536, 24, 37])
def test_silu_and_mul(ops, dtype, width):
    x = torch.randn(11, 2 * width, dtype=dtype) * 4
    x[0, 0], x[0, 1] = -200.0, 200.0  # exp over- and underflow in the vector path
    out = torch.empty(11, width, dtype=dtype)
    ops.silu_and_mul(out, x)
    torch.testing.assert_close(out, SiluAndMul.forward_native(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1536, 24, 37])
def test_gelu_tanh_and_mul(ops, dtype, width):
    """Gemma's GeGLU: the kernel (which GeluAndMul("tanh") runs on the CPU) against torch's gelu; a strided input."""
    wide = torch.randn(11, 2 * width + 5, dtype=dtype) * 4
    x = wide[:, :2 * width]
    x[0, 0], x[0, 1], x[1, 0] = -200.0, 200.0, -9.0  # exp over- and underflow; gelu's tail near 0
    act = GeluAndMul("tanh")
    ref = act.forward_native(x)
    out = torch.empty(11, width, dtype=dtype)
    ops.gelu_tanh_and_mul(out, x)
    # g * sigmoid(2u) and torch's 0.5 g (1 + tanh(u)) round differently
    torch.testing.assert_close(out, ref, **TOL[dtype])
    assert torch.equal(act(x), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size,rotary_dim", [(64, 64), (128, 128), (64, 32), (80, 80)])
def test_rotary_in_place_on_qkv_views(ops, dtype, head_size, rotary_dim):
    rope = get_rope(head_size, 4096, {"rope_type": "default", "rope_theta": 5e5}, rotary_dim=rotary_dim)
    heads, kv_heads, tokens = 4, 2, 13
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size, dtype=dtype)
    q, k, _ = qkv.split([heads * head_size, kv_heads * head_size, kv_heads * head_size], dim=-1)
    positions = torch.tensor([0, 1, 2, 3, 4095, 700, 37, 38, 39, 40, 41, 1000, 5])
    ref_q, ref_k = rope.forward_native(positions, q.clone(), k.clone())
    q_out, k_out = rope(positions, q, k)
    assert q_out.data_ptr() == qkv.data_ptr()  # rotated in place, inside the fused output
    torch.testing.assert_close(q_out, ref_q, **TOL[dtype])
    torch.testing.assert_close(k_out, ref_k, **TOL[dtype])


def test_rotary_position_outside_the_cache_is_an_error(ops):
    rope = get_rope(64, 16, {"rope_type": "default", "rope_theta": 1e4})
    with pytest.raises(RuntimeError, match="outside the cos/sin cache"):
        rope(torch.tensor([16]), torch.randn(1, 64), torch.randn(1, 64))


def _mixed_batch(rng, num_reqs, block_size, max_ctx):
    """Random requests: (query_len, seq_len) mixing decodes, fresh prefills and chunks after cached context."""
    reqs = []
    for _ in range(num_reqs):
        kind = rng.choice(["decode", "prefill", "chunk"])
        seq_len = rng.randint(1, max_ctx)
        q_len = 1 if kind == "decode" else seq_len if kind == "prefill" else rng.randint(1, seq_len)
        reqs.append((q_len, seq_len))
    return reqs


def _run_backend(backend, reqs, heads, kv_heads, head_size, block_size, dtype, seed, fill=0.0, **attn_kwargs):
    """Write every request's whole context through the backend, then attend the last query_len tokens."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for _, s in reqs) + 3
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(-(-s // block_size) for _, s in reqs) + 1
    table = torch.zeros(len(reqs), max_blocks, dtype=torch.int32)
    used = 0
    for i, (_, s) in enumerate(reqs):
        n = -(-s // block_size)
        table[i, :n] = perm[used:used + n].int()
        used += n
    kv_cache = torch.full((2, num_blocks, block_size, kv_heads, head_size), fill, dtype=dtype)
    total = sum(s for _, s in reqs)
    keys = torch.randn(total, kv_heads, head_size, generator=g).to(dtype)
    values = torch.randn(total, kv_heads, head_size, generator=g).to(dtype)
    query = torch.randn(total, heads, head_size, generator=g).to(dtype)
    # Step 1: the context before this step (all but the last query_len tokens of each request).
    # Step 2: this step's query tokens, written and attended together.
    starts, off = [], 0
    for _, s in reqs:
        starts.append(off)
        off += s
    for step in (1, 2):
        rows, qlens, seq_lens = [], [], []
        for (q_len, s), st in zip(reqs, starts):
            lo, hi = (0, s - q_len) if step == 1 else (s - q_len, s)
            rows.append(torch.arange(st + lo, st + hi))
            qlens.append(hi - lo)
            seq_lens.append(hi)
        idx = torch.cat(rows)
        keep = [i for i, n in enumerate(qlens) if n > 0]
        if not keep:
            continue
        slots = torch.cat([table[i, p // block_size].long() * block_size + p % block_size
                           for i, (q_len, s) in enumerate(reqs)
                           for p in [torch.arange(*((0, s - q_len) if step == 1 else (s - q_len, s)))]])
        qsl = torch.tensor([0] + [sum(qlens[j] for j in keep[:k + 1]) for k in range(len(keep))], dtype=torch.int32)
        md = AttentionMetadata(num_actual_tokens=idx.numel(), num_reqs=len(keep),
                               max_query_len=max(qlens[i] for i in keep), max_seq_len=max(seq_lens),
                               query_start_loc=qsl, seq_lens=torch.tensor([seq_lens[i] for i in keep], dtype=torch.int32),
                               block_table=table[keep].contiguous(), slot_mapping=slots,
                               query_start_loc_cpu=qsl.tolist(), seq_lens_cpu=[seq_lens[i] for i in keep])
        out = backend.forward(query[idx], keys[idx], values[idx], kv_cache, md, head_size ** -0.5, **attn_kwargs)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_size,block_size", [
    (9, 3, 64, 16), (4, 4, 64, 16), (8, 1, 128, 32), (32, 8, 128, 16), (4, 2, 80, 8), (6, 2, 96, 32),
    # Gemma 3 270M's heads; a head size with tails of 8 and 4 dims (the AVX2 loops' edges)
    (4, 1, 256, 16), (6, 3, 20, 16)])
def test_paged_attention_matches_torch_backend(ops, dtype, heads, kv_heads, head_size, block_size):
    from pagedllm.attention.cpu_backend import CpuAttentionBackend
    rng = random.Random(heads * 1000 + head_size + block_size)
    for trial in range(3):
        reqs = _mixed_batch(rng, rng.randint(1, 9), block_size, 300)
        ours = _run_backend(CpuAttentionBackend(), reqs, heads, kv_heads, head_size, block_size, dtype, trial)
        ref = _run_backend(TorchAttentionBackend(), reqs, heads, kv_heads, head_size, block_size, dtype, trial)
        torch.testing.assert_close(ours, ref, **TOL[dtype], msg=lambda m: f"{reqs}: {m}")


def test_paged_attention_long_context_and_single_token(ops):
    from pagedllm.attention.cpu_backend import CpuAttentionBackend
    for reqs in ([(1, 1)], [(1, 4000), (17, 4000), (1, 33)], [(600, 600)]):
        ours = _run_backend(CpuAttentionBackend(), reqs, 8, 2, 64, 16, torch.float32, 0)
        ref = _run_backend(TorchAttentionBackend(), reqs, 8, 2, 64, 16, torch.float32, 0)
        torch.testing.assert_close(ours, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("soft_cap", [0.5, 3.0, 50.0])
@pytest.mark.parametrize("window", [None, 20])
def test_paged_attention_soft_cap_matches_torch_backend(ops, soft_cap, window):
    """Gemma 2's capped scores in the C++ kernel (short rows) and the gathered SDPA path (a long chunk) against the
    torch backend's soft_capped_sdpa: caps that saturate most scores (0.5), some (3) and almost none (50)."""
    from pagedllm.attention import cpu_backend
    from pagedllm.attention.cpu_backend import CpuAttentionBackend
    rng = random.Random(int(soft_cap * 10) + (window or 0))
    reqs = _mixed_batch(rng, 7, 16, 200) + [(cpu_backend.LONG_QUERY_LEN, cpu_backend.LONG_QUERY_LEN + 30), (1, 1)]
    kwargs = dict(logits_soft_cap=soft_cap, sliding_window=window)
    for heads, kv_heads, head_size in ((8, 2, 64), (4, 1, 256)):
        ours = _run_backend(CpuAttentionBackend(), reqs, heads, kv_heads, head_size, 16, torch.float32, 3, **kwargs)
        ref = _run_backend(TorchAttentionBackend(), reqs, heads, kv_heads, head_size, 16, torch.float32, 3, **kwargs)
        torch.testing.assert_close(ours, ref, atol=2e-5, rtol=2e-5, msg=lambda m: f"{reqs}: {m}")
        uncapped = _run_backend(TorchAttentionBackend(), reqs, heads, kv_heads, head_size, 16, torch.float32, 3,
                                sliding_window=window)
        assert soft_cap > 10 or not torch.allclose(ours, uncapped, atol=1e-3)  # the cap changes the result


def test_long_prefill_chunks_take_the_sdpa_path_and_match(ops):
    from pagedllm.attention import cpu_backend
    from pagedllm.attention.cpu_backend import CpuAttentionBackend
    n = cpu_backend.LONG_QUERY_LEN
    # A fresh long prompt, a long chunk after cached context, and short rows in the same batch.
    reqs = [(n + 7, n + 7), (1, 40), (n, n + 300), (5, 60)]
    for heads, kv_heads in ((8, 2), (4, 4)):
        ours = _run_backend(CpuAttentionBackend(), reqs, heads, kv_heads, 64, 16, torch.float32, 5)
        ref = _run_backend(TorchAttentionBackend(), reqs, heads, kv_heads, 64, 16, torch.float32, 5)
        torch.testing.assert_close(ours, ref, atol=2e-5, rtol=2e-5)


def test_unwritten_slots_are_never_used(ops):
    """The CPU backend takes its pool uninitialized: NaN/Inf garbage in unwritten slots must not leak."""
    from pagedllm.attention.cpu_backend import CpuAttentionBackend
    assert CpuAttentionBackend.needs_zeroed_cache is False
    reqs = [(1, 3), (1, 17), (5, 21), (9, 9), (1, 40)]  # partial last blocks everywhere
    for fill in (float("nan"), float("inf")):
        ours = _run_backend(CpuAttentionBackend(), reqs, 8, 2, 64, 16, torch.float32, 3, fill=fill)
        ref = _run_backend(TorchAttentionBackend(), reqs, 8, 2, 64, 16, torch.float32, 3)
        assert torch.isfinite(ours).all()
        torch.testing.assert_close(ours, ref, atol=2e-5, rtol=2e-5)


def test_paged_attention_rejects_inconsistent_metadata(ops):
    kv = torch.zeros(2, 4, 16, 2, 64)
    q = torch.randn(3, 4, 64)
    out = torch.empty_like(q)
    k_cache, v_cache = kv[0].view(4, 2, 64, 16), kv[1].view(4, 2, 16, 64)
    table = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="inconsistent metadata"):  # 40 tokens need 3 blocks, the table has 2
        ops.paged_attention(out, q, k_cache, v_cache, table, torch.tensor([0, 3], dtype=torch.int32),
                            torch.tensor([40], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="int32"):
        ops.paged_attention(out, q, k_cache, v_cache, table.long(), torch.tensor([0, 3], dtype=torch.int32),
                            torch.tensor([3], dtype=torch.int32), 0.125)


def test_cpu_is_the_default_backend_when_the_kernels_build(ops):
    from pagedllm.attention.backend import get_attention_backend
    assert get_attention_backend(None, torch.device("cpu")).name == "cpu"
    assert get_attention_backend("torch", torch.device("cpu")).name == "torch"


def test_no_compiler_falls_back_to_torch_with_one_warning(monkeypatch, tmp_path, caplog):
    import logging

    from pagedllm.attention.backend import get_attention_backend
    from pagedllm.kernels import cpu_ops as module

    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PAGEDLLM_KERNEL_CACHE_DIR", str(tmp_path / "kernels"))
    monkeypatch.setattr(module, "_state", {})
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        assert module.cpu_ops() is None
        assert module.cpu_ops() is None  # the failure is remembered: one attempt, one warning
        assert get_attention_backend(None, torch.device("cpu")).name == "torch"
    warnings = [r.getMessage() for r in caplog.records if "could not be built" in r.getMessage()]
    assert len(warnings) == 1 and "no-such-compiler" in warnings[0] and "plain-torch" in warnings[0]


def test_paged_attention_rejects_a_block_id_outside_the_pool(ops):
    kv = torch.zeros(2, 4, 16, 2, 64)
    q = torch.randn(1, 4, 64)
    table = torch.tensor([[0, 9]], dtype=torch.int32)  # the pool has 4 blocks
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.paged_attention(torch.empty_like(q), q, kv[0].view(4, 2, 64, 16), kv[1].view(4, 2, 16, 64), table,
                            torch.tensor([0, 1], dtype=torch.int32), torch.tensor([20], dtype=torch.int32), 0.125)


def test_greedy_screen_equals_full_argmax_including_ties(ops):
    skip_without_onednn_bf16()
    from pagedllm.layers.linear import pack_cpu_weights
    from pagedllm.layers.vocab_embedding import ParallelLMHead

    torch.manual_seed(0)
    vocab, hidden = 3000, 96
    head = ParallelLMHead(vocab, hidden)
    head.weight.data.normal_(0, 0.5)
    head.weight.data[7] = head.weight.data[2900]  # an exact tie: the lower id must win, as torch.argmax does
    head.weight.data[11] = head.weight.data[2901] * (1 + 1e-3)  # a near-tie the bf16 screen cannot separate
    assert pack_cpu_weights(torch.nn.ModuleDict({"lm_head": head})) == 1
    assert "cpu_greedy_screen" in head.__dict__
    x = torch.randn(64, hidden) * 3
    x[:8] = head.weight.data[2900] * 5  # rows whose best tokens are the tied pair
    x[8:16] = head.weight.data[2901] * 5
    x[16:20] = 0.0  # all logits equal: token 0
    full = head.compute_logits(x).argmax(dim=-1)
    fast = head.greedy_token_ids(x)
    assert torch.equal(fast, full)
    assert set(fast[:8].tolist()) == {7} and set(fast[16:20].tolist()) == {0}


def test_greedy_screen_falls_back_when_too_many_candidates(ops, monkeypatch):
    skip_without_onednn_bf16()
    from pagedllm.layers import vocab_embedding
    from pagedllm.layers.linear import pack_cpu_weights
    from pagedllm.layers.vocab_embedding import ParallelLMHead

    torch.manual_seed(1)
    head = ParallelLMHead(500, 64)
    head.weight.data.normal_(0, 0.01)  # a flat distribution: hundreds of candidates
    pack_cpu_weights(torch.nn.ModuleDict({"lm_head": head}))
    monkeypatch.setattr(vocab_embedding, "_GREEDY_MAX_CANDIDATES", 2)
    x = torch.randn(5, 64)
    assert torch.equal(head.greedy_token_ids(x), head.compute_logits(x).argmax(dim=-1))


def test_a_build_killed_midway_does_not_hang_the_next_start(ops, tmp_path):
    """torch's extension builder guards a build directory with a plain `lock` file; a build killed midway leaves
    it behind, and the next start used to wait on it forever. Now the stale file is removed (under a flock that
    dies with its process) and the kernels load."""
    import os
    import shutil
    import subprocess
    import sys

    from pagedllm.kernels.cpu_ops import _build_name

    name = _build_name()
    shutil.copytree(os.path.join(envs.PAGEDLLM_KERNEL_CACHE_DIR, name), tmp_path / name)
    (tmp_path / name / "lock").write_text("")
    code = "from pagedllm.kernels.cpu_ops import cpu_ops; import sys; sys.exit(0 if cpu_ops() is not None else 3)"
    env = dict(os.environ, PAGEDLLM_KERNEL_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], env=env, timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "left by a CPU-kernel build that did not finish" in done.stderr
    assert not (tmp_path / name / "lock").exists()
