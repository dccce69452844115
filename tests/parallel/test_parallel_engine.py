"""Tensor, pipeline and tensor x pipeline parallel engines (gloo worker processes on the CPU) give the same
tokens as one in-process rank: greedy and seeded sampling, through mixed batches, prefill chunks, prefix-cache
hits and preemptions (tests/parallel/workload.py). Every multi-process engine is bounded by a timeout."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM
from tests.parallel.workload import ENGINE_KWARGS, run_workload

pytestmark = pytest.mark.timeout(240)

_reference: dict[str, dict] = {}


def _run(model_dir: str, **kwargs) -> dict:
    llm = LLM(model_dir, **ENGINE_KWARGS, **kwargs)
    try:
        return run_workload(llm)
    finally:
        llm.engine.shutdown()


def _expected(model_dir: str) -> dict:
    if model_dir not in _reference:
        _reference[model_dir] = _run(model_dir)
    return _reference[model_dir]


# gemma2-pp2: the scaled embedding on the first stage, the tied LM head and the final soft-cap on the last, Gemma's
# four norms per layer with the residual carried between stages, soft-capped attention
@pytest.mark.parametrize("arch,tp,pp", [("llama", 2, 1), ("qwen2", 1, 2), ("qwen2", 2, 2), ("gemma2", 1, 2)],
                         ids=["llama-tp2", "qwen2-pp2", "qwen2-tp2xpp2", "gemma2-pp2"])
def test_parallel_layout_matches_one_rank(tiny_model_dir, arch, tp, pp):
    model_dir = tiny_model_dir(arch)
    expected = _expected(model_dir)
    assert expected["preempted"] and expected["prefix_hits"], "the workload must preempt and hit the cache"
    got = _run(model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    assert got == expected


@pytest.fixture(scope="module")
def sliding_qwen2_dir(tmp_path_factory):
    """Layer 0 full attention, layer 1 a 12-token window: two KV-cache groups, one per pipeline stage at pp=2."""
    from tests.models.swa_helpers import save_swa_model
    return save_swa_model(str(tmp_path_factory.mktemp("qwen2-swa")), "qwen2", use_sliding_window=True,
                          sliding_window=12, max_window_layers=1)


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 2)], ids=["pp2", "tp2xpp2"])
def test_sliding_window_groups_across_stages_match_one_rank(sliding_qwen2_dir, tp, pp):
    expected = _expected(sliding_qwen2_dir)
    assert expected["preempted"] and expected["prefix_hits"]
    assert _run(sliding_qwen2_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp) == expected


def test_smollm2_tp3_and_pp2_match_one_rank(smollm2_hf_dir):
    """The real model: 9 heads / 3 KV heads / 30 layers -> TP=3, and PP=2 with 15 layers per stage."""
    from pagedllm import SamplingParams

    prompts = ["The capital of Germany is", "Write a haiku about the sea.", "1, 2, 3, 4,"]
    params = SamplingParams(temperature=0.0, max_tokens=8)

    def tokens(**kwargs) -> list[list[int]]:
        llm = LLM(smollm2_hf_dir, device="cpu", dtype="float32", enforce_eager=True, max_model_len=256,
                  kv_cache_memory_bytes=64 << 20, **kwargs)
        try:
            return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.engine.shutdown()

    expected = tokens()
    assert tokens(tensor_parallel_size=3) == expected
    assert tokens(pipeline_parallel_size=2) == expected


def test_smollm2_gguf_packed_weights_pp2_match_one_rank(smollm2_gguf_path):
    """The .gguf itself (its weights kept packed): the last stage's tied LM head packs the embedding's tensor as the
    first stage's embedding does (it failed to load before: one stage holds only a placeholder of each)."""
    from pagedllm import SamplingParams

    prompts = ["The capital of Germany is", "1, 2, 3, 4,"]
    params = SamplingParams(temperature=0.0, max_tokens=8)

    def tokens(**kwargs) -> list[list[int]]:
        llm = LLM(smollm2_gguf_path, device="cpu", dtype="float32", max_model_len=256,
                  kv_cache_memory_bytes=64 << 20, **kwargs)
        try:
            return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.engine.shutdown()

    assert tokens(pipeline_parallel_size=2) == tokens()


def _rewrite_tensors(tmp_path, source: str, edit) -> str:
    import shutil

    from safetensors.torch import load_file, save_file
    out = tmp_path / "edited"
    shutil.copytree(source, out)
    tensors = load_file(str(out / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def _differing_head(t):
    g = torch.Generator().manual_seed(1)
    embed = t["model.embed_tokens.weight"]
    t["lm_head.weight"] = embed + 0.05 * torch.randn(embed.shape, generator=g)


# head-differs: the last stage (no embedding) loaded the embedding as its head and dropped the checkpoint's lm_head,
# serving another head than one rank and transformers; head-only: the first stage (no head) found no embedding
@pytest.mark.parametrize("edit, reference", [
    (_differing_head, "edited"), (lambda t: t.update({"lm_head.weight": t.pop("model.embed_tokens.weight")}), "source"),
], ids=["head-differs", "head-only"])
def test_tied_config_head_across_stages_matches_transformers(tmp_path, tiny_model_dir, edit, reference):
    from transformers import AutoModelForCausalLM

    from pagedllm import SamplingParams
    source = tiny_model_dir("qwen2", tie_word_embeddings=True)
    edited = _rewrite_tensors(tmp_path, source, edit)
    hf = AutoModelForCausalLM.from_pretrained(edited if reference == "edited" else source, dtype=torch.float32).eval()
    prompts = [[5, 77, 300, 12, 9, 401], list(range(20, 50))]
    llm = LLM(edited, **ENGINE_KWARGS, pipeline_parallel_size=2)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1), use_tqdm=False)
    finally:
        llm.engine.shutdown()
    for prompt, out in zip(prompts, outs):
        tokens = list(out.outputs[0].token_ids)
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
        assert tokens == logits.argmax(-1).tolist()
        ref = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), tokens]
        got = torch.tensor([step[tok].logprob for step, tok in zip(out.outputs[0].logprobs, tokens)])
        torch.testing.assert_close(got, ref, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("layout", [{"pipeline_parallel_size": 2}, {"tensor_parallel_size": 2}], ids=["pp2", "tp2"])
def test_phi3_longrope_per_request_factors_across_ranks(tiny_model_dir, layout):
    """LongRoPE's per-request factors and the recompute of a request outgrowing the original context (32) with
    worker ranks: the scheduler learns the boundary from rank 0, every rank offsets its long requests' positions."""
    from tests.engine.test_correctness import check_against_hf, random_prompts
    model_dir = tiny_model_dir("phi3")
    llm = LLM(model_dir, dtype="float32", num_gpu_blocks_override=96, block_size=8, max_num_batched_tokens=16,
              max_num_seqs=8, device="cpu", enforce_eager=True, **layout)
    try:
        check_against_hf(llm, model_dir, random_prompts([5, 20, 31, 33, 45], seed=11), [6, 20, 4, 6, 10])
        assert llm.engine.get_stats().num_preemptions >= 2  # the two crossings
    finally:
        llm.engine.shutdown()


def test_packed_untied_gguf_head_across_stages_matches_one_rank(tmp_path, tiny_model_dir):
    """A .gguf kept packed (Q8_0 layers, embedding and head) under pipeline parallelism: an untied model's
    `output.weight` packed on the last stage (the tied head from `token_embd`: the SmolLM2 test above); the same
    tokens as one rank."""
    import gguf

    from pagedllm import SamplingParams
    from tests.models.gguf_writer import write_tiny_gguf

    q8 = gguf.GGMLQuantizationType.Q8_0
    kinds = {m: q8 for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "token_embd", "output")}
    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(tiny_model_dir("llama", tie_word_embeddings=False), path, "llama", kinds=kinds)
    prompts = [[5, 9, 23, 41, 7], [100, 3, 77]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def tokens(**kwargs) -> list[list[int]]:
        llm = LLM(path, device="cpu", dtype="float32", max_model_len=128, kv_cache_memory_bytes=16 << 20,
                  skip_tokenizer_init=True, **kwargs)
        try:
            return [list(o.outputs[0].token_ids) for o in llm.generate(
                [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
        finally:
            llm.engine.shutdown()

    assert tokens(pipeline_parallel_size=2) == tokens()
