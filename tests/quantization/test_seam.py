"""The quantization seam: registry and method resolution, start-up refusals, the linear layers' loaders for
quantized parameters (packed, per-shard, replicated) and the online int8 method end to end."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from pagedllm.models.loader import get_model, load_hf_config, load_model
from pagedllm.quantization import quant_config_for_engine, resolve_quant_config
from pagedllm.quantization.base import LinearMethodBase, is_layer_skipped, set_quant_param_attrs
from tests.quantization.checkpoints import hf_model

PROMPT = torch.randint(2, 512, (32,), generator=torch.Generator().manual_seed(7))


def test_registry_imports_no_method_or_torch():
    code = ("import sys, pagedllm.quantization as q; assert 'torch' not in sys.modules; "
            "assert not any(m.startswith('pagedllm.quantization.') for m in sys.modules); print(q.quantization_methods())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "gptq" in out and "int8" in out


def _with_quant_config(src: str, dst, qc: dict) -> str:
    shutil.copytree(src, dst)
    path = dst / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"] = qc
    path.write_text(json.dumps(config))
    return str(dst)


@pytest.mark.parametrize("qc, forced, message", [
    ({"quant_method": "bitsandbytes"}, None, "quantized with 'bitsandbytes', which pagedllm does not support"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32}, "int8", "does not match the checkpoint"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 32}, None, "bits=3 is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 48}, None, "group_size=48 is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "lm_head": True}, None, "quantized lm_head"),
    # AutoGPTQ's Marlin format (its quantize_config: is_marlin_format) was read as GPTQ: "missing ...qweight"
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "is_marlin_format": True}, None,
     "checkpoint_format='marlin' is not supported"),
    # GPTQModel's pack_dtype int16 / int8: was a shape mismatch on the first qweight
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "pack_dtype": "int16"}, None,
     "packed into int16 words are not supported"),
    # a null or a word for a number: was a bare TypeError / "invalid literal for int()" from the parser
    ({"quant_method": "gptq", "bits": 4, "group_size": None}, None, "GPTQ group_size=None is not an integer"),
    ({"quant_method": "awq", "w_bit": "four", "q_group_size": 128}, None, "AWQ w_bit='four' is not an integer"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "dynamic": {r".*mlp.*": {"bits": None}}}, None,
     r"GPTQ dynamic override '\.\*mlp\.\*': bits=None is not an integer"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "type": "int", "num_bits": None, "strategy": "channel"}}}}, None,
     "compressed-tensors group 'g' weights num_bits=None is not an integer"),
])
def test_checkpoint_method_errors_are_one_sentence(tmp_path, tiny_llama_dir, qc, forced, message):
    model_dir = _with_quant_config(tiny_llama_dir, tmp_path / "m", qc)
    with pytest.raises(ValueError, match=message) as info:
        resolve_quant_config(forced, load_hf_config(model_dir), model_dir)
    assert "\n" not in str(info.value)


_W4_GROUP = {"targets": ["Linear"], "weights": {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 32}}


@pytest.mark.parametrize("qc, message", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "dynamic": {"+:*.mlp": {"bits": 8}}},
     r"GPTQ dynamic entry '\+:\*\.mlp' is not a valid regular expression \(nothing to repeat"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "dynamic": {"-:(": {}}}, r"GPTQ dynamic entry '-:\('"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "modules_to_not_convert": ["re:[x"]},
     r"AWQ modules_to_not_convert entry 're:\[x'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": _W4_GROUP},
      "ignore": ["lm_head", "re:(.*mlp"]}, r"compressed-tensors ignore list entry 're:\(\.\*mlp'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": dict(_W4_GROUP, targets=["re:*proj"])}}, r"compressed-tensors targets entry 're:\*proj'"),
])
def test_a_config_regex_that_does_not_compile_is_refused_by_name(tmp_path, tiny_llama_dir, qc, message):
    # They were compiled only while the model was built: a bare re.error ("nothing to repeat at position 0") from
    # deep in the layer constructors, naming neither the config nor the entry.
    model_dir = _with_quant_config(tiny_llama_dir, tmp_path / "m", qc)
    with pytest.raises(ValueError, match=message):
        load_model(model_dir, dtype=torch.float32, load_format="dummy")


def test_a_module_list_written_as_one_string_names_that_module():
    # Each character of the string was taken as a module name: the module named stayed quantized (or, for
    # modules_in_block_to_quantize, every block module became float) and the load failed on its tensors.
    from pagedllm.quantization.compressed_tensors import CompressedTensorsConfig
    from pagedllm.quantization.gptq import GPTQConfig

    gptq = GPTQConfig.from_config({"bits": 4, "group_size": 32, "modules_to_not_convert": "down_proj"})
    assert gptq.get_linear_method(None, "model.layers.0.mlp.down_proj") is None
    assert gptq.get_linear_method(None, "model.layers.0.self_attn.o_proj") is not None
    gptq = GPTQConfig.from_config({"bits": 4, "group_size": 32, "modules_in_block_to_quantize": "mlp.down_proj"})
    assert gptq.get_linear_method(None, "model.layers.0.mlp.down_proj") is not None
    assert gptq.get_linear_method(None, "model.layers.0.self_attn.o_proj") is None
    ct = CompressedTensorsConfig.from_config({"format": "pack-quantized", "ignore": "model.layers.0.mlp.down_proj",
                                              "config_groups": {"g": {"targets": "Linear", "weights": {
                                                  "type": "int", "num_bits": 4, "strategy": "channel"}}}})
    assert ct.get_linear_method(None, "model.layers.0.mlp.down_proj") is None
    assert ct.get_linear_method(None, "model.layers.1.mlp.down_proj") is not None
    fp8 = resolve_quant_config(None, SimpleNamespace(quantization_config={
        "quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": "model.layers.0.mlp.down_proj"}))
    modelopt = resolve_quant_config(None, SimpleNamespace(quantization_config={
        "quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": "*layers.0.mlp.down_proj"}))
    for qc in (fp8, modelopt):
        assert qc.get_linear_method(None, "model.layers.0.mlp.down_proj") is None
        assert qc.get_linear_method(None, "model.layers.1.mlp.down_proj") is not None


def test_detects_method_from_config_and_autogptq_quantize_config(tmp_path, tiny_llama_dir):
    model_dir = _with_quant_config(tiny_llama_dir, tmp_path / "a", {"quant_method": "gptq", "bits": 8,
                                                                    "group_size": -1, "desc_act": True})
    qc = resolve_quant_config(None, load_hf_config(model_dir), model_dir)
    assert (qc.name, qc.bits, qc.group_size, qc.desc_act) == ("gptq", 8, -1, True)
    old = tmp_path / "b"
    shutil.copytree(tiny_llama_dir, old)
    (old / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128, "sym": False}))
    qc = resolve_quant_config(None, load_hf_config(str(old)), str(old))
    assert (qc.name, qc.bits, qc.sym) == ("gptq", 4, False)
    assert resolve_quant_config(None, load_hf_config(tiny_llama_dir), tiny_llama_dir) is None


def test_unreadable_autogptq_quantize_config_names_the_file(tmp_path, tiny_llama_dir):
    """quantize_config.json that is not JSON, or not an object, is a ValueError naming it (json's bare message, or
    an AttributeError from deep inside, before)."""
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, model_dir)
    path = model_dir / "quantize_config.json"
    for text, fragment in [("{bits: 4", f"{path} is not valid JSON (Expecting property name"),
                           ("[4, 128]", f"{path} must hold a JSON object (a quantize config), got list.")]:
        path.write_text(text)
        with pytest.raises(ValueError, match=re.escape(fragment)):
            resolve_quant_config(None, load_hf_config(str(model_dir)), str(model_dir))


def test_lora_and_device_refusals(tmp_path, tiny_llama_dir, monkeypatch):
    from pagedllm.quantization.gptq import GPTQConfig

    model_dir = _with_quant_config(tiny_llama_dir, tmp_path / "m", {"quant_method": "gptq", "bits": 4,
                                                                    "group_size": 32})
    args = SimpleNamespace(quantization=None, enable_lora=True)
    # GPTQ serves LoRA (tests/quantization/test_checkpoint_formats.py); a method that does not is refused
    assert quant_config_for_engine(args, load_hf_config(model_dir), model_dir, torch.device("cpu"), torch.float32)
    monkeypatch.setattr(GPTQConfig, "supports_lora", False)
    with pytest.raises(ValueError, match="LoRA is not supported with quantization method 'gptq'"):
        quant_config_for_engine(args, load_hf_config(model_dir), model_dir, torch.device("cpu"), torch.float32)
    qc = resolve_quant_config(None, load_hf_config(model_dir), model_dir)
    qc.supported_devices = ("cuda",)
    with pytest.raises(ValueError, match="does not run on cpu"):
        qc.check_supported(torch.device("cpu"), torch.float32)


def test_a_layer_size_not_a_multiple_of_the_group_size_is_named_as_such(tmp_path, tiny_model_dir):
    # A model whose down_proj has 80 inputs, compressed-tensors groups of 32, one process: the refusal said "80
    # inputs per rank do not hold whole groups of 32; use a smaller tensor-parallel size" (there was none to shrink).
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": _W4_GROUP}}
    model_dir = _with_quant_config(tiny_model_dir("llama", intermediate_size=80), tmp_path / "m", qc)
    with pytest.raises(ValueError, match=r"layer model\.layers\.0\.mlp\.down_proj has 80 inputs, not a multiple of "
                                         r"group_size 32; pagedllm reads whole groups only\.$"):
        load_model(model_dir, dtype=torch.float32, load_format="dummy")


def test_quantization_none_on_a_quantized_checkpoint_is_refused(tmp_path, tiny_llama_dir):
    # `--quantization none` (dequantize a .gguf at load) dropped the checkpoint's own quantization config and built
    # a float model: for real GPTQ tensors "The checkpoint is missing 8 weight(s) ... qkv_proj.weight", naming
    # neither the flag nor the method (the config-only checkpoint here even loaded).
    from pagedllm import LLM

    model_dir = _with_quant_config(tiny_llama_dir, tmp_path / "m", {"quant_method": "gptq", "bits": 4,
                                                                    "group_size": 32})
    with pytest.raises(ValueError, match=r"--quantization none cannot load this checkpoint: its weights are "
                                         r"quantized with 'gptq'.*drop --quantization"):
        LLM(model=model_dir, dtype="float32", quantization="none", num_gpu_blocks_override=32)


@pytest.mark.parametrize("prefix, ignored, skipped", [
    ("lm_head", ["lm_head"], True),
    ("model.layers.0.mlp.down_proj", ["down_proj"], True),
    ("model.layers.0.mlp.down_proj", ["model.layers.1"], False),
    ("model.layers.1.mlp.down_proj", ["model.layers.1"], True),
    ("model.layers.0.self_attn.qkv_proj", ["re:.*self_attn.[qkv]_proj"], True),
    ("model.layers.0.self_attn.qkv_proj", ["model.layers.0.self_attn.o_proj"], False),
    # Phi-3's checkpoint modules are the fused ones (GPTQ / AWQ modules_to_not_convert name them so)
    ("model.layers.0.self_attn.qkv_proj", ["model.layers.0.self_attn.qkv_proj"], True),
    ("model.layers.3.mlp.gate_up_proj", ["gate_up_proj"], True),
    ("model.layers.3.mlp.gate_up_proj", ["model.layers.3.mlp.gate_up"], False),
])
def test_is_layer_skipped(prefix, ignored, skipped):
    assert is_layer_skipped(prefix, ignored) is skipped


def test_partly_ignored_fused_layer_is_refused():
    with pytest.raises(ValueError, match="only some of the layers fused into model.layers.0.self_attn.qkv_proj"):
        is_layer_skipped("model.layers.0.self_attn.qkv_proj", ["model.layers.0.self_attn.q_proj"])


class _PackedOutMethod(LinearMethodBase):
    """A layout like AWQ's: int32 [in, out / 8] packed along the output, plus one per-tensor scale per shard."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, weight_loader):
        q = nn.Parameter(torch.zeros(input_size_per_partition, sum(output_partition_sizes) // 8,
                                     dtype=torch.int32), requires_grad=False)
        layer.register_parameter("qweight", set_quant_param_attrs(q, weight_loader=weight_loader, input_dim=0,
                                                                  output_dim=1, packed_dim=1, pack_factor=8))
        s = nn.Parameter(torch.zeros(len(output_partition_sizes)), requires_grad=False)
        layer.register_parameter("scale", set_quant_param_attrs(s, weight_loader=weight_loader, per_shard=True))


def test_merged_loaders_place_packed_and_per_shard_parts(monkeypatch):
    from pagedllm.layers import linear

    qkv = linear.QKVParallelLinear(32, 16, 4, 2, bias=False, linear_method=_PackedOutMethod())
    sizes = {"q": 64, "k": 32, "v": 32}
    for i, (shard, size) in enumerate(sizes.items()):
        qkv.weight_loader(qkv.qweight, torch.full((32, size // 8), i + 1, dtype=torch.int32), shard)
        qkv.weight_loader(qkv.scale, torch.tensor(0.5 * (i + 1)), shard)
    assert qkv.qweight[:, :8].eq(1).all() and qkv.qweight[:, 8:12].eq(2).all() and qkv.qweight[:, 12:].eq(3).all()
    assert qkv.scale.tolist() == [0.5, 1.0, 1.5]
    # tensor parallel rank 1 of 2: its half of q, k and v
    monkeypatch.setattr(linear, "get_tensor_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(linear, "get_tensor_model_parallel_rank", lambda: 1)
    qkv = linear.QKVParallelLinear(32, 16, 4, 2, bias=False, linear_method=_PackedOutMethod())
    full = torch.arange(32 * 8, dtype=torch.int32).reshape(32, 8)  # q: 64 outputs = 8 packed columns
    qkv.weight_loader(qkv.qweight, full, "q")
    assert torch.equal(qkv.qweight[:, :4], full[:, 4:])


def test_online_int8_matches_dequantized_reference_and_greedy(tiny_model_dir):
    model_dir = tiny_model_dir("qwen2")  # qkv bias, tied embeddings
    ours, _, _ = load_model(model_dir, dtype=torch.float32, quantization="int8")
    reference = hf_model(model_dir)
    with torch.no_grad():
        for name, module in reference.named_modules():
            if isinstance(module, nn.Linear) and "lm_head" not in name:
                w = module.weight
                scale = w.abs().amax(1, keepdim=True) / 127
                w.copy_(torch.round(w / scale).clamp(-127, 127) * scale)
    with torch.inference_mode():
        got = ours.compute_logits(ours(PROMPT, torch.arange(len(PROMPT))))
        want = reference(PROMPT[None]).logits[0]
        plain = hf_model(model_dir)(PROMPT[None]).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (got - plain).abs().max() > 1e-3  # the weights really are int8 (differs from the float model)
    assert ours.model.layers[0].mlp.down_proj.weight.dtype == torch.int8


def test_dummy_weights_for_a_quantized_method(tiny_llama_dir):
    qc = resolve_quant_config("int8", load_hf_config(tiny_llama_dir))
    model = get_model(load_hf_config(tiny_llama_dir), None, dtype=torch.float32, load_format="dummy",
                      quant_config=qc)
    with torch.inference_mode():
        assert torch.isfinite(model.compute_logits(model(PROMPT, torch.arange(len(PROMPT))))).all()


def test_engine_logs_weight_memory_per_method(tiny_llama_dir, caplog):
    from pagedllm import LLM

    caplog.set_level("INFO", logger="pagedllm")
    LLM(model=tiny_llama_dir, quantization="int8", kv_cache_memory_bytes=1 << 20)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Model memory"))
    assert "int8 (8 layers)" in line  # 2 layers x (qkv, o, gate_up, down) and "other" in line
