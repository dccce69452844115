"""GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum), loaded as they are on disk.

Per linear layer (K in, N out, G = K / group_size groups, or 1 for group_size = -1; pack = 32 // bits):
    qweight int32 [K / pack, N]   packed along K, value i of a word in bits [i*bits, +bits)
    qzeros  int32 [G, N / pack]   packed along N; the "gptq" (v1) format stores zero - 1, "gptq_v2" the zero
    scales  fp16  [G, N]
    g_idx   int32 [K]             group of each input channel (desc_act / act-order permutes it)
    w[n, k] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n])
Float modules: modules_to_not_convert, the block modules optimum's modules_in_block_to_quantize leaves out, and
GPTQModel's `dynamic` "-:regex" keys; its other keys give matching modules their own bits / group_size / desc_act / sym.
Tensor parallelism: column-parallel layers split N of all four; row-parallel layers split K of qweight and
g_idx, and of scales/qzeros too unless desc_act or group_size = -1 (then every rank holds all groups and
g_idx indexes them globally).
"""
from __future__ import annotations

import re
from typing import Any, Optional

import torch
from torch import nn

from pagedllm.quantization.base import (FUSED_LAYER_SHARDS, QuantizationConfig, check_patterns, config_int,
                                        config_names, is_layer_skipped, set_quant_param_attrs)
from pagedllm.quantization.packed import check_bits, check_group_size, unpack_int32
from pagedllm.quantization.packed_method import PackedIntLinearMethod


class GPTQConfig(QuantizationConfig):
    name = "gptq"
    checkpoint_names = ("gptq_v2",)
    supported_act_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    supports_lora = True  # the LoRA wrappers add a float delta around apply(), whatever the base weight's storage

    def __init__(self, bits: int, group_size: int, desc_act: bool, sym: bool, checkpoint_format: str = "gptq",
                 modules_to_not_convert: Optional[list[str]] = None,
                 modules_in_block_to_quantize: Optional[list[Any]] = None,
                 dynamic: Optional[dict[str, dict[str, Any]]] = None) -> None:
        check_bits("GPTQ", bits)
        check_group_size("GPTQ", group_size)
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format={checkpoint_format!r} is not supported; pagedllm reads "
                             f"'gptq' and 'gptq_v2' checkpoints.")
        self.bits = bits
        self.group_size = group_size
        self.desc_act = desc_act
        self.sym = sym
        self.checkpoint_format = checkpoint_format
        self.modules_to_not_convert = config_names(modules_to_not_convert)
        # optimum's decoder-block modules that ARE quantized (flat, or one list per sequential step): the others
        # of a block are float in the checkpoint
        blocks = config_names(modules_in_block_to_quantize)
        self.modules_in_block_to_quantize = [m for b in blocks for m in ([b] if isinstance(b, str) else b)]
        # GPTQModel's per-module overrides: {"-:regex": {}} leaves matching modules float, {"+:regex" or "regex":
        # {"bits": 8, ...}} quantizes them with other settings; the first matching key decides
        self.dynamic = dict(dynamic or {})
        check_patterns("The GPTQ modules_to_not_convert", self.modules_to_not_convert)
        for key in self.dynamic:  # (keys are regexes, "-:" / "+:" prefixed or bare)
            check_patterns("The GPTQ dynamic", [key], key[:2] if key.startswith(("-:", "+:")) else "")
        for key, override in self.dynamic.items():
            if not key.startswith("-:"):
                self._override(override, key)  # (its settings checked now, not when a layer meets it)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "GPTQConfig":
        if config.get("lm_head"):
            raise ValueError("GPTQ checkpoints with a quantized lm_head are not supported; use a checkpoint "
                             "quantized with lm_head=False.")
        fmt = config.get("checkpoint_format") or ("gptq_v2" if config.get("quant_method") == "gptq_v2" else "gptq")
        if str(config.get("pack_dtype") or "int32").replace("torch.", "") != "int32":
            # GPTQModel packs into int16 / int8 words on request: other tensor shapes, refused by name
            raise ValueError(f"GPTQ checkpoints packed into {config['pack_dtype']} words are not supported; "
                             f"pagedllm reads pack_dtype int32 (GPTQModel's default).")
        if config.get("is_marlin_format"):  # AutoGPTQ's Marlin repack (B / s tensors): not "missing qweight"
            fmt = "marlin"
        return cls(bits=config_int("GPTQ", config, "bits", 4), group_size=config_int("GPTQ", config, "group_size", 128),
                   desc_act=bool(config.get("desc_act", False)), sym=bool(config.get("sym", True)),
                   checkpoint_format=fmt, modules_to_not_convert=config.get("modules_to_not_convert"),
                   modules_in_block_to_quantize=config.get("modules_in_block_to_quantize"),
                   dynamic=config.get("dynamic"))

    def _override(self, override: dict[str, Any], key: str) -> "GPTQConfig":
        if not isinstance(override, dict):
            raise ValueError(f"GPTQ dynamic override {key!r} must map to a dict of settings, got {override!r}.")
        what = f"GPTQ dynamic override {key!r}:"
        return GPTQConfig(config_int(what, override, "bits", self.bits),
                          config_int(what, override, "group_size", self.group_size),
                          bool(override.get("desc_act", self.desc_act)), bool(override.get("sym", self.sym)),
                          self.checkpoint_format)

    def _module_config(self, name: str) -> tuple[Optional["GPTQConfig"], bool]:
        """(This checkpoint module's settings, or None where it is float; whether a list entry or a dynamic key
        named it)."""
        if self.modules_in_block_to_quantize and ".layers." in name:
            if not any(name.endswith("." + m) for m in self.modules_in_block_to_quantize):
                return None, False
            named = True
        else:
            named = False
        for key, override in self.dynamic.items():
            if key.startswith("-:"):
                if re.match(key[2:], name):
                    return None, True
            elif re.match(key[2:] if key.startswith("+:") else key, name):
                return self._override(override, key), True
        return self, named

    def leaves_float(self, prefix: str) -> bool:
        """Whether a dynamic "-:" key names the layer `prefix` (or all the checkpoint layers fused into it) float: a
        decision a wrapper asking under several names (models/gemma3.LanguageModelNames) must not override with
        another name that no key matches."""
        parent, _, leaf = prefix.rpartition(".")
        found = [self._module_config(f"{parent}.{s}" if parent else s) for s in FUSED_LAYER_SHARDS.get(leaf, (leaf,))]
        own = self._module_config(prefix)
        return (own[0] is None and own[1]) or (all(c is None for c, _ in found) and any(n for _, n in found))

    def get_linear_method(self, layer: nn.Module, prefix: str) -> Optional["GPTQLinearMethod"]:
        if is_layer_skipped(prefix, self.modules_to_not_convert):
            return None
        # A fused layer takes the settings its checkpoint layers share; a checkpoint storing it fused (Phi-3's
        # qkv_proj) names the fused module itself.
        parent, _, leaf = prefix.rpartition(".")
        names = [f"{parent}.{s}" if parent else s for s in FUSED_LAYER_SHARDS.get(leaf, (leaf,))]
        found = [self._module_config(n) for n in names]
        own = self._module_config(prefix)
        if len(names) > 1 and own[1] and not any(named for _, named in found):
            found = [own]
        keys = {None if c is None else (c.bits, c.group_size, c.desc_act, c.sym) for c, _ in found}
        if len(keys) > 1:
            raise ValueError(f"The GPTQ checkpoint quantizes the layers fused into {prefix} ({', '.join(names)}) "
                             f"differently (modules_in_block_to_quantize / dynamic); pagedllm needs one setting "
                             f"for all of them.")
        config = found[0][0]
        return None if config is None else GPTQLinearMethod(config)


class GPTQLinearMethod(PackedIntLinearMethod):
    def __init__(self, config: GPTQConfig) -> None:
        super().__init__(config.bits, config.group_size)
        self.config = config

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, weight_loader):
        cfg, pack = self.config, 32 // self.config.bits
        k, n = input_size_per_partition, sum(output_partition_sizes)
        group = cfg.group_size if cfg.group_size != -1 else input_size  # group -1: one group of all K
        if k % pack or (cfg.group_size != -1 and input_size % cfg.group_size):
            raise ValueError(f"GPTQ layer {layer.prefix} has {input_size} inputs, not a multiple of the group size "
                             f"{cfg.group_size} / pack factor {pack}.")
        if any(size % pack for size in output_partition_sizes):
            raise ValueError(f"GPTQ layer {layer.prefix}: output sizes {output_partition_sizes} per rank are not "
                             f"multiples of {pack}; use a smaller tensor-parallel size.")
        # Row-parallel (K split): the groups split with K only when each rank's K holds whole groups in order;
        # with desc_act or group_size = -1 every rank keeps all groups and g_idx indexes them globally.
        sharded_k = k != input_size
        split_groups = sharded_k and cfg.group_size != -1 and not cfg.desc_act
        if split_groups and k % cfg.group_size:
            raise ValueError(f"GPTQ layer {layer.prefix}: {k} inputs per rank is not a multiple of group_size "
                             f"{cfg.group_size}; use a smaller tensor-parallel size.")
        groups = 1 if cfg.group_size == -1 else (k if split_groups else input_size) // group
        group_in_dim = None if sharded_k and not split_groups else 0
        int_param = lambda *shape: nn.Parameter(torch.empty(*shape, dtype=torch.int32), requires_grad=False)
        qweight = int_param(k // pack, n)
        set_quant_param_attrs(qweight, weight_loader=weight_loader, input_dim=0, output_dim=1, packed_dim=0,
                              pack_factor=pack)
        qzeros = int_param(groups, n // pack)
        set_quant_param_attrs(qzeros, weight_loader=weight_loader, input_dim=group_in_dim, output_dim=1,
                              packed_dim=1, pack_factor=pack)
        scales = nn.Parameter(torch.empty(groups, n, dtype=params_dtype), requires_grad=False)
        set_quant_param_attrs(scales, weight_loader=weight_loader, input_dim=group_in_dim, output_dim=1)
        # Optional on disk without act-order (some exporters drop it): default = the trivial global map. With
        # desc_act the channels are permuted and that default would silently dequantize garbage: required.
        g_idx = int_param(k)
        first = layer.tp_rank * k if sharded_k else 0
        trivial = lambda p: p.data.copy_((torch.arange(p.numel(), device=p.device) + first) // group)
        set_quant_param_attrs(g_idx, weight_loader=weight_loader, input_dim=0, optional=not cfg.desc_act,
                              dummy_init=trivial)
        trivial(g_idx)
        for name, param in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales), ("g_idx", g_idx)):
            layer.register_parameter(name, param)
        # Global index of this rank's first group (its g_idx values start there when the groups are split).
        layer.gptq_first_group = first // group if split_groups else 0

    def convert(self, layer):
        cfg = self.config
        zeros = unpack_int32(layer.qzeros.data, cfg.bits, dim=1)
        if cfg.checkpoint_format == "gptq":
            # v1 stores zero - 1 and its kernels add the 1 back without wrapping (an asymmetric zero of 0 is
            # stored as 2**bits - 1 and dequantized with 2**bits): reproduce that exactly.
            zeros = zeros + 1
        g_idx = layer.g_idx.data.long() - layer.gptq_first_group
        groups = layer.scales.shape[0]
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            raise ValueError(f"GPTQ layer {layer.prefix}: g_idx points outside its {groups} groups (a desc_act "
                             f"checkpoint whose config says desc_act=false?).")
        self.group_size = self.config.group_size if self.config.group_size != -1 else layer.qweight.shape[0] * (
            32 // cfg.bits)
        return layer.qweight.data, layer.scales.data, zeros, g_idx
