"""Engine flags do what they say or are refused with their message: --generation-config, --trust-remote-code,
--no-enable-chunked-prefill, --max-logprobs, --cpu-offload-gb, and --max-num-seqs / --max-model-len edge values.
Outputs are compared with transformers on the same weights."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.engine.test_correctness import hf_greedy, random_prompts


def _with_generation_config(src: str, dst, **values) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "generation_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(values)
    with open(path, "w") as f:
        json.dump(cfg, f)
    return str(dst)


def test_generation_config_defaults_apply_only_when_silent(tiny_llama_dir, tmp_path, caplog):
    model = _with_generation_config(tiny_llama_dir, tmp_path / "m", temperature=0.0, max_new_tokens=4)
    other = _with_generation_config(tiny_llama_dir, tmp_path / "other", temperature=0.0, max_new_tokens=3)
    prompt = {"prompt_token_ids": random_prompts([6], seed=51)[0]}
    ref = hf_greedy(tiny_llama_dir, prompt["prompt_token_ids"], 4)[0]
    with caplog.at_level("INFO", logger="pagedllm"):
        llm = LLM(model=model, dtype="float32", num_gpu_blocks_override=32)
    assert "{'temperature': 0.0, 'max_tokens': 4}" in caplog.text  # logged at start
    silent = llm.generate(prompt, use_tqdm=False)[0].outputs[0]
    assert silent.token_ids == ref  # greedy and 4 tokens: both from the file
    own = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0].outputs[0]
    assert own.token_ids == ref[:2]  # the request's own values win
    assert llm.get_default_sampling_params().max_tokens == 4
    plain = LLM(model=model, dtype="float32", num_gpu_blocks_override=32, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
    from_dir = LLM(model=model, dtype="float32", num_gpu_blocks_override=32, generation_config=other)
    assert from_dir.generate(prompt, use_tqdm=False)[0].outputs[0].token_ids == ref[:3]
    with pytest.raises(ValueError, match="no generation_config.json there"):
        LLM(model=model, generation_config=str(tmp_path))


def test_override_generation_config(tiny_llama_dir, tmp_path, caplog):
    """vLLM's override_generation_config: its keys over the file's (null drops one), over none with "vllm"; keys this
    engine does not read, and non-numbers, are refused at start."""
    model = _with_generation_config(tiny_llama_dir, tmp_path / "m", temperature=0.0, max_new_tokens=4, top_k=7)
    with caplog.at_level("INFO", logger="pagedllm"):
        llm = LLM(model=model, dtype="float32", num_gpu_blocks_override=32,
                  override_generation_config={"max_new_tokens": 2, "top_k": None, "min_p": 0.1})
    assert "--override-generation-config" in caplog.text
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens, defaults.top_k, defaults.min_p) == (0.0, 2, 0, 0.1)
    prompt = {"prompt_token_ids": random_prompts([6], seed=52)[0]}
    assert llm.generate(prompt, use_tqdm=False)[0].outputs[0].token_ids == \
        hf_greedy(tiny_llama_dir, prompt["prompt_token_ids"], 2)[0]
    only = LLM(model=model, dtype="float32", num_gpu_blocks_override=32, generation_config="vllm",
               override_generation_config={"temperature": 0.25})
    assert only.get_default_sampling_params() == SamplingParams(temperature=0.25)
    for bad, message in [({"do_sample": True}, "\\['do_sample'\\] is not supported"),
                         ({"temperature": "hot"}, "temperature must be a number"),
                         # refused at start, not by every request that leaves the field out
                         ({"max_new_tokens": -3}, "max_new_tokens: max_tokens must be an integer >= 1"),
                         ({"top_k": 0.5}, "top_k: top_k must be an integer")]:
        with pytest.raises(ValueError, match=message):
            LLM(model=model, dtype="float32", num_gpu_blocks_override=32, override_generation_config=bad)


def test_server_mapping_uses_defaults_only_for_missing_fields():
    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
    from pagedllm.entrypoints.openai.request_params import build_sampling_params

    defaults = {"temperature": 0.3, "top_p": 0.8, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
                "max_tokens": 7}
    silent = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    p = build_sampling_params(silent, None, None, defaults=defaults)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == \
        (0.3, 0.8, 20, 0.05, 1.1, 7)
    explicit = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], temperature=1.0, top_p=1.0,
                                     top_k=-1, min_p=0.0, repetition_penalty=1.0)
    p = build_sampling_params(explicit, 5, None, defaults=defaults)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == \
        (1.0, 1.0, 0, 0.0, 1.0, 5)
    assert build_sampling_params(silent, None, None, defaults={}, default_max_tokens=16).max_tokens == 16


def _remote_code_model(tiny_llama_dir: str, dst) -> str:
    """The tiny llama whose config class lives in the model's own code (auto_map), as custom models ship."""
    shutil.copytree(tiny_llama_dir, dst)
    with open(os.path.join(dst, "configuration_remote_llama.py"), "w") as f:
        f.write("from transformers import LlamaConfig\n\n\nclass RemoteLlamaConfig(LlamaConfig):\n"
                "    model_type = 'pagedllm_remote_llama'\n")
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["model_type"] = "pagedllm_remote_llama"
    cfg["auto_map"] = {"AutoConfig": "configuration_remote_llama.RemoteLlamaConfig"}
    with open(path, "w") as f:
        json.dump(cfg, f)
    return str(dst)


def test_trust_remote_code_loads_the_models_own_config(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    model = _remote_code_model(tiny_llama_dir, tmp_path / "remote")
    with pytest.raises(ValueError, match="pass --trust-remote-code"):
        LLM(model=model, dtype="float32", num_gpu_blocks_override=32)
    llm = LLM(model=model, dtype="float32", num_gpu_blocks_override=32, trust_remote_code=True)
    assert type(llm.engine.worker.hf_config).__name__ == "RemoteLlamaConfig"
    prompt = random_prompts([5], seed=52)[0]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == hf_greedy(tiny_llama_dir, prompt, 5)[0]


def _record_plans(llm) -> list:
    plans, real = [], llm.engine.scheduler.schedule

    def schedule():
        plan = real()
        plans.append(plan)
        return plan

    llm.engine.scheduler.schedule = schedule
    return plans


def test_no_chunked_prefill_runs_each_prompt_whole(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(64\) is smaller than max_model_len \(128\)"):
        LLM(model=tiny_llama_dir, max_model_len=128, max_num_batched_tokens=64, max_num_seqs=4,
            enable_chunked_prefill=False)
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=128, max_num_batched_tokens=128, max_num_seqs=4,
              enable_chunked_prefill=False, num_gpu_blocks_override=64)
    plans = _record_plans(llm)
    prompts = random_prompts([100, 90, 7], seed=53)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(tiny_llama_dir, p, 5)[0]
    for plan in plans:
        for new in plan.new_requests:  # every admitted prompt is computed in the step that admits it
            assert plan.num_scheduled_tokens[new.request_id] == len(new.token_ids) - new.num_computed_tokens
    # with chunking (the default) the same budget splits the second prompt
    chunked = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=128, max_num_batched_tokens=128,
                  max_num_seqs=4, num_gpu_blocks_override=64)
    plans = _record_plans(chunked)
    chunked.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert any(plan.num_scheduled_tokens.get(n.request_id) != len(n.token_ids) for plan in plans
               for n in plan.new_requests)


def test_max_logprobs(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=16, max_model_len=256, max_logprobs=2)
    with pytest.raises(ValueError, match="logprobs=3 is more than this server allows"):
        llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(logprobs=3), use_tqdm=False)
    out = llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(logprobs=2, max_tokens=2), use_tqdm=False)
    assert all(len(d) >= 2 for d in out[0].outputs[0].logprobs)
    wide = LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=16, max_model_len=256, max_logprobs=-1)
    out = wide.generate({"prompt_token_ids": [5, 6]}, SamplingParams(logprobs=50, max_tokens=1), use_tqdm=False)
    assert len(out[0].outputs[0].logprobs[0]) >= 50
    with pytest.raises(ValueError, match="max_logprobs must be >= 0"):
        LLM(model=tiny_llama_dir, max_logprobs=-2)


def test_max_num_seqs_one_and_max_model_len_edges(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_num_seqs=1, max_model_len=16, num_gpu_blocks_override=16)
    plans = _record_plans(llm)
    prompts = random_prompts([3, 10, 5], seed=54)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)
    assert max(len(plan.num_scheduled_tokens) for plan in plans) == 1  # one sequence at a time
    for p, o in zip(prompts, outs):  # max_tokens=None: up to max_model_len exactly, then "length"
        assert o.outputs[0].token_ids == hf_greedy(tiny_llama_dir, p, 16 - len(p))[0]
        assert o.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="maximum context length is 16"):
        llm.generate({"prompt_token_ids": list(range(2, 18))}, use_tqdm=False)
    for kwargs, message in [(dict(max_num_seqs=0), "max_num_seqs must be >= 1"),
                            (dict(max_model_len=0), "max_model_len must be >= 1"),
                            (dict(max_model_len=513), "larger than the model's maximum"),
                            (dict(max_num_seqs=64, max_num_batched_tokens=32), "must be >= max_num_seqs")]:
        with pytest.raises(ValueError, match=message):
            LLM(model=tiny_llama_dir, **kwargs)
    LLM(model=tiny_llama_dir, max_model_len=512, num_gpu_blocks_override=64)  # the model's own maximum is fine


@pytest.mark.parametrize("arch,rope,context", [
    ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, 256),
    ("llama", {"rope_type": "linear", "factor": 2.0}, 128),
    ("llama", {"rope_type": "dynamic", "factor": 2.0}, 128),
    ("llama", {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}, 64)])
def test_rope_scaled_context_is_the_models(tiny_model_dir, arch, rope, context):
    """The context of a rope-scaled model is vLLM's: max_position_embeddings (64 here) times a linear, dynamic or
    yarn factor (yarn: its original context's), not the bare max_position_embeddings, which refused Qwen2.5's
    documented yarn x4 context without VLLM_ALLOW_LONG_MAX_MODEL_LEN; llama3 counts in it already. A yarn prompt
    past max_position_embeddings gets transformers' tokens."""
    model_dir = tiny_model_dir(arch, rope_scaling=rope, max_position_embeddings=64)
    llm = LLM(model=model_dir, dtype="float32", num_gpu_blocks_override=40)
    assert llm.engine.worker.max_model_len == context
    with pytest.raises(ValueError, match="larger than the model's maximum"):
        LLM(model=model_dir, max_model_len=context + 1)
    if rope["rope_type"] == "yarn":
        prompt = random_prompts([100], seed=8)[0]
        out = llm.generate({"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert out[0].outputs[0].token_ids == hf_greedy(model_dir, prompt, 8)[0]


def test_long_max_model_len_allowed_by_vllm_variable(tiny_llama_dir, monkeypatch, caplog):
    """VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 lets max_model_len pass max_position_embeddings (512), as in vLLM: a warning,
    and positions past 512 rotate as transformers rotates them (the rope cache grows to the engine's context)."""
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    llm = LLM(model=tiny_llama_dir, dtype="float32", max_model_len=544, num_gpu_blocks_override=40)
    assert "larger than the model's maximum (512 positions), allowed" in caplog.text
    prompt = random_prompts([505], seed=7)[0]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(tiny_llama_dir, prompt, 20)[0]


def test_cpu_offload_is_refused_on_the_cpu(tiny_llama_dir):
    for device in ("cpu", "auto"):
        if device == "auto" and torch.cuda.is_available():
            continue
        with pytest.raises(ValueError, match="meaningless on the CPU"):
            LLM(model=tiny_llama_dir, cpu_offload_gb=1, device=device)
    with pytest.raises(ValueError, match="cpu_offload_gb must be >= 0"):
        LLM(model=tiny_llama_dir, cpu_offload_gb=-1)


def test_hf_overrides_and_long_prefill_threshold(tiny_llama_dir):
    """vLLM's hf_overrides (config fields over config.json's: the context length follows, a Matryoshka flag reaches
    embeddings) and long_prefill_token_threshold (prefill chunks of at most N tokens a step: the same tokens)."""
    from pagedllm.pooling import PoolingParams

    llm = LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=64, block_size=8,
              hf_overrides={"max_position_embeddings": 96, "is_matryoshka": True}, long_prefill_token_threshold=8)
    assert llm.engine.max_model_len == 96 and llm.engine.scheduler.long_prefill_token_threshold == 8
    prompts = random_prompts([37, 5, 20], seed=53)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(tiny_llama_dir, p, 6)[0]
    (short,) = llm.embed([prompts[1]], PoolingParams(dimensions=8), use_tqdm=False)
    assert len(short.outputs.embedding) == 8
    off = LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=32, long_prefill_token_threshold=0)
    assert off.engine.scheduler.long_prefill_token_threshold is None
    with pytest.raises(ValueError, match="hf_overrides must be a JSON object"):
        LLM(model=tiny_llama_dir, hf_overrides=["max_position_embeddings"])
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 1"):
        LLM(model=tiny_llama_dir, long_prefill_token_threshold=-2)
