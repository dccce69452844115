"""The split-KV decode kernel with several query tokens per request (speculative verify rows,
kernels/paged_attention.py) against the torch reference, in Triton's
interpreter on the CPU: `TRITON_INTERPRET=1 python interpret_verify_attention.py` (run in a subprocess by
test_verify_attention.py: TRITON_INTERPRET must be set before any kernel is defined). fp32 only: the interpreter
returns garbage for bf16 tl.dot (the existing decode kernel too); the GPU test covers bf16."""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "gpu"))
from attention_cases import build_batch  # noqa: E402

from pagedllm.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pagedllm.forward_context import AttentionMetadata  # noqa: E402
from pagedllm.kernels.paged_attention import paged_attention_ref  # noqa: E402
from pagedllm.kernels.paged_attention import paged_decode_attention  # noqa: E402


def count_multi_query_decodes() -> list:
    """Record every decode-kernel launch of the Triton backend with several query tokens per request."""
    import pagedllm.attention.triton_backend as tb

    calls, original = [], tb.paged_decode_attention

    def counting(*args, **kwargs):
        if kwargs.get("max_query_len", 1) > 1:
            calls.append(kwargs["max_query_len"])
        return original(*args, **kwargs)

    tb.paged_decode_attention = counting
    return calls


def write_new_kv(b, num_kv_heads, head_size):
    flat = b.kv_cache.view(2, -1, num_kv_heads, head_size)
    flat[0, b.metadata.slot_mapping] = b.key
    flat[1, b.metadata.slot_mapping] = b.value


def check(name, out, ref, rows=None):
    rows = slice(None) if rows is None else rows
    err = (out[rows].float() - ref[rows].float()).abs().max().item()
    assert err < 1e-4, (name, err)


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    cases = [
        # (cached, query) per request, heads, kv heads, head size
        ([(37, 5), (5, 3), (0, 2), (60, 1)], 8, 2, 32),   # spans ending inside a split, a fresh 2-token prompt
        ([(30, 5), (2, 4)], 6, 2, 16),                    # GQA 3 (padded to 4)
        ([(45, 8)], 4, 4, 32),                            # no GQA, 8 tokens
    ]
    for specs, h, kvh, d in cases:
        b = build_batch(specs, h, kvh, d, 16, torch.float32, "cpu")
        write_new_kv(b, kvh, d)
        md = b.metadata
        ref = paged_attention_ref(b.query, b.kv_cache, md.block_table, md.seq_lens, md.query_start_loc, b.scale)
        for splits in (1, 2, 3, 8):
            out = paged_decode_attention(b.query, b.kv_cache, md.block_table, md.seq_lens, b.scale,
                                         num_seqs=len(specs), max_query_len=md.max_query_len, num_splits=splits,
                                         block_n=16, query_start_loc=md.query_start_loc)
            check(f"{specs} splits={splits}", out, ref)
    # CUDA-graph padding: request rows past the step's requests have no query tokens and seq_len 0, padding
    # tokens past the last request belong to no row; the real rows are unchanged.
    specs = [(20, 5), (7, 2)]
    b = build_batch(specs, 8, 2, 32, 16, torch.float32, "cpu")
    write_new_kv(b, 2, 32)
    md = b.metadata
    ref = paged_attention_ref(b.query, b.kv_cache, md.block_table, md.seq_lens, md.query_start_loc, b.scale)
    n = b.query.shape[0]
    query = torch.cat([b.query, torch.randn(3, 8, 32)])
    qsl = torch.tensor(md.query_start_loc.tolist() + [n, n], dtype=torch.int32)
    seq_lens = torch.tensor(md.seq_lens.tolist() + [0, 0], dtype=torch.int32)
    table = torch.cat([md.block_table, md.block_table[:2]])
    out = paged_decode_attention(query, b.kv_cache, table, seq_lens, b.scale, num_seqs=4, max_query_len=5,
                                 num_splits=2, block_n=16, query_start_loc=qsl)
    check("padded", out, ref, slice(0, n))
    # The backend routes a step whose longest query is a few tokens to this kernel (and gives the reference).
    backend = TritonAttentionBackend()
    specs = [(33, 5), (12, 3)]
    b = build_batch(specs, 8, 2, 32, 16, torch.float32, "cpu")
    write_new_kv(b, 2, 32)
    md = b.metadata
    ref = paged_attention_ref(b.query, b.kv_cache, md.block_table, md.seq_lens, md.query_start_loc, b.scale)
    calls = count_multi_query_decodes()
    out = torch.empty_like(b.query)
    backend._attend(b.query, b.kv_cache, AttentionMetadata(**{**md.__dict__}), b.scale, out)
    assert calls, "the backend did not route a 5-token step to the decode kernel"
    check("backend", out, ref)
    print("verify attention ok")
    check_skinny_gemm()
    print("skinny gemm ok")


def check_skinny_gemm() -> None:
    """The tensor-core few-row GEMM (verify rows of the linear layers), plain / bias / gated, odd shapes."""
    from pagedllm.kernels.gemv import gemv_ref
    from pagedllm.kernels.skinny_gemm import skinny_gemm

    gen = torch.Generator().manual_seed(0)
    for m, n, k, dtype in [(5, 40, 96, torch.float16), (16, 33, 300, torch.float32), (2, 64, 64, torch.float16)]:
        x = torch.randn(m, k, generator=gen).to(dtype)
        w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
        bias = torch.randn(n, generator=gen).to(dtype)
        for b in (None, bias):
            got = skinny_gemm(x, w, b, block_k=64)
            want = gemv_ref(x, w, b)
            assert (got.float() - want.float()).abs().max().item() < 2e-2, (m, n, k, dtype, b is None)
        wg = (torch.randn(2 * n, k, generator=gen) / k ** 0.5).to(dtype)
        got = skinny_gemm(x, wg, None, gated=True, block_k=64)
        want = gemv_ref(x, wg, None, gated=True)
        assert (got.float() - want.float()).abs().max().item() < 2e-2, ("gated", m, n, k, dtype)


def check_engine(model_dir: str) -> None:
    """A speculating engine on the Triton backend (interpreted; unfused qkv and one decode split: the interpreter
    cannot run the fused kernel's or the split decode's masks) gives the torch backend's plain greedy tokens, its
    verify steps through the verify kernel."""
    from pagedllm import LLM, SamplingParams

    assert os.environ.get("PAGEDLLM_FUSED_QKV") == "0" and os.environ.get("PAGEDLLM_DECODE_MAX_SPLITS") == "1"
    base = [17, 200, 31, 5, 88, 140, 9, 61, 300, 12, 77, 250]
    prompts = [{"prompt_token_ids": base * 3}, {"prompt_token_ids": base[:5] * 4}]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    calls = count_multi_query_decodes()
    common = dict(kv_cache_memory_bytes=1 << 22, max_model_len=128)
    tri = LLM(model_dir, attention_backend="triton", speculative_config=spec, **common)
    got = [o.outputs[0].token_ids for o in tri.generate(prompts, params, use_tqdm=False)]
    ref = LLM(model_dir, attention_backend="torch", **common)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    assert got == want, (got, want)
    assert calls and tri.engine.scheduler.spec_stats.num_accepted_tokens > 0
    print("engine ok")


class _EagerGraph:
    """Stands in for a captured CUDA graph on the CPU: replay() runs the forward on the runner's static buffers
    with the capture-time metadata, as a replayed graph does, into a fixed output tensor."""

    def __init__(self, vg, size: int, bucket: int) -> None:
        self.vg, self.size, self.bucket = vg, size, bucket
        tokens = size * vg.query_len
        self.out = torch.empty(tokens, vg.runner.model.config.hidden_size)

    def replay(self) -> None:
        from pagedllm.forward_context import set_forward_context

        vg, tokens = self.vg, self.size * self.vg.query_len
        md = vg._metadata(self.size, self.bucket)
        with set_forward_context(md, vg.runner.attn_backend):
            self.out.copy_(vg.runner.model(vg.inputs.input_ids[:tokens], vg.inputs.positions[:tokens]))


def check_verify_graph_runner(model_dir: str) -> None:
    """VerifyGraphRunner.run's padding (tokens to b x (k + 1), request rows past the step's with no tokens and
    seq_len 0, padding K/V into the scratch block) with its graphs replaced by eager replays of the same static
    buffers: the speculating engine still gives the plain greedy tokens, every verify step through the runner."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.worker.kv_cache import allocate_kv_caches
    from pagedllm.worker.verify_graph import VerifyGraphRunner

    base = [17, 200, 31, 5, 88, 140, 9, 61, 300, 12, 77, 250]
    prompts = [{"prompt_token_ids": base * 3}, {"prompt_token_ids": base[:5] * 4}, {"prompt_token_ids": base[3:9]}]
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    common = dict(kv_cache_memory_bytes=1 << 22, max_model_len=128, max_num_seqs=4)
    llm = LLM(model_dir, attention_backend="triton", speculative_config=spec, **common)
    runner = llm.engine.worker.runner
    # the scratch block past the pool (CPU runs allocate none: no graphs)
    runner.kv_caches = allocate_kv_caches(runner.kv_cache_spec(), runner.num_blocks + 1, runner.device)
    for layer, cache in zip(runner.model.attn_layers, runner.kv_caches):
        layer.kv_cache = cache
    vg = VerifyGraphRunner(runner, 4, 4)
    assert vg.sizes == [1, 2, 4]
    from pagedllm.worker.graph_inputs import GraphInputs
    vg.inputs = GraphInputs(runner, vg.tokens_needed, vg.reqs_needed)
    kvh = runner.kv_cache_spec().num_kv_heads
    for size in vg.sizes:
        vg.seq_len_buckets[size] = runner.attn_backend.graph_seq_len_buckets(size, kvh, runner.max_model_len,
                                                                            runner.device)
        for bucket in vg.seq_len_buckets[size]:
            graph = _EagerGraph(vg, size, bucket)
            vg.graphs[(size, bucket, False)] = graph
            vg.outputs[(size, bucket, False)] = graph.out
    runner.verify_graphs = vg
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    ref = LLM(model_dir, attention_backend="torch", **common)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    assert got == want, (got, want)
    stats = llm.engine.scheduler.spec_stats
    # (a replay verifies every request's drafts of that step: num_drafts counts request-steps)
    assert stats.num_accepted_tokens > 0 and vg.num_replays > 0, (vg.num_replays, stats.summary())
    print("verify graph runner ok")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "engine":
        check_engine(sys.argv[2])
        check_verify_graph_runner(sys.argv[2])
    else:
        main()
