"""Quantized checkpoint formats vLLM loads, on the CPU path: LoRA on a GPTQ / AWQ / compressed-tensors base,
compressed-tensors' kv_cache_scheme, AutoAWQ's quant_config.json."""
from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch

from pagedllm import LLM, LoRARequest, SamplingParams
from tests.lora.lora_helpers import make_adapter
from tests.quantization.checkpoints import awq_checkpoint, ct_checkpoint, gptq_checkpoint


def _edit_config(model_dir: str, edit) -> None:
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    edit(config)
    with open(path, "w") as f:
        json.dump(config, f)


@pytest.mark.parametrize("method", ["gptq", "awq", "compressed-tensors"])
def test_lora_on_a_quantized_checkpoint_matches_peft_on_its_dequantized_weights(tmp_path, tiny_model_dir, method):
    # vLLM serves LoRA adapters on GPTQ / AWQ / compressed-tensors bases; these were refused at start.
    from peft import PeftModel

    src = tiny_model_dir("llama")
    dst = str(tmp_path / method)
    if method == "gptq":  # (the reference: transformers holding what the library dequantizes)
        _, base = gptq_checkpoint(src, dst, 4, 32, True, False)
    elif method == "awq":
        _, base = awq_checkpoint(src, dst, 32)
    else:
        _, base = ct_checkpoint(src, dst, "W4A16_ASYM", group_size=32)
    adapter = make_adapter(src, str(tmp_path / "a"), r=8, alpha=16,
                           targets=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"], seed=5)
    llm = LLM(model=dst, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8, num_gpu_blocks_override=32)
    assert type(llm.engine.worker.model.model.layers[0].mlp.down_proj.base_layer.linear_method).__name__ == {
        "gptq": "GPTQLinearMethod", "awq": "AWQLinearMethod", "compressed-tensors": "CTWNA16Method"}[method]
    reference = PeftModel.from_pretrained(base, adapter).eval()
    rng = random.Random(1)
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in (6, 15)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                        lora_request=[LoRARequest("a", 1, adapter)] * 2, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = list(prompt)
        with torch.inference_mode():
            for _ in range(6):
                ids.append(int(reference(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        assert list(out.outputs[0].token_ids) == ids[len(prompt):]


FP8_KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True,
                 "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax"}


def test_compressed_tensors_fp8_kv_cache_scheme_loads_its_scales(tmp_path, tiny_model_dir):
    # llm-compressor's FP8 KV-cache recipes add a kv_cache_scheme and per-layer self_attn.k_scale / v_scale;
    # vLLM loads them. They were refused ("kv_cache_scheme ... not supported").
    from safetensors.torch import load_file, save_file

    dst, _ = ct_checkpoint(tiny_model_dir("llama"), str(tmp_path / "ct"), "FP8_DYNAMIC", reference=False)
    _edit_config(dst, lambda c: c["quantization_config"].update(kv_cache_scheme=FP8_KV_SCHEME))
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    want = [[0.02, 0.003], [0.04, 0.005]]
    for i, (k, v) in enumerate(want):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor([k])
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([v])
    save_file(tensors, path)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = LLM(model=dst, dtype="float32", kv_cache_dtype="fp8", kv_cache_memory_bytes=1 << 20, max_model_len=256)
    layers = llm.engine.worker.runner.model.attn_layers
    assert all(layer.kv_scale_source == "checkpoint" for layer in layers)
    torch.testing.assert_close(torch.stack([layer.kv_scales for layer in layers]), torch.tensor(want))
    assert len(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
    # the model-dtype cache: the scales load unused, the tokens are those of the checkpoint without the scheme
    plain = LLM(model=dst, dtype="float32", kv_cache_memory_bytes=1 << 20, max_model_len=256)
    got = plain.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    del plain
    _edit_config(dst, lambda c: c["quantization_config"].pop("kv_cache_scheme"))
    base = LLM(model=dst, dtype="float32", kv_cache_memory_bytes=1 << 20, max_model_len=256)
    assert got == base.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("scheme", [{"type": "int", "num_bits": 8}, {"strategy": "channel"}, {"dynamic": True},
                                    {"num_bits": 4, "type": "float"}])
def test_compressed_tensors_other_kv_cache_schemes_are_refused(scheme):
    from pagedllm.quantization.compressed_tensors import CompressedTensorsConfig

    config = {"quant_method": "compressed-tensors", "kv_cache_scheme": {**FP8_KV_SCHEME, **scheme},
              "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized", "weights": {
                  "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}}}
    with pytest.raises(ValueError, match="kv_cache_scheme .* is not supported; pagedllm reads static"):
        CompressedTensorsConfig.from_config(config)


@pytest.mark.parametrize("filename,forced", [("quant_config.json", "awq"), ("quant_config.json", None),
                                             ("quantize_config.json", "awq")])
def test_autoawq_quant_config_file(tmp_path, tiny_model_dir, filename, forced):
    # AutoAWQ's own checkpoints keep {w_bit, q_group_size, zero_point, version} in quant_config.json (some
    # uploads: quantize_config.json), which vLLM reads with --quantization awq. It was "no quantization_config"
    # (or, in quantize_config.json, taken for a GPTQ config).
    from pagedllm.models.loader import load_model

    dst, reference = awq_checkpoint(tiny_model_dir("qwen2"), str(tmp_path / "awq"), 32)
    _edit_config(dst, lambda c: c.pop("quantization_config"))
    with open(os.path.join(dst, filename), "w") as f:
        json.dump({"zero_point": True, "q_group_size": 32, "w_bit": 4, "version": "GEMM"}, f)
    model, _, _ = load_model(dst, dtype=torch.float32, quantization=forced)
    assert type(model.model.layers[0].self_attn.qkv_proj.linear_method).__name__ == "AWQLinearMethod"
    prompt = torch.randint(2, 512, (24,), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        got = model.compute_logits(model(prompt, torch.arange(len(prompt))))
        want = reference(prompt[None]).logits[0]
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def _splice(dst: str, reference, src_tensors: dict, modules: list[str], float_modules: list[str]) -> None:
    """Replace `modules`' tensors in dst's checkpoint with src_tensors' (another quantization of the same model)
    and store `float_modules` float (fp16 of the reference's dense weight); the reference follows."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    state = reference.state_dict()
    for module in modules + float_modules:
        for name in [n for n in tensors if n.startswith(module + ".")]:
            del tensors[name]
    for module in modules:
        tensors.update({n: t for n, t in src_tensors.items() if n.startswith(module + ".")})
    with torch.no_grad():
        for module in float_modules:
            tensors[module + ".weight"] = state[module + ".weight"].half()
            state[module + ".weight"].copy_(tensors[module + ".weight"].float())
    save_file(tensors, path)


def _logits(model_dir: str, reference):
    from pagedllm.models.loader import load_model

    model, _, _ = load_model(model_dir, dtype=torch.float32)
    prompt = torch.randint(2, 512, (24,), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        got = model.compute_logits(model(prompt, torch.arange(len(prompt))))
        want = reference(prompt[None]).logits[0]
    return model, got, want


def test_gptq_modules_in_block_to_quantize_leaves_the_others_float(tmp_path, tiny_model_dir):
    # optimum's GPTQ config lists the block modules it quantized; the rest are float in the checkpoint. The list
    # was ignored: "missing weight(s) ... down_proj.qweight".
    dst, reference = gptq_checkpoint(tiny_model_dir("llama"), str(tmp_path / "gptq"), 4, 32, True, False)
    _splice(dst, reference, {}, [], [f"model.layers.{i}.mlp.down_proj" for i in range(2)])
    _edit_config(dst, lambda c: c["quantization_config"].update(modules_in_block_to_quantize=[
        ["self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj"], ["self_attn.o_proj"],
        ["mlp.up_proj", "mlp.gate_proj"]]))
    model, got, want = _logits(dst, reference)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    assert model.model.layers[1].mlp.down_proj.linear_method.__class__.__name__ == "UnquantizedLinearMethod"
    assert model.model.layers[1].mlp.gate_up_proj.linear_method.__class__.__name__ == "GPTQLinearMethod"


def test_gptq_dynamic_overrides_per_module(tmp_path, tiny_model_dir):
    # GPTQModel's `dynamic`: "-:regex" leaves modules float, "+:regex" gives them their own bits / group_size
    # (vLLM reads both). It was refused ("per-module `dynamic` overrides are not supported").
    from safetensors.torch import load_file

    src = tiny_model_dir("qwen3")
    dst, reference = gptq_checkpoint(src, str(tmp_path / "gptq"), 4, 32, False, True)
    dst8, reference8 = gptq_checkpoint(src, str(tmp_path / "gptq8"), 8, 64, True, False, seed=3)
    mlp = [f"model.layers.{i}.mlp.{n}" for i in range(2) for n in ("gate_proj", "up_proj", "down_proj")]
    _splice(dst, reference, load_file(os.path.join(dst8, "model.safetensors")), mlp,
            ["model.layers.1.self_attn.o_proj"])
    with torch.no_grad():
        for module in mlp:
            reference.get_submodule(module).weight.copy_(reference8.get_submodule(module).weight)
    _edit_config(dst, lambda c: c["quantization_config"].update(dynamic={
        r"-:model\.layers\.1\.self_attn\.o_proj": {}, r"+:.*\.mlp\..*": {"bits": 8, "group_size": 64,
                                                                           "desc_act": True, "sym": False}}))
    model, got, want = _logits(dst, reference)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    layers = model.model.layers
    assert layers[1].self_attn.o_proj.linear_method.__class__.__name__ == "UnquantizedLinearMethod"
    assert layers[0].self_attn.o_proj.linear_method.config.bits == 4
    assert layers[0].mlp.gate_up_proj.linear_method.config.bits == 8


def test_gptq_dynamic_splitting_a_fused_layer_is_refused(tmp_path, tiny_llama_dir):
    from pagedllm.models.loader import load_model

    dst = str(tmp_path / "m")
    shutil.copytree(tiny_llama_dir, dst)
    _edit_config(dst, lambda c: c.update(quantization_config={
        "quant_method": "gptq", "bits": 4, "group_size": 32, "dynamic": {r"+:.*\.q_proj": {"bits": 8}}}))
    with pytest.raises(ValueError, match=r"quantizes the layers fused into model\.layers\.0\.self_attn\.qkv_proj"):
        load_model(dst, dtype=torch.float32)


def test_gptq_dynamic_float_key_on_a_multimodal_gemma3_checkpoint(tmp_path):
    # A multimodal Gemma 3's language-model layers are asked under three names (the checkpoint's two and ours):
    # a "-:" key written with the checkpoint's names left the first float, and the next name, which no key
    # matched, made the layer GPTQ anyway (its float tensors then failed to load as qweight).
    from pagedllm.models.loader import load_model
    from tests.models.family_configs import save_tiny_gemma3_multimodal

    save_tiny_gemma3_multimodal(str(tmp_path / "m"))
    _edit_config(str(tmp_path / "m"), lambda c: c.update(quantization_config={
        "quant_method": "gptq", "bits": 4, "group_size": 32,
        "dynamic": {r"-:model\.language_model\.layers\.1\..*": {}, r"-:.*mlp\.down_proj": {}}}))
    model, _, _ = load_model(str(tmp_path / "m"), dtype=torch.float32, load_format="dummy")
    kinds = {name: type(m.linear_method).__name__ for name, m in model.named_modules()
             if hasattr(m, "linear_method") and name.startswith("model.layers.")}
    float_ = {name for name, kind in kinds.items() if kind == "UnquantizedLinearMethod"}
    assert float_ == {n for n in kinds if n.startswith("model.layers.1.") or n.endswith("down_proj")}
    assert set(kinds.values()) == {"UnquantizedLinearMethod", "GPTQLinearMethod"}


@pytest.mark.parametrize("where", ["hf_quant_config.json", "config.json"])
def test_modelopt_fp8_checkpoint_matches_reference(tmp_path, caplog, tiny_model_dir, where):
    # NVIDIA ModelOpt's FP8 checkpoints (nvidia/*-FP8: per-tensor E4M3 weights, static input scales, the AutoFP8
    # layout; the config in hf_quant_config.json or config.json's quant_method "modelopt") load in vLLM. They
    # were refused ("quantized with 'modelopt', which pagedllm does not support") or loaded as a float model.
    from safetensors.torch import load_file, save_file

    from tests.quantization.test_fp8 import _autofp8_checkpoint, check_static_fp8_checkpoint

    dst, reference = _autofp8_checkpoint(tiny_model_dir("qwen2"), str(tmp_path / "fp8"), "FP8", "static")
    quant = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}
    if where == "config.json":
        _edit_config(dst, lambda c: c.update(quantization_config={"quant_method": "modelopt", **quant}))
    else:
        _edit_config(dst, lambda c: c.pop("quantization_config"))
        with open(os.path.join(dst, where), "w") as f:
            json.dump({"producer": {"name": "modelopt", "version": "0.29.0"}, "quantization": quant}, f)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    for i in range(2):  # ModelOpt's KV-cache scales
        tensors[f"model.layers.{i}.self_attn.k_proj.k_scale"] = torch.tensor(0.05)
        tensors[f"model.layers.{i}.self_attn.v_proj.v_scale"] = torch.tensor(0.01)
    save_file(tensors, path)
    check_static_fp8_checkpoint(dst, reference, caplog)


def test_modelopt_config_exclude_wildcards_and_refusals():
    from pagedllm.quantization.compressed_tensors import ModelOptFp8Config

    config = ModelOptFp8Config.from_config({"quant_method": "modelopt", "quant_algo": "FP8",
                                            "exclude_modules": ["lm_head", "model.layers.1.self_attn*", "*.mlp.gate"]})
    assert config.get_linear_method(None, "model.layers.1.self_attn.qkv_proj") is None
    assert config.get_linear_method(None, "model.layers.1.self_attn.o_proj") is None
    assert config.get_linear_method(None, "model.layers.11.self_attn.o_proj") is not None
    assert config.get_linear_method(None, "model.layers.3.mlp.gate") is None
    assert config.get_linear_method(None, "model.layers.3.mlp.gate_up_proj") is not None
    flat = ModelOptFp8Config.from_config({"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head"],
                                          "kv_cache_scheme": FP8_KV_SCHEME})  # newer exports' config.json
    assert flat.ignore == ["lm_head"]
    with pytest.raises(ValueError, match="quant_algo='NVFP4'.* pagedllm reads ModelOpt's per-tensor FP8"):
        ModelOptFp8Config.from_config({"quantization": {"quant_algo": "NVFP4"}})


@pytest.mark.parametrize("preset,dtype", [("FP8", "float8_e4m3fn"), ("W8A8", "int8")])
def test_quantized_tensors_without_their_quantization_config_are_refused(tmp_path, tiny_model_dir, preset, dtype):
    # An FP8 / int8 checkpoint whose config is missing (or not read: ModelOpt's hf_quant_config.json was not) loaded
    # as a float model: the E4M3 / int8 values cast to float32 without their scales, one "Ignoring ...
    # weight_scale" warning, garbage out.
    from pagedllm.models.loader import load_model

    dst, _ = ct_checkpoint(tiny_model_dir("llama"), str(tmp_path / "ct"), preset, reference=False)
    _edit_config(dst, lambda c: c.pop("quantization_config"))
    with pytest.raises(ValueError, match=rf"Cannot load checkpoint weight 'model\.layers\.0\..*': the checkpoint "
                                         rf"stores it in {dtype}, the model reads it as an unquantized float32"):
        load_model(dst, dtype=torch.float32)


@pytest.mark.parametrize("version", ["exllama", "ipex"])
def test_awq_checkpoint_saved_with_a_gemm_kernel_version(tmp_path, tiny_model_dir, version):
    # transformers' AwqConfig(version="exllama" / "ipex") loads GEMM-layout weights with other kernels and
    # save_pretrained keeps that version; vLLM reads the GEMM tensors. It was refused ("AWQ version 'exllama'").
    dst, reference = awq_checkpoint(tiny_model_dir("llama"), str(tmp_path / "awq"), 32)
    _edit_config(dst, lambda c: c["quantization_config"].update(version=version))
    _, got, want = _logits(dst, reference)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
