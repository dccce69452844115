"""Embeddings (LLM.embed, pooling/): every pooling type equals the same pooling of transformers' final hidden states
(fp32, the same weights) through chunked prefill, prefix-cache hits, preemption and async scheduling, in batches
that also generate (whose tokens stay transformers' greedy ones); the model's sentence-transformers files set the
defaults; what cannot be honoured is refused."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.pooling import PoolingParams, model_pooling, sampling_params_for
from tests.engine.test_correctness import ARCHS, _hf_model, hf_greedy, random_prompts


def hf_pooled(model_dir: str, prompt: list[int], kind: str) -> torch.Tensor:
    """transformers' final hidden states (after the last norm) of the prompt, pooled."""
    with torch.inference_mode():
        hidden = _hf_model(model_dir).model(torch.tensor([prompt])).last_hidden_state[0].float()
    return {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[kind]


def check_pooled(model_dir: str, prompt: list[int], kind: str, got: list[float], normalized: bool) -> None:
    want = hf_pooled(model_dir, prompt, kind)
    if normalized:
        want = want / want.norm()
    torch.testing.assert_close(torch.tensor(got), want, atol=2e-5 if normalized else 1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_last_token_embeddings_match_hf(arch, tiny_model_dir):
    """The default (a model without sentence-transformers files): the last token's hidden state, unit length."""
    model_dir = tiny_model_dir(arch)
    llm = LLM(model=model_dir, dtype="float32", num_gpu_blocks_override=64)
    prompts = random_prompts([1, 6, 40, 13], seed=3)
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == prompt and len(out.outputs.embedding) == llm.engine.hidden_size
        assert abs(float(torch.tensor(out.outputs.embedding).norm()) - 1.0) < 1e-5
        check_pooled(model_dir, prompt, "last", out.outputs.embedding, normalized=True)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_pooling_through_chunks_prefix_hits_and_a_generating_batch(tiny_llama_dir, kind, async_scheduling):
    """Prompts longer than the step's budget arrive in chunks; a second pass over the same prompts hits the prefix
    cache (last-token pooling takes the hits, mean / cls recompute every position); generation requests share the
    steps and keep transformers' tokens."""
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=96, block_size=8,
              max_num_batched_tokens=16, max_num_seqs=4, async_scheduling=async_scheduling)
    prompts = random_prompts([37, 1, 20, 16], seed=11)
    generating = random_prompts([9, 25], seed=12)
    for rnd in range(2):
        params = [sampling_params_for(kind)] * len(prompts) + [
            SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (12, 7)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts + generating], params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            check_pooled(tiny_llama_dir, prompt, kind, out.pooled, normalized=False)
            assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason is not None  # no token out
            if rnd == 1 and len(prompt) > 8:
                assert (out.num_cached_tokens > 0) == (kind == "last"), (kind, out.num_cached_tokens)
        for prompt, m, out in zip(generating, (12, 7), outs[len(prompts):]):
            assert out.pooled is None and out.outputs[0].token_ids == hf_greedy(tiny_llama_dir, prompt, m)[0]
    assert not llm.engine.has_unfinished_requests()


def test_embeddings_survive_preemption(tiny_qwen3_dir):
    """A pool too small for everything at once: requests are preempted and recomputed; every vector is still
    transformers' (mean pooling restarts its sum when the prompt is recomputed)."""
    llm = LLM(model=tiny_qwen3_dir, dtype="float32", num_gpu_blocks_override=12, block_size=8, max_model_len=96,
              max_num_batched_tokens=24, max_num_seqs=4, enable_prefix_caching=False)
    long_runs = random_prompts([20, 18], seed=21)
    embeds = random_prompts([30, 26, 33], seed=22)
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 2 + [sampling_params_for("mean")] * 3
    outs = llm.generate([{"prompt_token_ids": p} for p in long_runs + embeds], params, use_tqdm=False)
    assert llm.engine.get_stats().num_preemptions > 0
    for prompt, out in zip(long_runs, outs):
        assert out.outputs[0].token_ids == hf_greedy(tiny_qwen3_dir, prompt, 40)[0]
    for prompt, out in zip(embeds, outs[2:]):
        check_pooled(tiny_qwen3_dir, prompt, "mean", out.pooled, normalized=False)


def test_sentence_transformers_files_set_the_defaults(tiny_llama_dir, tmp_path):
    model_dir = str(tmp_path / "st-model")
    shutil.copytree(tiny_llama_dir, model_dir)
    assert model_pooling(model_dir).pooling_type == "last" and model_pooling(model_dir).normalize
    os.makedirs(os.path.join(model_dir, "1_Pooling"))
    with open(os.path.join(model_dir, "modules.json"), "w") as f:  # no Normalize module: raw vectors
        json.dump([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}], f)
    with open(os.path.join(model_dir, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, "pooling_mode_cls_token": False,
                   "pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}, f)
    llm = LLM(model=model_dir, dtype="float32", num_gpu_blocks_override=32)
    prompt = random_prompts([11], seed=4)[0]
    (raw,) = llm.embed([prompt], use_tqdm=False)
    check_pooled(tiny_llama_dir, prompt, "mean", raw.outputs.embedding, normalized=False)
    # a request's own choices win over the model's
    (unit_last,) = llm.embed([prompt], PoolingParams(pooling_type="last", normalize=True), use_tqdm=False)
    check_pooled(tiny_llama_dir, prompt, "last", unit_last.outputs.embedding, normalized=True)
    with open(os.path.join(model_dir, "1_Pooling", "config.json"), "w") as f:
        json.dump({"pooling_mode_weightedmean_tokens": True}, f)
    with pytest.raises(ValueError, match="pooling_mode_weightedmean_tokens .* is not supported"):
        model_pooling(model_dir)


def test_what_cannot_be_honoured_is_refused(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=32, max_model_len=64)
    hidden = llm.engine.hidden_size
    (out,) = llm.embed([[5, 6, 7]], PoolingParams(dimensions=hidden), use_tqdm=False)
    assert len(out.outputs.embedding) == hidden
    with pytest.raises(ValueError, match=f"dimensions=8 is not supported: this model's embeddings have {hidden} "
                                         "dimensions, and its config.json does not say it was trained for shorter"):
        llm.embed([[5, 6, 7]], PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_type must be one of last, mean, cls"):
        PoolingParams(pooling_type="max")
    with pytest.raises(ValueError, match="an embedding input may have at most 63"):
        llm.embed([[5] * 64], use_tqdm=False)
    with pytest.raises(ValueError, match="The prompt is empty"):
        llm.embed([[]], use_tqdm=False)
    for nothing in (None, 5):
        with pytest.raises(ValueError, match="embed\\(\\) needs prompts"):
            llm.embed(nothing, use_tqdm=False)
    assert llm.embed([], use_tqdm=False) == [] and llm.encode([], use_tqdm=False) == []  # as generate([])
    (upper,) = llm.embed([[5, 6, 7]], PoolingParams(pooling_type="MEAN", normalize=False), use_tqdm=False)
    check_pooled(tiny_llama_dir, [5, 6, 7], "mean", upper.outputs.embedding, normalized=False)
    with pytest.raises(ValueError, match="takes n=1, max_tokens=1 and no prompt_logprobs"):
        SamplingParams(max_tokens=4, pooling="last")
    # truncate_prompt_tokens keeps the last k tokens, as for generation
    (cut,) = llm.embed([list(range(5, 25))], PoolingParams(truncate_prompt_tokens=6), use_tqdm=False)
    assert cut.prompt_token_ids == list(range(19, 25))
    check_pooled(tiny_llama_dir, list(range(19, 25)), "last", cut.outputs.embedding, normalized=True)
    # -1 (the model's context) cuts to what an embedding input may hold, not to a length then refused
    (whole,) = llm.embed([list(range(5, 105))], PoolingParams(truncate_prompt_tokens=-1), use_tqdm=False)
    assert whole.prompt_token_ids == list(range(42, 105))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_embeddings_beside_speculative_decoding(tiny_llama_dir, async_scheduling):
    """An engine with n-gram speculation: repeating prompts get drafts verified in the same steps as the embedding
    requests' chunks; neither changes the other."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    llm = LLM(model=tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=1 << 24, max_model_len=256,
              speculative_config=spec, async_scheduling=async_scheduling, max_num_batched_tokens=32, max_num_seqs=6)
    base = random_prompts([12], seed=51)[0]
    generating = [base * 3, random_prompts([17], seed=52)[0]]
    embeds = random_prompts([40, 3, 25], seed=53)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 2 + [sampling_params_for("mean")] * 3
    outs = llm.generate([{"prompt_token_ids": p} for p in generating + embeds], params, use_tqdm=False)
    for prompt, out in zip(generating, outs):
        assert out.outputs[0].token_ids == hf_greedy(tiny_llama_dir, prompt, 24)[0]
    for prompt, out in zip(embeds, outs[2:]):
        check_pooled(tiny_llama_dir, prompt, "mean", out.pooled, normalized=False)
    assert not llm.engine.has_unfinished_requests()


def test_smollm2_embeddings_match_transformers_and_the_packed_gguf_path(smollm2_hf_dir, smollm2_gguf_path):
    """The real default model: its HF directory in fp32 against transformers; its .gguf kept packed (whose one-token
    steps run the C++ decode stack: a one-token prompt, and a repeated prompt whose prefix hit leaves one token)
    against that, within the packed kernels' rounding."""
    texts = ["The capital of France is Paris.", "a",
             "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"]
    hf_dir = LLM(model=smollm2_hf_dir, dtype="float32", num_gpu_blocks_override=64, max_model_len=512)
    tok = hf_dir.get_tokenizer()
    prompts = [tok.encode(t) for t in texts]
    assert len(prompts[1]) == 1
    want = hf_dir.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for prompt, out in zip(prompts, want):
        check_pooled(smollm2_hf_dir, prompt, "last", out.outputs.embedding, normalized=True)
    hf_dir.shutdown()
    packed = LLM(model=smollm2_gguf_path, num_gpu_blocks_override=64, max_model_len=512, block_size=16)
    for rnd in range(2):  # the second: every prompt's full blocks are prefix hits
        outs = packed.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        for w, out in zip(want, outs):
            cos = torch.nn.functional.cosine_similarity(torch.tensor(out.outputs.embedding),
                                                        torch.tensor(w.outputs.embedding), dim=0)
            assert float(cos) > 0.995, (rnd, float(cos))
    assert outs[0].prompt_token_ids == prompts[0]
    assert len(prompts[2]) > 32 and packed.engine.get_stats().prefix_cache_hits >= 32


def _decoder_only_checkpoint(causal_dir: str, out_dir: str, architecture: str, tied: bool = False) -> str:
    """The decoder stack of a causal checkpoint saved on its own, as transformers' AutoModel saves it (tensor names
    without `model.`, no lm_head), its config naming `architecture`."""
    from transformers import AutoModelForCausalLM

    causal = AutoModelForCausalLM.from_pretrained(causal_dir, dtype=torch.float32)
    causal.model.save_pretrained(out_dir)
    for name in os.listdir(causal_dir):  # the tokenizer's files
        if name.startswith("tokenizer") or name.endswith(".jinja"):
            shutil.copy(os.path.join(causal_dir, name), out_dir)
    with open(os.path.join(out_dir, "config.json")) as f:
        config = json.load(f)
    config["architectures"] = [architecture]
    config["tie_word_embeddings"] = tied
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    from safetensors import safe_open

    with safe_open(os.path.join(out_dir, "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert names and not any(n.startswith(("model.", "lm_head")) for n in names)
    return out_dir


@pytest.mark.parametrize("arch, causal_arch, tied", [
    ("qwen3", "Qwen3Model", False), ("mistral", "MistralModel", False), ("qwen3", "Qwen3ForCausalLM", True),
    ("qwen3", "Qwen3ForCausalLM", False)])
def test_decoder_stacks_saved_without_their_head(arch, causal_arch, tied, tiny_model_dir, tmp_path):
    """Embedding checkpoints as published: a bare decoder stack (`Qwen3Model`, e5-mistral's `MistralModel`: no head,
    names without `model.`) serves embeddings only; Qwen3-Embedding's layouts (the same tensors under a config that
    says Qwen3ForCausalLM: 0.6B ties its head to the embedding and serves both, 8B does not and serves embeddings
    only). Vectors equal transformers' AutoModel."""
    from transformers import AutoModel

    model_dir = _decoder_only_checkpoint(tiny_model_dir(arch), str(tmp_path / "stack"), causal_arch, tied)
    llm = LLM(model=model_dir, dtype="float32", num_gpu_blocks_override=32)
    prompts = random_prompts([7, 30], seed=61)
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], PoolingParams(normalize=False), use_tqdm=False)
    reference = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            want = reference(torch.tensor([prompt])).last_hidden_state[0, -1]
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, atol=1e-4, rtol=1e-4)
    if not tied:
        with pytest.raises(ValueError, match=f"This model \\({causal_arch}\\) is a decoder without its language-model "
                                             "head: it serves embeddings"):
            llm.generate([prompts[0]], SamplingParams(max_tokens=2), use_tqdm=False)
    else:
        (gen,) = llm.generate([prompts[0]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
        assert len(gen.outputs[0].token_ids) == 2
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("sizes", [True, [8, 16, 32]])
def test_matryoshka_dimensions(tiny_llama_dir, tmp_path, sizes):
    """A config that says it was trained for shorter embeddings (vLLM's `is_matryoshka` / `matryoshka_dimensions`):
    `dimensions` keeps the first values, then normalizes; other lengths are refused naming the allowed ones."""
    model_dir = str(tmp_path / "mrl")
    shutil.copytree(tiny_llama_dir, model_dir)
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    config.update({"is_matryoshka": True} if sizes is True else {"matryoshka_dimensions": sizes})
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f)
    llm = LLM(model=model_dir, dtype="float32", num_gpu_blocks_override=32)
    hidden = llm.engine.hidden_size
    prompt = random_prompts([9], seed=71)[0]
    (full,) = llm.embed([prompt], PoolingParams(normalize=False), use_tqdm=False)
    (short,) = llm.embed([prompt], PoolingParams(dimensions=16), use_tqdm=False)
    head = torch.tensor(full.outputs.embedding[:16])
    torch.testing.assert_close(torch.tensor(short.outputs.embedding), head / head.norm(), atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match=f"may have {'8, 16, 32' if sizes is not True else f'1 to {hidden}'} dim"):
        llm.embed([prompt], PoolingParams(dimensions=hidden + 1 if sizes is True else 12), use_tqdm=False)


def test_hf_overrides_merge_over_the_files_matryoshka_fields(tmp_path):
    """--hf-overrides sets config fields over config.json's (as transformers merges them): overriding one of
    is_matryoshka / matryoshka_dimensions keeps the file's other (it replaced both: any length allowed)."""
    (tmp_path / "config.json").write_text(json.dumps({"matryoshka_dimensions": [8, 16, 32]}))
    assert model_pooling(str(tmp_path), None, {"is_matryoshka": True}).matryoshka == (8, 16, 32)
    (tmp_path / "config.json").write_text(json.dumps({"is_matryoshka": True}))
    assert model_pooling(str(tmp_path), None, {"matryoshka_dimensions": [16]}).matryoshka == (16,)
    assert model_pooling(str(tmp_path), None, {"matryoshka_dimensions": None}).matryoshka == ()
    assert model_pooling(str(tmp_path), None, {"is_matryoshka": False}).matryoshka is None
    assert model_pooling(None, None, {"is_matryoshka": True}).matryoshka == ()


def test_pooling_runner_and_pooler_config(tiny_llama_dir):
    """vLLM's runner="pooling" (and convert / task "embed"): embeddings only, generation refused saying why;
    pooler_config (vLLM's upper-case pooling types) over the model's defaults; contradictions and unbuilt keys
    refused at start."""
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=32, runner="pooling",
              pooler_config={"pooling_type": "MEAN", "normalize": False})
    prompt = random_prompts([13], seed=81)[0]
    (out,) = llm.embed([prompt], use_tqdm=False)
    check_pooled(tiny_llama_dir, prompt, "mean", out.outputs.embedding, normalized=False)
    with pytest.raises(ValueError, match="runs the model for embeddings only \\(runner 'pooling'"):
        llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    llm.shutdown()
    for kwargs, message in [({"task": "embed", "runner": "generate"}, "contradict each other"),
                            ({"pooler_config": {"pooling_type": "MAX"}}, "must be LAST, MEAN, CLS, ALL or STEP"),
                            ({"pooler_config": {"dimensions": 8}}, "\\['dimensions'\\] is not supported"),
                            ({"convert": "mm_encoder_only"}, "other conversions are not built"),
                            ({"convert": "classify"}, "\\(LlamaForCausalLM\\) is not one \\(to rank with LM-head rows")]:
        with pytest.raises(ValueError, match=message):
            LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=32, **kwargs)


def test_offline_score_is_the_cosine_of_the_embeddings(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=32)
    texts = ["hello there", "general kenobi", "hello there"]
    vectors = [torch.tensor(o.outputs.embedding) for o in llm.embed(texts, use_tqdm=False)]
    one_to_many = llm.score(texts[0], texts[1:], use_tqdm=False)
    assert [round(o.outputs.score, 5) for o in one_to_many] == [round(float(vectors[0] @ vectors[1]), 5), 1.0]
    pairwise = llm.score(texts[:2], texts[1:], use_tqdm=False)
    assert abs(pairwise[0].outputs.score - float(vectors[0] @ vectors[1])) < 1e-5
    assert abs(pairwise[1].outputs.score - float(vectors[1] @ vectors[2])) < 1e-5
    with pytest.raises(ValueError, match="must be as long"):
        llm.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)
    # texts only: token ids were a KeyError (embed() read them as one prompt), prompt dicts "unhashable type"
    for first, second in [([1, 2], [3, 4]), ("a", [{"prompt": "b"}]), (5, "a")]:
        with pytest.raises(ValueError, match="must be a string or a list of strings"):
            llm.score(first, second, use_tqdm=False)


def test_truncate_prompt_tokens_argument_of_embed_and_encode(tiny_llama_dir):
    """vLLM's LLM.embed / LLM.encode take truncate_prompt_tokens as a keyword (it was a TypeError): the last k
    tokens are embedded, as with PoolingParams(truncate_prompt_tokens=k); giving both ways is refused."""
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=32, max_model_len=64)
    (cut,) = llm.embed([list(range(5, 25))], truncate_prompt_tokens=6, use_tqdm=False)
    assert cut.prompt_token_ids == list(range(19, 25))
    check_pooled(tiny_llama_dir, list(range(19, 25)), "last", cut.outputs.embedding, normalized=True)
    (whole,) = llm.embed([list(range(5, 105))], truncate_prompt_tokens=-1, use_tqdm=False)
    assert whole.prompt_token_ids == list(range(42, 105))
    (enc,) = llm.encode([list(range(5, 25))], truncate_prompt_tokens=6, pooling_task="embed", use_tqdm=False)
    assert enc.prompt_token_ids == list(range(19, 25))
    torch.testing.assert_close(enc.outputs.data, torch.tensor(cut.outputs.embedding, dtype=torch.float32))
    with pytest.raises(ValueError, match="truncate_prompt_tokens in pooling_params or as the argument, not both"):
        llm.embed([[5, 6]], PoolingParams(normalize=True), truncate_prompt_tokens=2, use_tqdm=False)


def test_score_of_an_embedding_model_takes_pooling_params(tiny_llama_dir):
    """LLM.score(..., pooling_params=...) (vLLM's; a TypeError before) makes both texts' embeddings with them: the
    score is the cosine of their mean-pooled hidden states, not of the model's default (last token)."""
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=32, max_model_len=64)
    a, b = "hello there", "general kenobi"
    ids = [llm.get_tokenizer().encode(t) for t in (a, b)]
    mean = [hf_pooled(tiny_llama_dir, i, "mean") for i in ids]
    last = [hf_pooled(tiny_llama_dir, i, "last") for i in ids]
    (got,) = llm.score(a, b, pooling_params=PoolingParams(pooling_type="mean"), use_tqdm=False)
    assert got.outputs.score == pytest.approx(torch.cosine_similarity(*mean, dim=0).item(), abs=1e-4)
    (default,) = llm.score(a, b, use_tqdm=False)
    assert default.outputs.score == pytest.approx(torch.cosine_similarity(*last, dim=0).item(), abs=1e-4)
    assert abs(got.outputs.score - default.outputs.score) > 1e-3
