"""GGUF -> HF conversion: the real SmolLM2 GGUF against transformers' own GGUF loading, tiny GGUFs
(tests/models/gguf_writer.py: llama with llama.cpp's Q/K permutation and llama3 rope_freqs, qwen2 with biases +
tied embeddings, qwen3 with q/k norms) round-tripped against the HF originals, the cache, and corrupt files."""
from __future__ import annotations

import json
import math
import os
import re

import numpy as np
import pytest
import torch

from pagedllm.models.llama import get_head_dim
from pagedllm.models.loader import get_model, load_hf_config, prepare_model_dir
from tests.models.gguf_writer import write_tiny_gguf


def _ours(model_dir):
    return get_model(load_hf_config(model_dir), model_dir, dtype=torch.float32, device="cpu")


def _logits(model, ids):
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(ids.shape[0])))


# ------------------------------------------------------------------------------------ the real SmolLM2 GGUF

def test_smollm2_matches_transformers_gguf_loading(smollm2_gguf_path, smollm2_hf_dir):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    ours_config = load_hf_config(smollm2_hf_dir)
    with torch.device("meta"):  # only tells transformers the target parameter names
        skeleton = LlamaForCausalLM(ours_config)
    parsed = load_gguf_checkpoint(smollm2_gguf_path, return_tensors=True, model_to_load=skeleton)
    hf_meta, hf_tensors = parsed["config"], parsed["tensors"]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "head_dim", "tie_word_embeddings",
                "bos_token_id", "eos_token_id"):
        assert getattr(ours_config, key) == hf_meta[key], key
    assert math.isclose(ours_config.rms_norm_eps, hf_meta["rms_norm_eps"], rel_tol=1e-6)
    assert ours_config.rope_parameters["rope_theta"] == hf_meta["rope_theta"]
    hf_config = LlamaConfig(**hf_meta)
    ours_tensors = load_file(os.path.join(smollm2_hf_dir, "model.safetensors"))
    assert set(ours_tensors) == set(hf_tensors)
    for name, tensor in hf_tensors.items():
        assert torch.equal(ours_tensors[name], tensor.float()), name

    hf = LlamaForCausalLM(hf_config).float().eval()
    missing, unexpected = hf.load_state_dict({k: v.float() for k, v in hf_tensors.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_hf_dir)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = torch.tensor(ids)
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0].float()
    ours = _logits(_ours(smollm2_hf_dir), ids)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_smollm2_converted_dir_contents(smollm2_hf_dir):
    files = set(os.listdir(smollm2_hf_dir))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= files
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(smollm2_hf_dir)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.eos_token == "<|im_end|>"
    with open(os.path.join(smollm2_hf_dir, "generation_config.json")) as f:
        generation = json.load(f)
    assert generation["eos_token_id"] == 2
    # The bundled model's GGUF carries no sampling values: the conversion writes its authors' recommendation.
    assert (generation["temperature"], generation["top_p"], generation["do_sample"]) == (0.2, 0.9, True)


def test_second_prepare_is_a_cache_hit(smollm2_gguf_path, smollm2_hf_dir, smollm2_cache_dir, monkeypatch):
    import pagedllm.models.gguf as gguf_module

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", smollm2_cache_dir)
    weights = os.path.join(smollm2_hf_dir, "model.safetensors")
    written = os.stat(weights).st_mtime_ns

    def no_conversion(path):
        raise AssertionError(f"a cache hit opened {path} to convert it again")

    monkeypatch.setattr(gguf_module, "open_gguf", no_conversion)  # a hit is a directory lookup, no GGUF read
    assert prepare_model_dir(smollm2_gguf_path) == smollm2_hf_dir
    assert os.stat(weights).st_mtime_ns == written
    parent = os.path.dirname(smollm2_hf_dir)
    assert not [name for name in os.listdir(parent) if ".tmp-" in name]  # no half-written conversions


# ------------------------------------------------------------------------------------------- corrupt files

def test_corrupt_gguf(tmp_path, fresh_cache):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"definitely not a gguf file" * 10)
    with pytest.raises(ValueError, match=r"^Could not read .*bad\.gguf as a GGUF file \(is it corrupt or "
                                         r"truncated\?\)"):
        prepare_model_dir(str(bad))
    assert not fresh_cache.exists() or not any(fresh_cache.rglob("*.safetensors"))


def test_truncated_gguf(tmp_path, fresh_cache, smollm2_gguf_path):
    truncated = tmp_path / "truncated.gguf"
    with open(smollm2_gguf_path, "rb") as f:
        truncated.write_bytes(f.read(4 << 20))
    with pytest.raises(ValueError, match="as a GGUF file"):
        prepare_model_dir(str(truncated))
    assert not any(fresh_cache.rglob("*.safetensors"))


# ---------------------------------------------------------------------------- tiny GGUFs written from HF dirs
# (by tests/models/gguf_writer.py)

@pytest.mark.parametrize("identity, expected", [
    ({"organization": "HuggingFaceTB", "basename": "SmolLM2", "name": "SmolLM2 135M Instruct", "finetune": "Instruct"},
     {"temperature": 0.2, "top_p": 0.9}),
    ({"organization": "huggingfacetb", "basename": "smollm2", "finetune": "8k-lc100k-mix1-ep2"},  # the bundled file's
     {"temperature": 0.2, "top_p": 0.9}),
    ({"organization": "HuggingFaceTB", "basename": "SmolLM2", "name": "SmolLM2 135M"}, {}),  # the base model
    ({"organization": "acme", "basename": "SmolLM2", "finetune": "Instruct"}, {}),
    ({}, {}),
])
def test_recommended_sampling_follows_the_gguf_identity(tmp_path, fresh_cache, tiny_model_dir, identity, expected):
    """Keyed on the model's identity as the GGUF states it, never on the file's name (all named alike here)."""
    from pagedllm.generation_config import SOURCE_KEY, load_sampling_defaults
    gguf_path = str(tmp_path / "SmolLM2-135M-Instruct.gguf")
    write_tiny_gguf(tiny_model_dir("llama"), gguf_path, "llama", identity=identity)
    converted = prepare_model_dir(gguf_path)
    assert load_sampling_defaults("auto", converted) == expected
    with open(os.path.join(converted, "generation_config.json")) as f:
        assert (SOURCE_KEY in json.load(f)) == bool(expected)
    assert load_sampling_defaults("vllm", converted) == {}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_round_trip(tmp_path, fresh_cache, tiny_model_dir, arch):
    from transformers import AutoModelForCausalLM
    hf_dir = tiny_model_dir(arch)
    gguf_path = str(tmp_path / f"tiny-{arch}.gguf")
    write_tiny_gguf(hf_dir, gguf_path, arch)
    converted = prepare_model_dir(gguf_path)
    assert converted.startswith(str(fresh_cache))
    source = load_hf_config(hf_dir)
    config = load_hf_config(converted)
    assert config.architectures == source.architectures
    assert config.tie_word_embeddings == source.tie_word_embeddings
    assert get_head_dim(config) == get_head_dim(source)
    if arch == "llama":  # rope_freqs.weight -> the exact HF llama3 parameters
        expected = {k: v for k, v in source.rope_parameters.items()}
        assert {k: config.rope_parameters[k] for k in expected} == expected
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0]
    torch.testing.assert_close(_logits(_ours(converted), ids), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("original,stated,extra", [(32, True, {}), (512, False, {}),
                                                   (32, True, {"attention_factor": 0.8, "beta_fast": 16.0,
                                                               "beta_slow": 2.0})])
def test_yarn_gguf_matches_transformers(tmp_path, fresh_cache, tiny_model_dir, original, stated, extra):
    """Qwen2.5-style yarn stated by the GGUF's rope.scaling keys. A file without original_context_length took
    int(None) and failed to convert; llama.cpp then takes the trained context (context_length, here 512). The
    yarn_attn_factor / yarn_beta_fast / yarn_beta_slow keys the converter writes from the HF config were ignored."""
    from transformers import AutoModelForCausalLM
    hf_dir = tiny_model_dir("qwen2", rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": original, **extra})
    gguf_path = str(tmp_path / "tiny-yarn.gguf")
    write_tiny_gguf(hf_dir, gguf_path, "qwen2", yarn_original_context=stated)
    config = load_hf_config(prepare_model_dir(gguf_path))
    assert config.rope_parameters["rope_type"] == "yarn"
    assert config.rope_parameters["original_max_position_embeddings"] == original
    assert {k: config.rope_parameters[k] for k in extra} == extra
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0]
    torch.testing.assert_close(_logits(_ours(prepare_model_dir(gguf_path)), ids), ref, atol=1e-4, rtol=1e-4)


def test_tensor_stored_twice_in_a_gguf_is_an_error(tmp_path, fresh_cache, tiny_model_dir):
    """gguf's reader refuses a duplicated tensor name (the conversion path); the packed path's own header parser
    kept both and the second silently won: now the same refusal, naming the tensor and the file."""
    from pagedllm.models.gguf_packed import clear_index_cache, read_gguf_index
    gguf_path = tmp_path / "dup.gguf"
    write_tiny_gguf(tiny_model_dir("llama"), str(gguf_path), "llama")
    data = gguf_path.read_bytes()
    # rename one tensor to another's name of the same length in the header (the data offsets stay valid)
    assert data.count(b"blk.0.ffn_up.weight") == 1
    gguf_path.write_bytes(data.replace(b"blk.0.ffn_up.weight", b"blk.0.attn_q.weight"))
    clear_index_cache()
    with pytest.raises(ValueError, match=rf"Tensor 'blk\.0\.attn_q\.weight' is stored twice in .*dup\.gguf"):
        read_gguf_index(str(gguf_path))
    with pytest.raises(ValueError, match=r"duplicated tensor with name blk\.0\.attn_q\.weight"):
        prepare_model_dir(str(gguf_path))


@pytest.mark.parametrize("part", [0, 1])
def test_a_part_of_a_split_gguf_is_refused_by_name(tmp_path, fresh_cache, monkeypatch, tiny_model_dir, part):
    """llama.cpp's gguf-split parts (split.count > 1) hold some of the tensors each: a part was converted as if it
    were the whole model (the first failed on "missing" weights, the later ones, without metadata, on "GGUF
    architecture None"); it is refused with what to do instead, before anything is written."""
    import gguf

    from tests.models.gguf_writer import write_tiny_gguf
    path = str(tmp_path / f"tiny-0000{part + 1}-of-00002.gguf")
    original = gguf.GGUFWriter.write_header_to_file

    def with_split_keys(writer, *args, **kwargs):  # the keys gguf-split writes into every part
        writer.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_NO, part)
        writer.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_COUNT, 2)
        return original(writer, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "write_header_to_file", with_split_keys)
    write_tiny_gguf(tiny_model_dir("llama"), path, "llama")
    with pytest.raises(ValueError, match=rf"is part {part + 1} of a GGUF split into 2 files; .*llama-gguf-split "
                                         r"--merge"):
        prepare_model_dir(path)
    assert not any(fresh_cache.rglob("*.safetensors"))


def test_a_directory_of_several_ggufs_names_them(tmp_path):
    """A directory without config.json holding several .gguf files: which one to load is the user's to say, and
    a split's parts are named as such with the merge to run (it said only "has no config.json")."""
    split = tmp_path / "split"
    split.mkdir()
    for i in (1, 2):
        (split / f"model-0000{i}-of-00002.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"holds 2 \.gguf files \(model-00001-of-00002\.gguf, model-00002-of-00002"
                                         r"\.gguf\)\. model-00001-of-00002\.gguf and the rest are the parts of a split "
                                         r"GGUF: merge them with `llama-gguf-split --merge"):
        prepare_model_dir(str(split))
    variants = tmp_path / "variants"
    variants.mkdir()
    for name in ("m.Q4_K_M.gguf", "m.Q8_0.gguf"):
        (variants / name).write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"holds 2 \.gguf files \(m\.Q4_K_M\.gguf, m\.Q8_0\.gguf\)\. Pass the \.gguf "
                                         r"file to load\."):
        prepare_model_dir(str(variants))


def test_a_gguf_without_tokenizer_metadata_says_so(tmp_path, fresh_cache, tiny_model_dir):
    """A GGUF with no tokenizer.ggml.* keys: as --tokenizer, transformers' GGUF reader raised a bare KeyError('tokens')
    (not caught); as the model, the error named the cache's converted directory and blamed missing tokenizer files or
    sentencepiece. Now one ValueError naming the .gguf and what to pass instead, from all three ways to give it."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.tokenizer import get_tokenizer
    folder = tmp_path / "only"
    folder.mkdir()
    gguf_path = str(folder / "bare.gguf")
    write_tiny_gguf(tiny_model_dir("llama"), gguf_path, "llama")
    converted = prepare_model_dir(gguf_path)
    assert not os.path.exists(os.path.join(converted, "tokenizer_config.json"))
    expected = (rf"the GGUF {re.escape(gguf_path)} holds no tokenizer "
                r"\(no tokenizer\.ggml\.\* metadata\)\. Pass --tokenizer")
    for source in (gguf_path, str(folder), converted):
        with pytest.raises(ValueError, match=expected):
            get_tokenizer(source)
    with pytest.raises(ValueError, match=expected):
        LLM(model=gguf_path, num_gpu_blocks_override=16, max_model_len=64)
    # without a tokenizer the model still serves token-id prompts
    llm = LLM(model=gguf_path, num_gpu_blocks_override=16, max_model_len=64, skip_tokenizer_init=True)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_a_tensor_type_gguf_cannot_dequantize_is_named_with_the_way_out(tmp_path, fresh_cache, tiny_model_dir):
    """A weight stored as a type the gguf package does not dequantize (I8 here; Q8_K and F64 alike): one sentence
    naming the tensor, its type and the installed gguf, and the re-export that loads (it advised only "upgrade gguf",
    which no released gguf would have helped)."""
    from gguf import GGMLQuantizationType

    path = str(tmp_path / "i8.gguf")
    write_tiny_gguf(tiny_model_dir("llama"), path, "llama", kinds={"mlp.down_proj": GGMLQuantizationType.I8},
                    quantizer=lambda data, qtype: np.clip(np.round(data * 100), -127, 127).astype(np.int8))
    with pytest.raises(ValueError, match=r"GGUF tensor blk\.0\.ffn_down\.weight is stored as I8, which the installed "
                                         r"gguf package \(.+\) cannot dequantize into weights; re-export the model"):
        prepare_model_dir(path)
