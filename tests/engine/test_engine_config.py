"""Engine start-up choices: dtype, KV pool sizing and its errors, config-only dummy models, clear errors."""
from __future__ import annotations

import json
import os

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs
from pagedllm.worker.worker import default_batched_tokens, read_eos_token_ids, resolve_dtype


class _Cfg:
    def __init__(self, dtype):
        self.torch_dtype = dtype


def test_auto_dtype_rules():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", _Cfg("bfloat16"), cpu) == torch.float32
    assert resolve_dtype("auto", _Cfg("float32"), cuda) == torch.bfloat16
    assert resolve_dtype("auto", _Cfg("bfloat16"), cuda) == torch.bfloat16
    assert resolve_dtype("auto", _Cfg("float16"), cuda) == torch.float16
    assert resolve_dtype("half", _Cfg(None), cuda) == torch.float16


def test_default_step_token_budget(monkeypatch, tiny_llama_dir):
    """2048 tokens per step on CPU, 8192 on GPUs under 70 GiB, 16384 on larger GPUs; an explicit value wins."""
    assert default_batched_tokens(torch.device("cpu")) == 2048
    for gib, expected in [(141, 16384), (80, 16384), (24, 8192)]:
        props = type("Props", (), {"total_memory": gib * 1024 ** 3})()
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index, props=props: props)
        assert default_batched_tokens(torch.device("cuda", 0)) == expected, gib
    monkeypatch.undo()
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256)
    assert llm.engine.worker.max_num_batched_tokens == 2048
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, max_num_batched_tokens=1000)
    assert llm.engine.worker.max_num_batched_tokens == 1000


def test_config_only_dir_with_dummy_weights_and_no_tokenizer(tmp_path, tiny_model_dir):
    src = tiny_model_dir("qwen3")
    only = tmp_path / "shape-only"
    only.mkdir()
    with open(os.path.join(src, "config.json")) as f:
        (only / "config.json").write_text(f.read())
    llm = LLM(model=str(only), load_format="dummy", skip_tokenizer_init=True, num_gpu_blocks_override=16,
              max_model_len=256)
    out = llm.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.text == ""
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate("text needs a tokenizer", use_tqdm=False)


def test_kv_budget_too_small_for_one_sequence_is_a_clear_error(tiny_llama_dir):
    with pytest.raises(ValueError, match="less than one sequence of max_model_len=512"):
        LLM(model=tiny_llama_dir, kv_cache_memory_bytes=4096)


def test_log_says_how_many_tokens_of_kv_fit(tiny_llama_dir, caplog):
    caplog.set_level("INFO", logger="pagedllm")
    LLM(model=tiny_llama_dir, kv_cache_memory_bytes=1 << 20)
    line = next(r.getMessage() for r in caplog.records if "tokens of KV cache" in r.getMessage())
    # 2 layers x 2 (K, V) x 2 kv heads x 16 head size x 4 bytes = 512 bytes per token -> 2048 tokens in 1 MiB
    assert "128 KV blocks of 16 tokens = 2048 tokens of KV cache" in line


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_model_len=100000), "larger than the model's maximum"),
    (dict(max_num_batched_tokens=4, max_num_seqs=8), "must be >= max_num_seqs"),
    (dict(quantization="gptq"), "needs a gptq-quantized checkpoint"),
    (dict(quantization="no-such-method"), "Unknown quantization method"),
    (dict(kv_cache_dtype="int4"), "kv_cache_dtype must be one of"),
    (dict(tensor_parallel_size=3), "does not divide the model's 4 attention heads"),
    (dict(block_size=7), "block_size must be one of"),
    (dict(tokenizer="/no/such/tokenizer"), "Could not load a tokenizer: the path '/no/such/tokenizer' does not exist"),
    (dict(tokenizer="./no/such/tokenizer"), "the path './no/such/tokenizer' does not exist"),
])
def test_bad_engine_arguments(tiny_llama_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(model=tiny_llama_dir, **kwargs)


def test_tokenizer_path_that_is_a_plain_file(tiny_llama_dir):
    """--tokenizer naming config.json (not the directory) says so, not "Repo id must be in the form ..."."""
    with pytest.raises(ValueError, match="is a file but not a .gguf file"):
        LLM(model=tiny_llama_dir, tokenizer=os.path.join(tiny_llama_dir, "config.json"))


def test_missing_model_path_is_one_sentence():
    with pytest.raises((FileNotFoundError, ValueError)) as info:
        LLM(model="/no/such/model/dir")
    assert "/no/such/model/dir" in str(info.value) and "\n" not in str(info.value)


def test_unknown_engine_argument():
    with pytest.raises(TypeError, match="Unknown engine argument"):
        EngineArgs.from_kwargs(model=None, not_a_flag=1)


def test_eos_ids_include_generation_config(tmp_path):
    class C:
        eos_token_id = 2
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert read_eos_token_ids(C(), str(tmp_path)) == [2, 7]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 4}))
    assert read_eos_token_ids(C(), str(tmp_path)) == [2, 4]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [-1, 9, 9, True]}))
    assert read_eos_token_ids(C(), str(tmp_path)) == [2, 9]  # -1 ("none") and booleans are no token ids
    (tmp_path / "generation_config.json").write_text("{not json")
    assert read_eos_token_ids(C(), str(tmp_path)) == [2]  # a broken file is ignored

    class NoEos:
        eos_token_id = None
    assert read_eos_token_ids(NoEos(), str(tmp_path / "missing")) == []


def test_the_tokenizers_eos_stops_generation(tmp_path, tiny_llama_dir):
    """A fine-tune whose tokenizer's EOS is not config.json's (ChatML's <|im_end|> over </s>): vLLM's requests stop
    at the tokenizer's EOS (finish "stop", no stop_reason), config's stays a stop id. pagedllm read only config.json
    and generation_config.json and generated past it."""
    import shutil

    from transformers import AutoTokenizer

    from tests.engine.test_correctness import hf_greedy, random_prompts
    model_dir = str(tmp_path / "model")
    shutil.copytree(tiny_llama_dir, model_dir)
    prompt = random_prompts([9], seed=3)[0]
    ref = hf_greedy(model_dir, prompt, 10)[0]
    k = next(i for i in range(2, 10) if ref[i] not in ref[:i] and ref[i] != 1)  # a first occurrence, not config's
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(ref[k])
    tokenizer.save_pretrained(model_dir)
    assert AutoTokenizer.from_pretrained(model_dir).eos_token_id == ref[k]
    llm = LLM(model=model_dir, dtype="float32", num_gpu_blocks_override=16, max_model_len=64)
    assert llm.engine.eos_token_ids == [ref[k], 1]
    greedy = dict(temperature=0.0, max_tokens=10)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (ref[:k + 1], "stop", None)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(**greedy, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref and out.finish_reason == "length"


def test_invalid_prompts_fail_before_anything_is_queued(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks_override=16, max_model_len=256)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": []}], use_tqdm=False)
    with pytest.raises(ValueError, match=r"\[0, 512\)"):
        llm.generate([{"prompt_token_ids": [600]}], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
