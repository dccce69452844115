"""Adapter validation (one-sentence refusals), LoRARequest, the offline API's errors, and the scheduler's rule
that running requests never use more adapters than there are device slots."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.lora.peft import LoRAError
from tests.lora.lora_helpers import make_adapter


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
               num_gpu_blocks_override=32)


@pytest.fixture(scope="module")
def good(tiny_llama_dir, tmp_path_factory):
    return make_adapter(tiny_llama_dir, str(tmp_path_factory.mktemp("good") / "a"), r=8, alpha=8,
                        targets=["q_proj", "down_proj"], seed=1)


def edited(src: str, dst, **config) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "adapter_config.json")
    with open(path) as f:
        data = json.load(f)
    data.update(config)
    with open(path, "w") as f:
        json.dump(data, f)
    return str(dst)


def add(llm: LLM, path: str, lora_id: int = 50):
    return llm.engine.add_lora(LoRARequest(f"a{lora_id}", lora_id, path))


def test_unsupported_adapters_are_refused_with_the_reason(llm, good, tiny_llama_dir, tiny_qwen3_dir, tiny_model_dir,
                                                          tmp_path):
    cases = [
        (make_adapter(tiny_llama_dir, str(tmp_path / "dora"), r=4, alpha=4, targets=["q_proj"], seed=2,
                      use_dora=True), "DoRA"),
        (make_adapter(tiny_llama_dir, str(tmp_path / "mts"), r=4, alpha=4, targets=["q_proj"], seed=3,
                      modules_to_save=["lm_head"]), "modules_to_save"),
        (make_adapter(tiny_llama_dir, str(tmp_path / "emb"), r=4, alpha=4, targets=["q_proj", "embed_tokens"],
                      seed=4), "embedding"),
        (make_adapter(tiny_llama_dir, str(tmp_path / "big"), r=32, alpha=4, targets=["q_proj"], seed=5),
         "max_lora_rank=16"),
        # Qwen3's q_proj maps 64 -> 128 features, the tiny Llama's 64 -> 64
        (make_adapter(tiny_qwen3_dir, str(tmp_path / "other"), r=4, alpha=4, targets=["q_proj"], seed=6),
         "another base model"),
        (edited(good, tmp_path / "bias", bias="all"), "bias"),
        # a deeper base model's adapter (same widths): layer 2 was refused as "only q/k/v/o ... can be adapted"
        (make_adapter(tiny_model_dir("llama", num_hidden_layers=3), str(tmp_path / "deep"), r=4, alpha=4,
                      targets=["q_proj"], seed=7), "has 2 decoder layers"),
        # aLoRA has plain A/B weights: it loaded and ran as a plain LoRA on every token
        (edited(good, tmp_path / "alora", alora_invocation_tokens=[5, 6]), "Activated LoRA"),
        (str(tmp_path / "missing"), "not a directory"),
    ]
    for path, words in cases:
        with pytest.raises(LoRAError, match=words) as info:
            add(llm, path)
        assert str(info.value).count(". ") == 0, info.value  # one sentence
    # new tokens: PEFT saves the resized embedding and LM head whole; the refusal named a "not a LoRA A/B" tensor
    from peft import LoraConfig, get_peft_model

    from tests.lora.lora_helpers import _hf_model

    peft_model = get_peft_model(_hf_model(tiny_llama_dir, "maker"), LoraConfig(r=2, target_modules=["q_proj"]))
    peft_model.save_pretrained(str(tmp_path / "vocab"), save_embedding_layers=True)
    peft_model.unload()
    with pytest.raises(LoRAError, match="saved embedding layers, as after adding new tokens") as info:
        add(llm, str(tmp_path / "vocab"))
    assert str(info.value).count(". ") == 0, info.value
    empty = tmp_path / "noweights"
    empty.mkdir()
    shutil.copy(os.path.join(good, "adapter_config.json"), empty)
    with pytest.raises(LoRAError, match="adapter_model.safetensors"):
        add(llm, str(empty))
    assert llm.engine.list_loras() == set()  # nothing refused was registered


def test_lora_request_and_generate_errors(llm, good, tiny_llama_dir):
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, good)
    with pytest.raises(ValueError, match="lora_path"):
        LoRARequest("x", 1)
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], lora_request=[LoRARequest("g", 1, good)], use_tqdm=False)
    with pytest.raises(ValueError, match="LoRARequest"):
        llm.generate("a", lora_request="g", use_tqdm=False)
    plain = LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=16, max_model_len=256)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate("a", SamplingParams(max_tokens=1), lora_request=LoRARequest("g", 1, good), use_tqdm=False)
    from vllm.lora.request import LoRARequest as VLLMLoRARequest  # the compat shim: the same class

    assert VLLMLoRARequest is LoRARequest


def test_lora_request_has_vllms_accessors(good):
    """vLLM's LoRARequest API: `adapter_id` / `name` / `path` read the fields, `lora_local_path` is the deprecated
    spelling of `lora_path`, and the id alone identifies an adapter."""
    req = LoRARequest("sql", 7, good)
    assert (req.adapter_id, req.name, req.path) == (7, "sql", good)
    assert LoRARequest("old", 8, lora_local_path=good).path == good
    assert req == LoRARequest("renamed", 7, "/elsewhere") and hash(req) == hash(LoRARequest("x", 7, "/y"))
    assert req != LoRARequest("sql", 8, good)


def test_bin_adapter_and_alpha_pattern(llm, good, tmp_path, tiny_llama_dir):
    """adapter_model.bin loads like safetensors; alpha_pattern changes one module's scaling."""
    import torch
    from safetensors.torch import load_file

    from pagedllm.lora.peft import load_adapter

    expected = llm.engine.worker.lora_manager.expected
    bin_dir = tmp_path / "bin"
    shutil.copytree(good, bin_dir)
    tensors = load_file(os.path.join(bin_dir, "adapter_model.safetensors"))
    os.remove(os.path.join(bin_dir, "adapter_model.safetensors"))
    torch.save(tensors, os.path.join(bin_dir, "adapter_model.bin"))
    a = load_adapter(1, "a", good, expected, 16)
    b = load_adapter(2, "b", str(bin_dir), expected, 16)
    assert a.weights.keys() == b.weights.keys() and all(
        torch.equal(a.weights[k][1], b.weights[k][1]) for k in a.weights)
    patterned = edited(good, tmp_path / "pat", alpha_pattern={"down_proj": 32})
    c = load_adapter(3, "c", patterned, expected, 16)
    down = "model.layers.0.mlp.down_proj"
    q = "model.layers.0.self_attn.q_proj"
    torch.testing.assert_close(c.weights[down][1], a.weights[down][1] * 4)
    torch.testing.assert_close(c.weights[q][1], a.weights[q][1])


def test_lora_alpha_missing_is_pefts_default(llm, tiny_llama_dir, tmp_path):
    """An adapter_config.json without lora_alpha scales as PEFT's LoraConfig default (lora_alpha=8), not as
    alpha = r: the engine's tokens and logprobs equal PEFT's on the same directory."""
    import torch

    from tests.lora.lora_helpers import peft_greedy

    made = make_adapter(tiny_llama_dir, str(tmp_path / "made"), r=16, alpha=16, targets=["q_proj", "v_proj"],
                        seed=7, std=0.1)
    bare = str(tmp_path / "bare")
    shutil.copytree(made, bare)
    path = os.path.join(bare, "adapter_config.json")
    with open(path) as f:
        config = json.load(f)
    del config["lora_alpha"]
    with open(path, "w") as f:
        json.dump(config, f)
    prompt = [5, 17, 33, 2, 41, 8, 60, 12]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)
    out = llm.generate({"prompt_token_ids": prompt}, params, lora_request=LoRARequest("bare", 60, bare),
                       use_tqdm=False)[0].outputs[0]
    ref_tokens, ref_lps = peft_greedy(tiny_llama_dir, bare, prompt, 4)
    assert out.token_ids == ref_tokens
    lps = [out.logprobs[i][t].logprob for i, t in enumerate(out.token_ids)]
    torch.testing.assert_close(torch.tensor(lps), torch.tensor(ref_lps), atol=2e-4, rtol=0)
    # (alpha = r, the old fallback, is what the adapter was made with: it answers otherwise)
    assert peft_greedy(tiny_llama_dir, made, prompt, 4)[1] != pytest.approx(ref_lps, abs=1e-3)
    from peft import LoraConfig

    from pagedllm.lora.peft import PEFT_DEFAULT_LORA_ALPHA

    assert PEFT_DEFAULT_LORA_ALPHA == LoraConfig.__dataclass_fields__["lora_alpha"].default


def _req(rid: str, lora_id):
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=4), lora_id=lora_id)


def test_scheduler_holds_back_requests_beyond_max_loras():
    s = Scheduler(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, block_size=4, num_blocks=64,
                  max_loras=2)
    for rid, lora in [("a", 1), ("b", 2), ("c", 3), ("d", None), ("e", 1), ("f", 3)]:
        s.add_request(_req(rid, lora))
    plan = s.schedule()
    # c and f (adapter 3, a third one) wait; base and adapters 1/2 go ahead of them; order is kept
    assert list(plan.num_scheduled_tokens) == ["a", "b", "d", "e"]
    assert [r.request_id for r in s.waiting] == ["c", "f"]
    assert s.stats().running_lora_ids == (1, 2) and s.stats().waiting_lora_ids == (3,)
    s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    plan = s.schedule()
    assert [n.request_id for n in plan.new_requests] == ["c", "f"]  # adapter 2's slot is free now
    assert {r.lora_id for r in s.running} == {1, 3, None}


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "phi3"])
def test_norms_point_at_the_layer_their_output_feeds(arch, tiny_model_dir):
    """The norm whose output is a wrapped layer's only input gets it as `shrink_consumer` (few-row CUDA steps compute
    that layer's LoRA shrink in the norm kernel); other norms get none, and the link is no submodule."""
    from pagedllm.lora.layers import LoRALinear

    llm = LLM(model=tiny_model_dir(arch), dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8,
              num_gpu_blocks_override=16, max_model_len=256)
    try:
        layers = llm.engine.worker.model.model.layers
        mlp_norm = "pre_feedforward_layernorm" if arch == "gemma2" else "post_attention_layernorm"
        for layer in layers:
            qkv, gate_up = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
            assert isinstance(qkv, LoRALinear) and isinstance(gate_up, LoRALinear)
            assert layer.input_layernorm.shrink_consumer is qkv
            assert getattr(layer, mlp_norm).shrink_consumer is gate_up
            if arch == "gemma2":  # its post-attention norm feeds the residual stream, not a projection
                assert layer.post_attention_layernorm.shrink_consumer is None
                assert layer.post_feedforward_layernorm.shrink_consumer is None
            for norm in (layer.input_layernorm, getattr(layer, mlp_norm)):
                assert not list(norm.children())
            # the decode attention may compute o_proj's shrink of its output (lora.layers.FOLD_O_SHRINK)
            attn = layer.self_attn
            assert attn.attn.shrink_consumer is attn.o_proj and not list(attn.attn.children())
        assert llm.engine.worker.model.model.norm.shrink_consumer is None
    finally:
        llm.shutdown()


def test_beam_search_runs_each_prompts_adapter(llm, tiny_llama_dir, tmp_path):
    """vLLM's LLM.beam_search takes lora_request (one, or one per prompt); it was refused as not supported. A
    one-beam search is greedy decoding: with an adapter its tokens are generate()'s with that adapter, not the
    base model's."""
    from pagedllm import BeamSearchParams

    strong = make_adapter(tiny_llama_dir, str(tmp_path / "strong"), r=8, alpha=64, targets=["q_proj", "down_proj"],
                          seed=0)
    lora = LoRARequest("strong", 31, strong)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 10]}]
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6)
    with_lora = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, lora_request=lora, use_tqdm=False)]
    base = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert with_lora != base  # (else the test could not tell the adapter was used)
    beam = BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True)
    outs = llm.beam_search(prompts, beam, lora_request=lora)
    assert [o.sequences[0].tokens[len(p["prompt_token_ids"]):] for o, p in zip(outs, prompts)] == with_lora
    mixed = llm.beam_search(prompts, beam, lora_request=[lora, None], concurrency_limit=1)
    assert [o.sequences[0].tokens[len(p["prompt_token_ids"]):] for o, p in zip(mixed, prompts)] == [with_lora[0],
                                                                                                     base[1]]
    with pytest.raises(ValueError, match="one per prompt"):
        llm.beam_search(prompts, beam, lora_request=[lora])


def test_adapter_path_under_home(llm, good, tmp_path, monkeypatch):
    """vLLM expands a lora_path starting with "~" (get_adapter_absolute_path); it was "not a directory"."""
    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(good, str(tmp_path / "loras" / "good"))
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = llm.generate(prompt, sp, lora_request=LoRARequest("good", 78, good), use_tqdm=False)[0].outputs[0].token_ids
    out = llm.generate(prompt, sp, lora_request=LoRARequest("home", 77, "~/loras/good"), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want


def test_one_id_with_two_paths_in_one_call_is_refused(llm, good, tmp_path, tiny_llama_dir):
    """[LoRARequest("x", 5, A), LoRARequest("y", 5, B)]: the id names one adapter, and B silently replaced A for
    both prompts (the first got B's tokens). Refused now, naming the id, before anything runs."""
    other = make_adapter(tiny_llama_dir, str(tmp_path / "other"), r=4, alpha=8, targets=["v_proj"], seed=7)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 10, 11]}]
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with pytest.raises(ValueError, match="lora_int_id 65 is given two adapters in one call"):
        llm.generate(prompts, sp, lora_request=[LoRARequest("x", 65, good), LoRARequest("y", 65, other)],
                     use_tqdm=False)
    assert not llm.engine.scheduler.requests
    want = llm.generate(prompts[0], sp, lora_request=LoRARequest("x", 66, good), use_tqdm=False)[0]
    # the same adapter (id and path) twice is fine
    outs = llm.generate(prompts, sp, lora_request=[LoRARequest("x", 66, good)] * 2, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == want.outputs[0].token_ids


def test_fused_module_adapter_refusals(tiny_model_dir, tmp_path):
    """A Phi-3 adapter of the fused qkv_proj is split when read; a broken one is refused naming the module."""
    from safetensors.torch import load_file, save_file

    model_dir = tiny_model_dir("phi3_plain")
    src = make_adapter(model_dir, str(tmp_path / "src"), r=4, alpha=8, targets=["qkv_proj"], seed=3)
    phi = LLM(model=model_dir, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8,
              num_gpu_blocks_override=16, max_model_len=256)
    key = "base_model.model.model.layers.0.self_attn.qkv_proj.lora_"
    edits = {
        "both": (lambda t: t.update({key.replace("qkv", "q") + "A.weight": t[key + "A.weight"],
                                     key.replace("qkv", "q") + "B.weight": t[key + "B.weight"][:64]}),
                 "adapts both 'model.layers.0.self_attn.qkv_proj' and 'model.layers.0.self_attn.q_proj'"),
        "shape": (lambda t: t.update({key + "B.weight": t[key + "B.weight"][:100]}),
                  r"lora_B \(100, 4\) but the base model's maps to 128 features"),
        "no_b": (lambda t: t.pop(key + "B.weight"), "'model.layers.0.self_attn.qkv_proj' lacks its lora_B weight"),
    }
    for i, (name, (edit, words)) in enumerate(edits.items()):
        dst = shutil.copytree(src, str(tmp_path / name))
        tensors = {k: v.clone() for k, v in load_file(os.path.join(dst, "adapter_model.safetensors")).items()}
        edit(tensors)
        save_file({k: v.clone() for k, v in tensors.items()}, os.path.join(dst, "adapter_model.safetensors"))
        with pytest.raises(LoRAError, match=words):
            add(phi, dst, 60 + i)
    assert add(phi, src, 70)


def test_lora_request_takes_vllms_fields_in_vllms_order(good):
    """vLLM's LoRARequest(lora_name, lora_int_id, lora_path, lora_local_path, long_lora_max_len, base_model_name,
    tensorizer_config_dict, load_inplace): tensorizer_config_dict was missing (a TypeError by keyword; by position the
    8th argument, load_inplace, landed in its place). None is taken; a dict is refused naming it."""
    req = LoRARequest("sql", 7, good, None, None, "base", None, True)
    assert req.base_model_name == "base" and req.load_inplace is True and req.tensorizer_config_dict is None
    assert LoRARequest("sql", 7, good, tensorizer_config_dict=None).load_inplace is False
    with pytest.raises(ValueError, match="tensorizer_config_dict"):
        LoRARequest("sql", 7, good, tensorizer_config_dict={"tensorizer_dir": "/t"})


def test_adapter_removed_while_in_use_and_added_again_stays_loaded(llm, good):
    """remove_lora while a request uses the adapter defers the removal; adding the same adapter (id and path) again
    calls the removal off: it stays loaded after its requests finish and takes new ones (it was refused, "in use
    by running requests and cannot be given another path", though the path was the same)."""
    from pagedllm.core.engine_core import EngineCoreRequest

    core = llm.engine
    lora = LoRARequest("again", 61, good)
    assert core.add_lora(lora)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    core.add_request(EngineCoreRequest("uses-61", [5, 6, 7, 8], sp, lora_id=61))
    core.step()
    assert core.remove_lora(61) and 61 not in core.list_loras()
    assert core.add_lora(lora) and 61 in core.list_loras()
    while core.has_unfinished_requests():
        core.step()
    core.step()  # (a step collects the adapters whose removal waits for their requests)
    assert 61 in core.list_loras()
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], sp, lora_request=lora, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 6
    assert core.remove_lora(61) and 61 not in core.list_loras()
