"""Quantized checkpoints made in the test from the tiny random models, with the quantizer libraries' own
packing code where it runs on this CPU:

    gptq_checkpoint(src, dst, bits, group_size, desc_act, sym) -> (dst, reference)   AutoGPTQ's QuantLinear.pack

`reference` is the transformers model of `src` whose linear weights were replaced by what the LIBRARY
dequantizes (its own forward on an identity input), so our loader+kernels are checked against the
library's reading of the format, not against our own.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import types
from typing import Any

import pytest
import torch

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Layers that share one input (GPTQ's act-order permutation comes from the input's Hessian: one per input).
SAME_INPUT = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "o_proj": "o_in",
              "gate_proj": "mlp_in", "up_proj": "mlp_in", "down_proj": "down_in",
              "qkv_proj": "attn_in", "gate_up_proj": "mlp_in"}  # (Phi-3's checkpoint modules: fused)


QUANTIZER_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                               ".cache", "quantizers")


def load_library_file(archive_prefix: str, member: str, name: str) -> Any:
    """One module file of a quantizer library, executed from its release archive in .cache/quantizers (`make
    setup` downloads them with pip, --no-deps: installed, they need CUDA or another torch; the files read here
    import only torch/numpy/transformers). A missing archive fails the test: without it the format is checked
    against nothing independent. PAGEDLLM_TEST_ALLOW_MISSING_QUANTIZERS=1 skips instead (a machine that cannot
    reach PyPI)."""
    import tarfile
    import zipfile

    archives = sorted(glob.glob(os.path.join(QUANTIZER_CACHE, archive_prefix + "*")))
    if not archives:
        message = f"{archive_prefix} is not in {QUANTIZER_CACHE}: run `make setup`, which downloads it"
        if os.environ.get("PAGEDLLM_TEST_ALLOW_MISSING_QUANTIZERS") == "1":
            pytest.skip(message)
        pytest.fail(message + " (or set PAGEDLLM_TEST_ALLOW_MISSING_QUANTIZERS=1 to skip the tests that need it)",
                    pytrace=False)
    path = archives[-1]
    if path.endswith(".whl"):
        with zipfile.ZipFile(path) as zf:
            source = zf.read(member).decode()
    else:
        with tarfile.open(path) as tf:
            source = tf.extractfile(next(m for m in tf.getmembers() if m.name.endswith("/" + member))).read().decode()
    module = types.ModuleType(name)
    module.__file__ = f"{path}!{member}"
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def hf_model(model_dir: str) -> Any:
    import transformers
    with open(os.path.join(model_dir, "config.json")) as f:
        arch = (json.load(f).get("architectures") or [""])[0]
    # the model class of the checkpoint, all its modules (Gemma 3's vision tower, a classifier's score head)
    kind = next((k for k in ("ForConditionalGeneration", "ForSequenceClassification", "ForTokenClassification")
                 if arch.endswith(k)), None)
    auto = {"ForConditionalGeneration": "AutoModelForImageTextToText", None: "AutoModelForCausalLM"}.get(
        kind, f"AutoModel{kind}")
    return getattr(transformers, auto).from_pretrained(model_dir, dtype=torch.float32).eval()


def _linears(model: Any):
    for i, layer in enumerate(model.model.layers):
        for name in LINEARS:
            parent = layer.self_attn if name in ("q_proj", "k_proj", "v_proj", "o_proj") else layer.mlp
            yield f"model.layers.{i}.{'self_attn' if parent is layer.self_attn else 'mlp'}.{name}", name, \
                getattr(parent, name)


def minmax_quant_params(w: torch.Tensor, g_idx: torch.Tensor, groups: int, bits: int, sym: bool
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's quantizer grid per (output row, group): scales [N, G] (fp16-representable) and int zeros [N, G]."""
    maxq = 2 ** bits - 1
    n = w.shape[0]
    scales, zeros = torch.empty(n, groups), torch.empty(n, groups, dtype=torch.int64)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.min(1).values.clamp(max=0), cols.max(1).values.clamp(min=0)
        if sym:
            hi = torch.maximum(lo.abs(), hi)
            lo = -hi
        s = ((hi - lo) / maxq).clamp(min=1e-6).half().float()
        # AutoGPTQ's v1 format cannot store an asymmetric zero of 0 (it packs zero - 1 = -1 and corrupts the
        # neighbouring nibbles); real quantizers essentially never produce one. Keep zeros >= 1.
        z = torch.full((n,), (maxq + 1) // 2) if sym else torch.round(-lo / s).long().clamp(1, maxq)
        scales[:, g], zeros[:, g] = s, z
    return scales, zeros


def gptq_checkpoint(src: str, dst: str, bits: int = 4, group_size: int = 32, desc_act: bool = False,
                    sym: bool = True, seed: int = 0) -> tuple[str, Any]:
    lib = load_library_file("auto_gptq-0.7.1", "auto_gptq/nn_modules/qlinear/qlinear_cuda.py", "autogptq_qlinear")
    shutil.copytree(src, dst, dirs_exist_ok=True)
    model = hf_model(src)
    gen = torch.Generator().manual_seed(seed)
    perms: dict[tuple[int, str], torch.Tensor] = {}
    tensors: dict[str, torch.Tensor] = {}
    quantized: dict[str, torch.Tensor] = {}
    for full, name, linear in _linears(model):
        n, k = linear.weight.shape
        gs = group_size if group_size != -1 else k
        groups = -(-k // gs)
        g_idx = torch.arange(k) // gs
        if desc_act:
            key = (int(full.split(".")[2]), SAME_INPUT[name])
            perm = perms.setdefault(key, torch.randperm(k, generator=gen))
            g_idx = torch.argsort(perm) // gs  # channel perm[j] is the j-th quantized: group j // gs
        w = linear.weight.data
        scales, zeros = minmax_quant_params(w, g_idx, groups, bits, sym)
        q = torch.round(w / scales[:, g_idx]).long() + zeros[:, g_idx]
        q = q.clamp(0, 2 ** bits - 1)
        linear.weight.data = ((q - zeros[:, g_idx]) * scales[:, g_idx]).float()  # on the grid: pack is exact
        ql = lib.QuantLinear(bits, group_size, k, n, bias=linear.bias is not None, weight_dtype=torch.float16)
        ql.pack(linear, scales, zeros.to(torch.int32), g_idx.to(torch.int32))
        for part in ("qweight", "qzeros", "scales", "g_idx"):
            tensors[f"{full}.{part}"] = getattr(ql, part).contiguous()
        tensors[f"{full}.scales"] = ql.scales.half()  # fp16 on disk, as the library saves it
        if linear.bias is not None:
            tensors[f"{full}.bias"] = linear.bias.data.half()
        quantized[full] = library_dequantized(ql, k)
    for name, param in model.state_dict().items():
        if not any(name.startswith(f + ".") for f in quantized) and name not in tensors:
            tensors[name] = param.half()
    _write(dst, tensors, {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act,
                          "sym": sym, "lm_head": False, "checkpoint_format": "gptq", "damp_percent": 0.01})
    return dst, reference_model(src, quantized, half_rest=tensors)


def library_dequantized(ql: Any, k: int) -> torch.Tensor:
    """The dense [N, K] weight as the library's own (CPU, torch) forward computes it."""
    ql = ql.float() if hasattr(ql, "float") else ql
    ql.scales = ql.scales.float()
    ql.bias = None
    with torch.no_grad():
        return ql(torch.eye(k)).t().contiguous()


def reference_model(src: str, weights: dict[str, torch.Tensor], half_rest: dict[str, torch.Tensor]) -> Any:
    """transformers' model of `src` with these dense linear weights, and every other tensor as stored (fp16)."""
    model = hf_model(src)
    state = model.state_dict()
    with torch.no_grad():
        for name, param in state.items():
            module = name.rsplit(".", 1)[0]
            if module in weights and name.endswith(".weight"):
                param.copy_(weights[module])
            elif name in half_rest:
                param.copy_(half_rest[name].float())
    return model


def _write(dst: str, tensors: dict[str, torch.Tensor], quantization_config: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    for f in os.listdir(dst):
        if f.endswith(".safetensors") or f == "model.safetensors.index.json":
            os.remove(os.path.join(dst, f))
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(dst, "model.safetensors"))
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    config["torch_dtype"] = "float16"
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def awq_checkpoint(src: str, dst: str, group_size: int = 32, seed: int = 0) -> tuple[str, Any]:
    """AutoAWQ's GEMM layout (4-bit, zero point), packed from the published format (AutoAWQ itself needs CUDA
    kernels to install) and checked with AutoAWQ's own `dequantize_gemm`, whose output is the reference."""
    from pagedllm.quantization.awq import AWQ_PACK_ORDER
    from pagedllm.quantization.packed import pack_int32

    lib = load_library_file("autoawq-0.2.9", "awq/utils/packing_utils.py", "autoawq_packing_utils")
    assert tuple(lib.AWQ_ORDER) == AWQ_PACK_ORDER
    shutil.copytree(src, dst, dirs_exist_ok=True)
    model = hf_model(src)
    tensors: dict[str, torch.Tensor] = {}
    quantized: dict[str, torch.Tensor] = {}
    for full, _, linear in _linears(model):
        n, k = linear.weight.shape
        gs = group_size if group_size != -1 else k
        g_idx = torch.arange(k) // gs
        scales, zeros = minmax_quant_params(linear.weight.data, g_idx, k // gs, 4, sym=False)
        q = (torch.round(linear.weight.data / scales[:, g_idx]).long() + zeros[:, g_idx]).clamp(0, 15)
        grid = ((q - zeros[:, g_idx]) * scales[:, g_idx]).float()  # [N, K]
        qweight = pack_int32(q.t(), 4, dim=1, order=AWQ_PACK_ORDER)  # [K, N / 8]
        qzeros = pack_int32(zeros.t(), 4, dim=1, order=AWQ_PACK_ORDER)  # [G, N / 8]
        tensors[f"{full}.qweight"], tensors[f"{full}.qzeros"] = qweight, qzeros
        tensors[f"{full}.scales"] = scales.t().contiguous().half()
        if linear.bias is not None:
            tensors[f"{full}.bias"] = linear.bias.data.half()
        dense = lib.dequantize_gemm(qweight, qzeros, tensors[f"{full}.scales"].float(), 4, gs).t()
        torch.testing.assert_close(dense, grid, atol=1e-6, rtol=1e-6)  # our packing, as AutoAWQ reads it
        quantized[full] = dense.contiguous()
    for name, param in model.state_dict().items():
        if not any(name.startswith(f + ".") for f in quantized) and name not in tensors:
            tensors[name] = param.half()
    _write(dst, tensors, {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                          "version": "gemm", "modules_to_not_convert": None})
    return dst, reference_model(src, quantized, half_rest=tensors)


def ct_checkpoint(src: str, dst: str, preset: str, reference: bool = True, ignore: tuple = ("lm_head",),
                  targets: tuple = ("Linear",), more_groups: tuple = (), **weight_args: Any) -> tuple[str, Any]:
    """A compressed-tensors checkpoint written by the compressed-tensors library itself (what llmcompressor calls
    to save): its preset scheme (W4A16, W8A16, W4A16_ASYM, FP8, FP8_DYNAMIC, W8A8...) applied to the modules
    `targets` names (every Linear) but those of `ignore` (lm_head), min/max weight calibration through its
    `calculate_qparams`, static input scales calibrated on one prompt, `ModelCompressor.compress_model` +
    `update_config`. Returns (dst, reference): transformers loading dst with compressed-tensors' own decompression
    (dense dequantized weights), and - for W8A8 schemes - the library's fake quantization of each linear's input,
    so the reference computes what W8A8 computes. more_groups: (preset, targets, weight_args) of weight-only
    config groups after the first (group_1, ...), which the library applies by its own precedence; the reference
    is then transformers with the library's fake-quantized weights (transformers' own decompression does not
    match regex targets: it leaves those layers compressed)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    model = hf_model(src)
    scheme = preset_name_to_scheme(preset, list(targets))
    for key, value in weight_args.items():
        setattr(scheme.weights, key, value)
    groups = {"group_0": scheme}
    for i, (more_preset, more_targets, more_args) in enumerate(more_groups, 1):
        groups[f"group_{i}"] = preset_name_to_scheme(more_preset, list(more_targets))
        for key, value in more_args.items():
            setattr(groups[f"group_{i}"].weights, key, value)
    amax = _input_amax(model)  # on the float model: quantization wrappers would run on uninitialized scales
    apply_quantization_config(model, QuantizationConfig(config_groups=groups, ignore=list(ignore)))
    dense: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        w, args = module.weight.data, module.quantization_scheme.weights
        if args.strategy == "tensor":
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        elif args.strategy == "channel":
            lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        else:
            grouped = w.reshape(w.shape[0], -1, args.group_size)
            lo, hi = grouped.amin(-1), grouped.amax(-1)
        scale, zero = calculate_qparams(lo, hi, args)
        module.weight_scale.data.copy_(scale)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero)
        dense[name] = fake_quantize(w, scale, zero, args)
        if hasattr(module, "input_scale"):  # static activation scale from one calibration prompt
            s, _ = calculate_qparams(-amax[name].reshape(1), amax[name].reshape(1),
                                     module.quantization_scheme.input_activations)
            module.input_scale.data.copy_(s.reshape(module.input_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    shutil.copytree(src, dst, dirs_exist_ok=True)
    for f in os.listdir(dst):
        if f.endswith(".safetensors") or f == "model.safetensors.index.json":
            os.remove(os.path.join(dst, f))
    model.save_pretrained(dst)
    compressor.update_config(dst)
    if not reference:
        return dst, None
    return dst, reference_model(src, dense, half_rest={}) if more_groups else _ct_reference(dst, scheme)


def _input_amax(model: Any) -> dict[str, torch.Tensor]:
    """max |input| of every Linear over one calibration prompt."""
    amax: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_pre_hook(lambda m, inp, name=name: amax.__setitem__(name, inp[0].abs().amax()))
             for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        model(torch.randint(2, 512, (1, 48), generator=torch.Generator().manual_seed(11)))
    for h in hooks:
        h.remove()
    return amax


def _ct_reference(model_dir: str, scheme: Any) -> Any:
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                     quantization_config=CompressedTensorsConfig(dequantize=True))
    reference.eval()
    # Some transformers versions (5.17) keep the library's fake-quantizing forward on every Linear after
    # decompression, others (5.24) drop it: turn it off, so the activation quantization below is the only one and
    # removing its hooks really gives the weight-only reading, whatever the version.
    for module in reference.modules():
        if getattr(module, "quantization_scheme", None) is not None:
            module.quantization_enabled = False
    act = scheme.input_activations
    if act is None:
        return reference
    with open(os.path.join(model_dir, "config.json")) as f:
        static = not json.load(f)["quantization_config"]["config_groups"]["group_0"]["input_activations"]["dynamic"]
    scales = {}
    if static:
        from safetensors import safe_open
        with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
            scales = {k[: -len(".input_scale")]: f.get_tensor(k) for k in f.keys() if k.endswith(".input_scale")}

    def quantize_input(module, inputs, name):
        shape = inputs[0].shape
        x = inputs[0].reshape(-1, shape[-1])  # [tokens, K]: the library's per-token args expect 2-D
        if name in scales:  # a fused layer uses its shards' largest static scale (as engines do)
            group = [v for k, v in scales.items() if k.rsplit(".", 1)[0] == name.rsplit(".", 1)[0]
                     and SAME_INPUT.get(k.rsplit(".", 1)[1]) == SAME_INPUT[name.rsplit(".", 1)[1]]]
            scale = torch.stack(group).max().reshape(1, 1)
        elif act.type == "int":  # amax / 127, the engines' dynamic int8 scale (see quantize_int8_per_token)
            scale = x.abs().amax(-1, keepdim=True) / 127
        else:
            scale, _ = calculate_qparams(x.amin(-1, keepdim=True), x.amax(-1, keepdim=True), act)
        zero = torch.zeros_like(scale, dtype=torch.int8 if act.type == "int" else torch.float8_e4m3fn)
        return (fake_quantize(x, scale, zero, act).reshape(shape),)

    reference.act_quant_hooks = [  # removable: the weight-only reading of the same checkpoint
        module.register_forward_pre_hook(lambda m, inp, name=name: quantize_input(m, inp, name))
        for name, module in reference.named_modules()
        if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head")]
    assert reference.act_quant_hooks, "no linear layer of the reference got its activation quantization"
    return reference


def w8a8_layer_errors(ours: Any, reference: Any, layer: str, dtype: torch.dtype, device: str,
                      rows: int) -> tuple[float, float, float]:
    """One W8A8 linear (e.g. "model.layers.0.mlp.down_proj", a layer ours keeps unfused) on one input of `rows`
    tokens in `dtype`, ours on `device` against the library reference's same linear in fp32 (with its activation
    quantization hook, and without it): (mean |ours - W8A8|, mean |ours - weight-only|, max |W8A8|). A single
    layer shows the activation quantization itself, which a whole model's half-precision noise hides: over a tiny
    model in bf16 a rounding flip upstream moves the logits as much as quantizing every activation does."""
    ref_linear = reference.get_submodule(layer)
    our_linear = ours.get_submodule(layer)
    x = (torch.randn(rows, ref_linear.in_features, generator=torch.Generator().manual_seed(rows)) * 2).to(dtype)
    with torch.inference_mode():
        got = our_linear(x.to(device)).float().cpu()
        want = ref_linear(x.float())
        weight_only = torch.nn.functional.linear(x.float(), ref_linear.weight, ref_linear.bias)  # no hook
    return (got - want).abs().mean().item(), (got - weight_only).abs().mean().item(), want.abs().max().item()
