"""Multi-LoRA in the engine (CPU, fp32) against transformers + PEFT with real adapters made by the peft library.

Adapters have non-zero B, different ranks and target modules, one uses rsLoRA. Each adapter's greedy tokens in a
mixed batch (base requests + 3 adapters, prefix-cache hits, chunked prefill) equal PEFT's for that adapter alone,
and the base requests' tokens equal the base model's.
"""
from __future__ import annotations

import contextlib
import random

import pytest
import torch

from pagedllm import LLM, LoRARequest, SamplingParams
from tests.lora.lora_helpers import make_adapter, peft_greedy

ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (rank, alpha, targets, rsLoRA)
ADAPTER_SPECS = [(8, 16, ALL7, False), (4, 8, ["q_proj", "v_proj", "down_proj"], True),
                 (16, 8, ["k_proj", "o_proj", "gate_proj", "up_proj"], False)]


@pytest.fixture(scope="module")
def adapter_factory(tmp_path_factory):
    made: dict = {}

    def make(model_dir: str) -> list[str]:
        if model_dir not in made:
            root = tmp_path_factory.mktemp("loras")
            made[model_dir] = [make_adapter(model_dir, str(root / f"a{i}"), r=r, alpha=alpha, targets=t, seed=i + 1,
                                            use_rslora=rs) for i, (r, alpha, t, rs) in enumerate(ADAPTER_SPECS)]
        return made[model_dir]

    return make


def lora_requests(paths: list[str], first_id: int = 1) -> list[LoRARequest]:
    return [LoRARequest(f"adapter{i}", first_id + i, p) for i, p in enumerate(paths)]


def check_mixed_batch(llm: LLM, model_dir: str, paths: list[str], vocab: int, max_tokens: int = 8,
                      lengths=(5, 40, 9, 23, 3, 36, 12, 40), seed: int = 0):
    """Base + every adapter, twice each, prompts sharing a 2-block prefix (prefix hits within an adapter)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(2, vocab) for _ in range(32)]
    prompts = [(prefix if n > 30 else []) + [rng.randrange(2, vocab) for _ in range(n % 30 + 1)] for n in lengths]
    reqs = ([None] + lora_requests(paths)) * 2
    reqs = reqs[:len(prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    # Warm the prefix cache for adapter0 and the base model, so the batch below gets hits for those.
    llm.generate([{"prompt_token_ids": prefix + [5]}] * 2, SamplingParams(max_tokens=1), use_tqdm=False,
                 lora_request=[None, reqs[1]])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=reqs, use_tqdm=False)
    for prompt, req, out in zip(prompts, reqs, outs):
        ref_tokens, ref_lps = peft_greedy(model_dir, None if req is None else req.lora_path, prompt, max_tokens)
        got = out.outputs[0]
        who = "base" if req is None else req.lora_name
        assert got.token_ids == ref_tokens, f"{who}, prompt of {len(prompt)} tokens"
        lps = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(ref_lps), atol=2e-4, rtol=0)
        assert out.lora_request is req
    return prompts, reqs, outs


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_mixed_batch_matches_peft(arch, tiny_model_dir, adapter_factory):
    model_dir = tiny_model_dir(arch)
    paths = adapter_factory(model_dir)
    llm = LLM(model=model_dir, dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16,
              num_gpu_blocks_override=96, max_num_batched_tokens=48, max_num_seqs=8)
    prompts, reqs, outs = check_mixed_batch(llm, model_dir, paths, vocab=512)
    # Prefix hits only within the same adapter: the warmed prefix is reused by base and adapter0 requests.
    for prompt, req, out in zip(prompts, reqs, outs):
        if len(prompt) > 32 and (req is None or req.lora_int_id == 1):
            assert out.num_cached_tokens >= 32, (req, out.num_cached_tokens)
    # The one long prompt of adapter2 shares its prefix with base and adapter0 blocks only: no hit.
    assert reqs[7].lora_int_id == 3 and len(prompts[7]) > 32 and outs[7].num_cached_tokens == 0


def test_prefix_blocks_never_shared_between_adapters(tiny_llama_dir, adapter_factory, tmp_path):
    paths = adapter_factory(tiny_llama_dir)
    llm = LLM(model=tiny_llama_dir, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              num_gpu_blocks_override=64)
    a, b = lora_requests(paths[:2])
    prompt = {"prompt_token_ids": list(range(2, 50))}
    sp = SamplingParams(max_tokens=1)
    assert llm.generate(prompt, sp, lora_request=a, use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.generate(prompt, sp, lora_request=b, use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.generate(prompt, sp, use_tqdm=False)[0].num_cached_tokens == 0
    # 48 tokens = 3 full blocks; the last one is recomputed to sample from it
    assert llm.generate(prompt, sp, lora_request=a, use_tqdm=False)[0].num_cached_tokens == 32
    # id 1 given b's weights (the engine reloads an id whose path changed, also after a removal): a's cached blocks
    # must not serve it (they did: tokens of neither adapter); the same path again keeps its blocks
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    want = peft_greedy(tiny_llama_dir, paths[1], prompt["prompt_token_ids"], 3)[0]
    for _ in range(2):
        out = llm.generate(prompt, greedy, lora_request=LoRARequest("re", 1, paths[1]), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == want
        llm.generate(prompt, sp, lora_request=a, use_tqdm=False)
        llm.engine.remove_lora(1)
    out = llm.generate(prompt, greedy, lora_request=a, use_tqdm=False)[0]
    assert out.num_cached_tokens == 32 and out.outputs[0].token_ids == peft_greedy(
        tiny_llama_dir, paths[0], prompt["prompt_token_ids"], 3)[0]
    # vLLM's load_inplace: new weights saved at the same path are read again, and the old ones' blocks not used
    import shutil

    moving = str(tmp_path / "moving")
    shutil.copytree(paths[0], moving)
    llm.generate(prompt, sp, lora_request=LoRARequest("m", 9, moving), use_tqdm=False)
    shutil.copytree(paths[1], moving, dirs_exist_ok=True)
    out = llm.generate(prompt, greedy, lora_request=LoRARequest("m", 9, moving, load_inplace=True), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == want


def test_more_adapters_than_slots_swaps_and_keeps_tokens(tiny_llama_dir, adapter_factory, tmp_path):
    """4 adapters, 1 device slot and 2 host entries: the scheduler holds requests back, slots and the host cache
    swap mid-run (adapters are re-read from disk), and every request still gets PEFT's tokens."""
    paths = adapter_factory(tiny_llama_dir)
    paths = paths + [make_adapter(tiny_llama_dir, str(tmp_path / "a3"), r=2, alpha=4, targets=["v_proj"], seed=9)]
    llm = LLM(model=tiny_llama_dir, dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=2,
              max_lora_rank=16, num_gpu_blocks_override=96, max_num_seqs=8)
    rng = random.Random(3)
    reqs = lora_requests(paths) * 2 + [None, None]
    rng.shuffle(reqs)
    prompts = [[rng.randrange(2, 512) for _ in range(rng.randrange(3, 20))] for _ in reqs]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), lora_request=reqs,
                        use_tqdm=False)
    for prompt, req, out in zip(prompts, reqs, outs):
        assert out.outputs[0].token_ids == peft_greedy(tiny_llama_dir, req and req.lora_path, prompt, 6)[0]
    manager = llm.engine.worker.lora_manager
    assert manager.num_slot_loads >= 4 and manager.num_disk_loads > 4  # swapped in and out, re-read from disk
    assert len(manager.host) <= 2 and len(manager.slot_of) <= 1


def test_adapter_gone_from_disk_fails_its_requests_alone(tiny_llama_dir, tmp_path):
    """An adapter evicted from the host cache is read again when a step needs it; its directory removed since, that
    read failed inside the step and left the engine failed for good (every later generate raised it). Now its
    requests end with finish_reason 'error' and the others, then and later, are served."""
    import shutil

    a = make_adapter(tiny_llama_dir, str(tmp_path / "a"), r=4, alpha=8, targets=["q_proj"], seed=21)
    b = make_adapter(tiny_llama_dir, str(tmp_path / "b"), r=4, alpha=8, targets=["v_proj"], seed=22)
    llm = LLM(model=tiny_llama_dir, dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8,
              num_gpu_blocks_override=32)
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    ra, rb = LoRARequest("a", 1, a), LoRARequest("b", 2, b)
    prompt = {"prompt_token_ids": [3, 4, 5, 6]}
    llm.generate([prompt] * 2, sp, lora_request=[ra, rb], use_tqdm=False)  # b's read evicts a's host copy
    shutil.rmtree(a)
    want = peft_greedy(tiny_llama_dir, b, prompt["prompt_token_ids"], 3)[0]
    outs = llm.generate([prompt] * 2, sp, lora_request=[rb, ra], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == want and outs[1].outputs[0].finish_reason == "error"
    assert llm.generate(prompt, sp, lora_request=rb, use_tqdm=False)[0].outputs[0].token_ids == want


def test_smollm2_adapters_match_peft(smollm2_hf_dir, adapter_factory):
    paths = adapter_factory(smollm2_hf_dir)
    llm = LLM(model=smollm2_hf_dir, dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16,
              num_gpu_blocks_override=128, max_model_len=2048, max_num_batched_tokens=64, max_num_seqs=8)
    vocab = llm.engine.vocab_size
    check_mixed_batch(llm, smollm2_hf_dir, paths, vocab=vocab, max_tokens=4, lengths=(4, 36, 7, 5))


@pytest.mark.parametrize("method,async_scheduling", [("ngram", False), ("ngram", True), ("draft_model", False)])
def test_speculation_with_adapters_matches_peft(tiny_llama_dir, adapter_factory, method, async_scheduling):
    """Speculative decoding with adapters and base requests in one batch: drafts are verified with each request's
    own adapter, so every request gets PEFT's greedy tokens and logprobs, and drafts do get accepted (with async
    scheduling: overlapped verify steps, drafts on the device)."""
    paths = adapter_factory(tiny_llama_dir)
    spec = ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
            if method == "ngram" else {"model": tiny_llama_dir, "num_speculative_tokens": 3})
    llm = LLM(model=tiny_llama_dir, dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16,
              num_gpu_blocks_override=96, max_num_seqs=8, speculative_config=spec, async_scheduling=async_scheduling)
    rng = random.Random(5)
    base = [rng.randrange(2, 512) for _ in range(10)]
    # Repeating prompts: the n-gram lookup proposes drafts; the adapters' answers differ from the base model's.
    prompts = [base * 3, base[:6] * 4, [rng.randrange(2, 512) for _ in range(15)], base * 2 + [3, 4]] * 2
    reqs = [None] + lora_requests(paths) + lora_requests(paths) + [None]
    max_tokens = 12
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1),
                        lora_request=reqs, use_tqdm=False)
    for prompt, req, out in zip(prompts, reqs, outs):
        ref_tokens, ref_lps = peft_greedy(tiny_llama_dir, req and req.lora_path, prompt, max_tokens)
        got = out.outputs[0]
        assert got.token_ids == ref_tokens, f"{'base' if req is None else req.lora_name}, prompt {len(prompt)}"
        lps = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(ref_lps), atol=2e-4, rtol=0)
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    if async_scheduling:
        assert llm.engine.worker.runner.spec.device_ngram.num_overlapped_steps > 0


@pytest.mark.parametrize("arch", ["phi3", "gemma2"])
def test_fused_module_adapters_match_peft(arch, tiny_model_dir, tmp_path):
    """Phi-3's checkpoints keep qkv_proj / gate_up_proj whole, so its PEFT adapters target those fused modules (B
    rows [q; k; v], [gate; up]); they were refused as "not q/k/v/o and gate/up/down". alpha_pattern names the fused
    module. Gemma 2 (split modules) runs the same check."""
    model_dir = tiny_model_dir(arch)
    fused = arch == "phi3"
    specs = [(8, 16, ["qkv_proj", "gate_up_proj"] if fused else ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"],
              {"alpha_pattern": {"qkv_proj" if fused else "q_proj": 32}}),
             (4, 8, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] if fused else ALL7, {"use_rslora": True})]
    paths = [make_adapter(model_dir, str(tmp_path / f"f{i}"), r=r, alpha=alpha, targets=t, seed=i + 11, **extra)
             for i, (r, alpha, t, extra) in enumerate(specs)]
    llm = LLM(model=model_dir, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              num_gpu_blocks_override=96, max_num_batched_tokens=48, max_num_seqs=8)
    check_mixed_batch(llm, model_dir, paths, vocab=512, lengths=(5, 40, 9, 23, 3, 36))


def test_multimodal_gemma3_adapter_matches_peft(tmp_path):
    """A Gemma 3 multimodal checkpoint (served as its text model): PEFT names the adapter's modules as the checkpoint
    does (`model.language_model.layers.0...`) and, targets naming q_proj..., adapts the vision tower too. It was
    refused ("only q/k/v/o ... can be adapted"); the language model's modules are renamed as its weights are, the
    tower's skipped (no text-only prompt runs them), and an alpha_pattern naming a checkpoint module applies."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import Gemma3ForConditionalGeneration

    from tests.models.family_configs import save_tiny_gemma3_multimodal

    model_dir, adapter = str(tmp_path / "g3"), str(tmp_path / "g3-lora")
    save_tiny_gemma3_multimodal(model_dir)
    hf = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj", "gate_proj"],
                        alpha_pattern={"language_model.layers.1.self_attn.q_proj": 64}, lora_dropout=0.0)
    peft = get_peft_model(hf, config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    assert any("vision_tower" in name and "lora_A" in name for name, _ in peft.named_parameters())
    peft.save_pretrained(adapter)
    peft = PeftModel.from_pretrained(peft.unload(), adapter).eval()
    rng = random.Random(2)
    prompts = [[rng.randrange(2, 500) for _ in range(n)] for n in (12, 30)]

    def greedy(prompt: list[int], n: int = 8) -> list[int]:
        ids, out = list(prompt), []
        with torch.inference_mode():
            for _ in range(n):
                out.append(int(peft(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
                ids.append(out[-1])
        return out

    want = [greedy(p) for p in prompts]
    with peft.disable_adapter():
        base = [greedy(p) for p in prompts]
    assert want != base
    llm = LLM(model=model_dir, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8,
              num_gpu_blocks_override=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts * 2], SamplingParams(temperature=0.0, max_tokens=8,
                        ignore_eos=True), lora_request=[LoRARequest("g", 1, adapter)] * 2 + [None] * 2, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want + base


def test_decoder_stack_embedding_adapter_matches_peft(tiny_model_dir, tmp_path):
    """An embedding checkpoint saved as a bare decoder stack (e5-mistral's MistralModel) names its layers
    `layers.0...`, and so do PEFT adapters trained on it: they were refused ("only q/k/v/o ..."); they take the
    `model.` prefix its weights take. Adapter and base vectors equal PEFT's / the model's (AutoModel)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModel

    from pagedllm.pooling import PoolingParams
    from tests.engine.test_embeddings import _decoder_only_checkpoint

    model_dir = _decoder_only_checkpoint(tiny_model_dir("mistral"), str(tmp_path / "stack"), "MistralModel")
    adapter = str(tmp_path / "stack-lora")
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0,
                        alpha_pattern={"layers.1.mlp.down_proj": 48})
    peft = get_peft_model(AutoModel.from_pretrained(model_dir, dtype=torch.float32), config)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    peft.save_pretrained(adapter)
    peft = PeftModel.from_pretrained(peft.unload(), adapter).eval()
    prompts = [[5, 17, 99, 250, 3, 41], list(range(2, 40))]
    llm = LLM(model=model_dir, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8,
              num_gpu_blocks_override=32)
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts * 2], PoolingParams(normalize=False),
                     lora_request=[LoRARequest("e", 1, adapter)] * 2 + [None] * 2, use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(prompts * 2, outs)):
        with torch.inference_mode(), (peft.disable_adapter() if i >= 2 else contextlib.nullcontext()):
            want = peft(input_ids=torch.tensor([prompt])).last_hidden_state[0, -1]
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, atol=1e-4, rtol=1e-4)
