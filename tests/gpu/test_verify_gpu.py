"""Speculative verify steps on CUDA, the OPT-IN path (PAGEDLLM_VERIFY_ATTENTION=1, PAGEDLLM_SKINNY_GEMM_MAX_ROWS=16,
PAGEDLLM_VERIFY_GRAPH_MAX_REQS=64; set here for every test): the split-KV verify attention kernel against the torch
reference (three head layouts / dtypes, several split counts), under CUDA-graph replay, the skinny GEMM, and the
engine's verify graphs (worker/verify_graph.py) giving the eager verify step's tokens. Not yet run on a GPU; it
compiles few kernel variants (expected well under 2 minutes on the H200 host, most of it Triton compiles)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (installed with CUDA torch)")

from attention_cases import build_batch, tolerances  # noqa: E402
from test_attention_kernels import CONFIG_IDS, CONFIGS, _check_cache_and_output  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pagedllm.kernels.paged_attention import paged_attention_ref  # noqa: E402
from pagedllm.kernels.reshape_and_cache import reshape_and_cache  # noqa: E402
from pagedllm.kernels.verify_attention import paged_verify_attention, verify_kernel_applies  # noqa: E402
from spec_checks import assert_same_up_to_near_ties  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
# Llama-3-8B heads in bf16, GQA 8 in fp16, fp32 (exact products): few compiled variants.
VERIFY_CONFIGS = [CONFIGS[0], CONFIGS[4], CONFIGS[7]]
VERIFY_IDS = [CONFIG_IDS[0], CONFIG_IDS[4], CONFIG_IDS[7]]


@pytest.fixture(autouse=True)
def _opt_in(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_VERIFY_ATTENTION", "1")
    monkeypatch.setenv("PAGEDLLM_SKINNY_GEMM_MAX_ROWS", "16")
    monkeypatch.setenv("PAGEDLLM_VERIFY_GRAPH_MAX_REQS", "64")

# (cached, query): drafted spans ending inside a split, 1-token rows (no drafts) and a fresh short prompt.
VERIFY_SPECS = [(0, 5), (1, 5), (15, 5), (16, 3), (63, 5), (300, 4), (1000, 5), (4095, 2), (37, 1), (0, 2)]


@pytest.mark.parametrize("cfg", VERIFY_CONFIGS, ids=VERIFY_IDS)
def test_verify_kernel(cfg):
    head_size, num_heads, num_kv_heads, block_size, dtype = cfg
    batch = build_batch(VERIFY_SPECS, num_heads, num_kv_heads, head_size, block_size, dtype, "cuda")
    md = batch.metadata
    assert verify_kernel_applies(md.max_query_len, num_heads, num_kv_heads, head_size, dtype)
    out = TritonAttentionBackend().forward(batch.query, batch.key, batch.value, batch.kv_cache, md, batch.scale)
    _check_cache_and_output(batch, out, dtype)
    for num_splits in (1, 7, 64):
        out2 = paged_verify_attention(batch.query, batch.kv_cache, md.block_table, md.seq_lens, md.query_start_loc,
                                      batch.scale, num_seqs=md.num_reqs, max_query_len=8, num_splits=num_splits)
        _check_cache_and_output(batch, out2, dtype)


@pytest.mark.parametrize("num_seqs", [1, 32])
def test_verify_kernel_cuda_graph_replay(num_seqs):
    """Capture one launch for num_seqs requests of <= 5 tokens, replay with fewer requests, other spans and
    contexts: padding rows (no query tokens, seq_len 0) write nothing."""
    num_heads, num_kv_heads, head_size, block_size, dtype, q_len = 32, 8, 128, 16, torch.bfloat16, 5
    backend = TritonAttentionBackend()
    ws = backend.reserve_verify_workspace(num_heads, num_kv_heads, head_size, q_len, torch.device("cuda"))
    specs = [(600 + 37 * i, q_len) for i in range(num_seqs)]
    batch = build_batch(specs, num_heads, num_kv_heads, head_size, block_size, dtype, "cuda")
    md = batch.metadata
    reshape_and_cache(batch.key, batch.value, batch.kv_cache, md.slot_mapping)
    q = batch.query.contiguous().clone()
    qsl, seq_lens, table = md.query_start_loc.clone(), md.seq_lens.clone(), md.block_table.clone()
    out = torch.zeros_like(q)

    def launch():
        paged_verify_attention(q, batch.kv_cache, table, seq_lens, qsl, batch.scale, num_seqs=num_seqs,
                               max_query_len=q_len, output=out, workspace=ws, num_splits=4)

    launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    # Replay: the first half of the requests with 1..5 tokens each, the rest padding.
    real = max(1, num_seqs // 2)
    lens = [1 + i % q_len for i in range(real)]
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    new_qsl = starts + [starts[-1]] * (num_seqs - real)
    qsl.copy_(torch.tensor(new_qsl, dtype=torch.int32))
    seq_lens.copy_(torch.tensor([600 + 37 * i + n for i, n in enumerate(lens)] + [0] * (num_seqs - real),
                                dtype=torch.int32))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    ref = paged_attention_ref(q, batch.kv_cache, table, seq_lens, qsl, batch.scale, num_seqs=real)
    n = starts[-1]
    assert not torch.isnan(out[:n]).any()
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), **tolerances(dtype))
    assert torch.count_nonzero(out[n:]) == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_verify_graphs_equal_eager(tiny_llama_dir, dtype):
    """The same speculating engine with and without CUDA graphs: verify steps replay verify graphs and give the
    eager steps' whole outputs (fp32: token for token; bf16, where graph padding changes the GEMM shapes: up to a
    near-tie of the eager run, with the logprobs of every compared token close; spec_checks.py)."""
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    from tests.engine.test_correctness import random_prompts

    base = random_prompts([20], seed=5)[0]
    prompts = [{"prompt_token_ids": p} for p in (base * 3, base[:7] * 5, random_prompts([33], seed=6)[0])]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)
    common = dict(dtype=dtype, device="cuda", num_gpu_blocks_override=256, max_num_seqs=4,
                  speculative_config=ngram)
    graphs = LLM(tiny_llama_dir, **common)
    eager = LLM(tiny_llama_dir, enforce_eager=True, **common)
    vg = graphs.engine.worker.runner.verify_graphs
    assert vg is not None and vg.sizes == [1, 2, 4]
    got = [o.outputs[0] for o in graphs.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0] for o in eager.generate(prompts, with_logprobs, use_tqdm=False)]
    assert vg.num_replays > 0 and graphs.engine.scheduler.spec_stats.num_accepted_tokens > 0
    if dtype == "float32":
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
    else:
        assert_same_up_to_near_ties(got, want)
        replays = vg.num_replays
        again = [o.outputs[0] for o in graphs.generate(prompts, with_logprobs, use_tqdm=False)]
        assert vg.num_replays > replays
        assert_same_up_to_near_ties(again, want, check_logprobs=True)
    del graphs, eager


@pytest.mark.parametrize("m", [5, 16])
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 14336), (1000, 200)])
def test_skinny_gemm(m, shape):
    """The verify rows' linear kernel (bf16, plain / bias / gated) against the fp32 reference, and the layers'
    dispatch: a large weight at 5 rows goes to it."""
    from pagedllm.kernels.gemv import _rows_kernel, gemv, gemv_ref
    from pagedllm.kernels.skinny_gemm import skinny_gemm

    n, k = shape
    torch.manual_seed(m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    for b in (None, bias):
        torch.testing.assert_close(skinny_gemm(x, w, b).float(), gemv_ref(x, w, b).float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(skinny_gemm(x, w, gated=True).float(), gemv_ref(x, w, gated=True).float(),
                               atol=2e-2, rtol=2e-2)
    if n * k > 8 * 1024 * 1024 and m >= 2:
        assert _rows_kernel(m, w) == "skinny"
        torch.testing.assert_close(gemv(x, w).float(), gemv_ref(x, w).float(), atol=2e-2, rtol=2e-2)
