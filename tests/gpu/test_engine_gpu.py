"""The engine on CUDA: Triton attention, CUDA graphs, GPU sampling, against transformers and eager mode."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.engine.test_correctness import check_against_hf, random_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_fp32_greedy_matches_hf_with_cuda_graphs(arch, tiny_model_dir):
    model_dir = tiny_model_dir(arch)
    llm = LLM(model=model_dir, dtype="float32", device="cuda", num_gpu_blocks_override=64, max_num_seqs=16)
    assert llm.engine.worker.runner.cuda_graphs is not None
    prompts = random_prompts([1, 5, 17, 33, 64, 3], seed=1)
    check_against_hf(llm, model_dir, prompts, [12, 7, 20, 9, 15, 24])


def test_chunked_prefill_prefix_and_preemption_on_gpu(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", device="cuda", num_gpu_blocks_override=7, block_size=16,
              max_model_len=112, max_num_batched_tokens=16, max_num_seqs=4)
    shared = random_prompts([20], seed=6)[0]
    prompts = random_prompts([5, 9, 2, 14], seed=7, prefix=shared)
    check_against_hf(llm, tiny_llama_dir, prompts, [30, 35, 26, 32])
    assert llm.engine.get_stats().num_preemptions > 0


def test_bf16_cuda_graph_equals_eager(tiny_qwen3_dir):
    prompts = [{"prompt_token_ids": p} for p in random_prompts([3, 30, 11, 50, 7, 1, 19, 2, 44], seed=9)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    graph = LLM(model=tiny_qwen3_dir, dtype="bfloat16", device="cuda", num_gpu_blocks_override=128)
    eager = LLM(model=tiny_qwen3_dir, dtype="bfloat16", device="cuda", num_gpu_blocks_override=128,
                enforce_eager=True)
    a = [o.outputs[0].token_ids for o in graph.generate(prompts, sp, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in eager.generate(prompts, sp, use_tqdm=False)]
    assert a == b


def test_bf16_logprobs_close_to_hf(tiny_llama_dir):
    from tests.engine.test_correctness import hf_greedy

    llm = LLM(model=tiny_llama_dir, dtype="bfloat16", device="cuda", num_gpu_blocks_override=64)
    prompt = random_prompts([21], seed=11)[0]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1, logprobs=5),
                       use_tqdm=False)[0].outputs[0]
    ref_tokens, ref_lps = hf_greedy(tiny_llama_dir, prompt, 1)
    got = out.logprobs[0][out.token_ids[0]].logprob
    assert abs(got - ref_lps[0]) < 0.05


def test_seeded_sampling_batch_independent_on_gpu(tiny_qwen2_dir):
    llm = LLM(model=tiny_qwen2_dir, dtype="float32", device="cuda", num_gpu_blocks_override=64)
    p = {"prompt_token_ids": random_prompts([9], seed=12)[0]}
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=16, seed=123, ignore_eos=True)
    alone = llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": q} for q in random_prompts([4, 40, 13], seed=13)]
    mixed = llm.generate(others + [p], [SamplingParams(max_tokens=20, ignore_eos=True)] * 3 + [sp],
                         use_tqdm=False)[3].outputs[0].token_ids
    assert alone == mixed


def test_not_enough_gpu_memory_says_what_to_lower():
    with pytest.raises(ValueError, match="Raise --gpu-memory-utilization") as info:
        LLM(model="benchmarks/configs/qwen3-0.6b", load_format="dummy", skip_tokenizer_init=True,
            gpu_memory_utilization=0.005, max_model_len=4096)
    assert "lower --max-model-len" in str(info.value) and "GiB more is needed" in str(info.value)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lm_head_greedy_on_cuda_equals_argmax_of_fp32_logits(dtype):
    """The CUDA greedy shortcut takes the argmax of model-dtype logits; it must equal compute_logits' (fp32)
    argmax, ties (lowest id) and padded vocab rows included."""
    from pagedllm.layers.vocab_embedding import ParallelLMHead

    torch.manual_seed(0)
    head = ParallelLMHead(2990, 96).to(device="cuda", dtype=dtype)
    assert head.weight.shape[0] > 2990  # padded vocab rows exist
    head.weight.data.normal_(0, 0.5)
    head.weight.data[2990:] = head.weight.data[2900] * 10  # padding rows would win if not sliced off
    head.weight.data[7] = head.weight.data[2900]  # exact tie: id 7 must win
    x = (torch.randn(40, 96, device="cuda") * 3).to(dtype)
    x[:8] = head.weight.data[2900] * 5
    x[8:12] = 0.0  # every logit equal: token 0
    fast = head.greedy_token_ids(x)
    full = head.compute_logits(x).argmax(dim=-1)
    assert fast.dtype == torch.int64 and torch.equal(fast, full)
    assert set(fast[:8].tolist()) == {7} and set(fast[8:12].tolist()) == {0}
    assert int(fast.max()) < 2990


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_embeddings_on_cuda_match_hf(tiny_llama_dir, kind):
    """Embedding requests on CUDA (mixed-step graphs, chunks, async scheduling) next to generating ones: the pooled
    vectors are transformers' in fp32, the generated tokens too."""
    from pagedllm.pooling import sampling_params_for
    from tests.engine.test_correctness import hf_greedy
    from tests.engine.test_embeddings import check_pooled

    llm = LLM(model=tiny_llama_dir, dtype="float32", device="cuda", num_gpu_blocks_override=96, block_size=16,
              max_num_batched_tokens=32, max_num_seqs=8)
    prompts = random_prompts([45, 1, 20, 16], seed=14)
    generating = random_prompts([9, 25], seed=15)
    params = [sampling_params_for(kind)] * len(prompts) + [
        SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (12, 7)]
    for _ in range(2):  # the second round: prefix-cache hits for last-token pooling
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts + generating], params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            check_pooled(tiny_llama_dir, prompt, kind, out.pooled, normalized=False)
        for prompt, m, out in zip(generating, (12, 7), outs[len(prompts):]):
            assert out.outputs[0].token_ids == hf_greedy(tiny_llama_dir, prompt, m)[0]


def test_classifier_on_cuda_matches_hf(tiny_classifier_dir):
    """A sequence classifier on CUDA (chunks, mixed-step graphs): its label logits and probabilities are
    transformers' in fp32."""
    from pagedllm.pooling import sampling_params_for
    from tests.engine.test_classify import hf_logits

    model_dir = tiny_classifier_dir("qwen3")
    llm = LLM(model=model_dir, dtype="float32", device="cuda", num_gpu_blocks_override=64, block_size=16,
              max_num_batched_tokens=32, max_num_seqs=8)
    prompts = random_prompts([45, 1, 20, 16], seed=21)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling_params_for("last"), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        torch.testing.assert_close(torch.tensor(out.pooled), hf_logits(model_dir, prompt), atol=1e-4, rtol=1e-4)
    probs = llm.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for prompt, out in zip(prompts, probs):
        want = hf_logits(model_dir, prompt).softmax(-1)
        torch.testing.assert_close(torch.tensor(out.outputs.probs), want, atol=2e-5, rtol=1e-4)


def test_sleep_frees_weights_and_kv_cache_and_wake_up_recaptures_graphs(tiny_llama_dir):
    """Sleep mode on CUDA: sleep(1) gives back the KV cache and the weights' device memory (moved to pinned host
    memory); wake_up restores them at new addresses, so the CUDA graphs are captured anew and tokens are the same."""
    llm = LLM(model=tiny_llama_dir, dtype="float32", device="cuda", num_gpu_blocks_override=256,
              enable_sleep_mode=True)
    runner = llm.engine.worker.runner
    assert runner.cuda_graphs is not None
    prompts = [{"prompt_token_ids": p} for p in random_prompts([3, 30, 11, 1], seed=21)]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.worker.model.parameters())
    kv_bytes = sum(t.numel() * t.element_size() for t in runner.kv_caches)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    llm.sleep(level=1)
    freed = allocated - torch.cuda.memory_allocated()
    assert freed >= kv_bytes + 0.9 * weight_bytes, (freed, kv_bytes, weight_bytes)
    assert runner.cuda_graphs is None and runner.mixed_graphs is None
    llm.wake_up()
    assert runner.cuda_graphs is not None
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert after == before
    llm.sleep(level=2)
    llm.wake_up()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == before
