"""compressed-tensors checkpoints (what llmcompressor writes): config.json's `quantization_config` has
`config_groups` (each: `targets`, `weights`, `input_activations`, `format`) and an `ignore` list.

Schemes read (per linear layer; N out, K in):
  W4A16 / W8A16, format pack-quantized: weight_packed int32 [N, K/pack] (signed values + 2**(bits-1), packed
      along K), weight_scale [N, G], weight_zero_point int32 [N/pack, G] (asymmetric only, packed along N),
      weight_g_idx [K] (actorder "group"); naive-quantized W8A16 stores weight int8 [N, K] instead.
  FP8 W8A8, format float-quantized: weight E4M3 [N, K], weight_scale [1] (tensor, one per fused shard) or [N, 1]
      (channel); activations dynamic per token, or static with input_scale [1]; no activation scheme: weight-only.
  INT8 W8A8, format int-quantized: weight int8 [N, K], weight_scale as FP8; activations int8 per token.
An FP8 kv_cache_scheme's K/V scales go to the attention layers (layers/kv_cache_scales.py). Anything else (block /
FP4 / MX formats, sparsity, transforms, asymmetric activations, other KV schemes) is refused at start.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.quantization.base import (FUSED_LAYER_SHARDS, LinearMethodBase, QuantizationConfig, check_patterns,
                                        config_int, config_names, is_layer_skipped, set_quant_param_attrs)
from pagedllm.quantization.fp8 import Fp8LinearMethod, add_w8a8_counters, refuse_blockwise_fp8
from pagedllm.quantization.kernels import int8_cuda_path, int8_w8a8_linear, take_prequantized
from pagedllm.quantization.packed import check_group_size, pack_int32, unpack_int32
from pagedllm.quantization.packed_method import PackedIntLinearMethod

SUPPORTED = "W4A16/W8A16 (pack-quantized, naive-quantized), FP8 W8A8 and INT8 W8A8"


@dataclass
class Scheme:
    kind: str  # "wna16" | "fp8" | "int8_w8a8"
    fmt: str
    bits: int
    strategy: str  # tensor | channel | group
    group_size: int
    symmetric: bool
    actorder: Optional[str]
    act_dynamic: Optional[bool]  # None: weights only
    targets: tuple[str, ...]


def _parse_scheme(name: str, group: dict[str, Any], fmt: Optional[str]) -> Scheme:
    w, a = group.get("weights") or {}, group.get("input_activations")
    if group.get("output_activations"):
        raise ValueError(f"compressed-tensors group {name!r} quantizes output activations, which is not supported.")
    what = f"compressed-tensors group {name!r}"
    wtype, bits, strategy = w.get("type"), config_int(f"{what} weights", w, "num_bits", 0), w.get("strategy")
    act_dynamic = None
    if a:
        if a.get("type") != wtype or config_int(f"{what} activations", a, "num_bits", 0) != 8 \
                or not a.get("symmetric", True) or a.get("strategy") not in ("token", "tensor") or bits != 8:
            raise ValueError(f"compressed-tensors group {name!r}: activations {a} with weights {w} are not "
                             f"supported; pagedllm reads {SUPPORTED}.")
        act_dynamic = bool(a.get("dynamic", True))
    if wtype == "int" and a is None and bits in (4, 8) and fmt in ("pack-quantized", "naive-quantized") \
            and strategy in ("group", "channel"):
        kind = "wna16"
    elif wtype == "float" and bits == 8 and fmt in ("float-quantized", "naive-quantized") \
            and strategy in ("tensor", "channel") and w.get("symmetric", True):
        kind = "fp8"
    elif wtype == "int" and a is not None and fmt in ("int-quantized", "naive-quantized") \
            and strategy in ("tensor", "channel") and w.get("symmetric", True):
        kind = "int8_w8a8"
    else:
        raise ValueError(f"compressed-tensors group {name!r} (format {fmt!r}, {bits}-bit {wtype} weights, "
                         f"strategy {strategy!r}) is not supported; pagedllm reads {SUPPORTED}.")
    group_size = int(w.get("group_size") or -1) if strategy == "group" else -1
    if kind == "wna16":
        check_group_size("compressed-tensors", group_size)
    return Scheme(kind, fmt, bits, strategy, group_size, bool(w.get("symmetric", True)), _actorder(name, w),
                  act_dynamic, tuple(config_names(group.get("targets"))))


def _actorder(name: str, weights: dict[str, Any]) -> Optional[str]:
    """The weights' activation ordering as "group" (a weight_g_idx on disk), "weight" or None. The library's
    aliases: "dynamic" is "group", "static" is "weight", and older versions wrote `true` for "group"; reading only
    the word "group" left such a checkpoint's g_idx unread and its groups silently misapplied."""
    value = weights.get("actorder")
    if value is None or value is False:
        return None
    order = {"group": "group", "dynamic": "group", "weight": "weight", "static": "weight"}.get(
        "group" if value is True else str(value).lower())
    if order is None:
        raise ValueError(f"compressed-tensors group {name!r}: weights actorder {value!r} is not supported; "
                         f"pagedllm reads 'group' ('dynamic'), 'weight' ('static') or none.")
    return order


def _check_kv_cache_scheme(kv: Optional[dict[str, Any]]) -> None:
    """An FP8 kv_cache_scheme is what vLLM reads: calibrated per-tensor (or per-head) K/V scales, saved as
    self_attn.k_scale / v_scale (or k_proj / v_proj.output_scale), which the loader hands to the attention layers
    (layers/kv_cache_scales.py; a per-head vector keeps its largest) and --kv-cache-dtype fp8 uses; with the
    model-dtype cache they are unused, as in vLLM. Other KV schemes are refused."""
    if not kv:
        return
    if kv.get("type") != "float" or int(kv.get("num_bits") or 0) != 8 or not kv.get("symmetric", True) \
            or kv.get("dynamic") or kv.get("strategy", "tensor") not in ("tensor", "attn_head"):
        raise ValueError(f"compressed-tensors kv_cache_scheme {kv} is not supported; pagedllm reads static "
                         f"symmetric FP8 (8-bit float) KV scales per tensor or per head.")


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"
    ignore_parents = False  # the library quantizes the Linear children of an ignored parent module
    supports_lora = True  # the LoRA wrappers add a float delta around apply(), whatever the base weight's storage

    def __init__(self, schemes: list[Scheme], ignore: list[str]) -> None:
        check_patterns(f"The {self.name} ignore list", ignore)
        check_patterns(f"The {self.name} targets", [t for s in schemes for t in s.targets])
        self.schemes = schemes
        self.ignore = ignore
        kinds = {s.kind for s in schemes}
        if kinds & {"fp8"}:
            self.min_capability = 89  # FP8 tensor cores (weight-only FP8 too: the weights are E4M3 on the GPU)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "CompressedTensorsConfig":
        for key in ("sparsity_config", "transform_config"):
            if config.get(key):
                raise ValueError(f"compressed-tensors checkpoints with a {key} are not supported; use a "
                                 f"quantization-only checkpoint.")
        _check_kv_cache_scheme(config.get("kv_cache_scheme"))
        groups = config.get("config_groups") or {}
        if not groups:
            raise ValueError("The compressed-tensors quantization_config has no config_groups.")
        schemes = [_parse_scheme(n, g, g.get("format") or config.get("format")) for n, g in groups.items()]
        return cls(schemes, config_names(config.get("ignore")))

    def skipped_checkpoint_suffixes(self) -> tuple[str, ...]:
        return (".weight_shape",)

    def check_supported(self, device: torch.device, act_dtype: torch.dtype) -> None:
        super().check_supported(device, act_dtype)
        if any(s.kind == "fp8" and s.act_dynamic is not None for s in self.schemes):
            from pagedllm.quantization.fp8 import check_fp8_gpu_dtype
            check_fp8_gpu_dtype(self.name, device, act_dtype)

    def _scheme_for(self, name: str) -> Optional[Scheme]:
        """The library's precedence (compressed_tensors match_targets): an exact name, then a regex (each in sorted
        order), then the class name "Linear", whatever the order of the groups; a target a later group lists again
        is that group's."""
        by_target = {target: scheme for scheme in self.schemes for target in scheme.targets}
        for target in sorted(by_target, key=lambda t: (t.startswith("re:"), t)):
            if target.startswith("re:"):
                if re.match(target[3:], name):
                    return by_target[target]
            elif target != "Linear" and (name == target or name.endswith("." + target)):
                return by_target[target]
        return by_target.get("Linear")

    def get_linear_method(self, layer: nn.Module, prefix: str) -> Optional[LinearMethodBase]:
        if is_layer_skipped(prefix, self.ignore, self.ignore_parents):
            return None
        parent, _, leaf = prefix.rpartition(".")
        names = [f"{parent}.{s}" for s in FUSED_LAYER_SHARDS.get(leaf, (leaf,))]
        found = {id(s): s for s in (self._scheme_for(n) for n in names)}
        if list(found.values()) == [None] and len(names) > 1:  # targets naming the fused module itself (Phi-3's)
            scheme = self._scheme_for(prefix)
            found = {id(scheme): scheme}
        if len(found) != 1:
            raise ValueError(f"The layers fused into {prefix} use different compressed-tensors schemes (or only "
                             f"some are quantized); pagedllm needs one scheme per fused layer.")
        scheme = next(iter(found.values()))
        if scheme is None:
            return None
        if scheme.kind == "wna16":
            return CTWNA16Method(scheme)
        return CTW8A8Method(scheme)


class AutoFp8Config(CompressedTensorsConfig):
    """AutoFP8 checkpoints (quant_method "fp8", no weight_block_size; e.g. neuralmagic's *-FP8): E4M3 weights with
    one (0-d) weight_scale per layer, activations with one static input_scale per layer ("static") or quantized at
    run time ("dynamic": per token here), `ignored_layers` float. The compressed-tensors FP8 per-tensor layout."""

    name = "fp8"
    ignore_parents = True  # (its exclusion list read as module names, suffixes and parents)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "AutoFp8Config":
        # (was refused as "block-wise FP8 checkpoints (weight_block_size None)"; block-wise ones still are)
        refuse_blockwise_fp8(config)
        scheme = config.get("activation_scheme", "dynamic")
        fmt = config.get("fmt", "e4m3")
        if scheme not in ("static", "dynamic") or fmt != "e4m3":
            raise ValueError(f"FP8 checkpoints with activation_scheme={scheme!r}, fmt={fmt!r} are not supported; "
                             f"pagedllm reads AutoFP8's E4M3 checkpoints with a static or dynamic activation scheme.")
        weights = Scheme("fp8", "float-quantized", 8, "tensor", -1, True, None, scheme == "dynamic", ("Linear",))
        return cls([weights], config_names(config.get("ignored_layers") or config.get("modules_to_not_convert")))


class ModelOptFp8Config(CompressedTensorsConfig):
    """NVIDIA ModelOpt FP8 checkpoints (nvidia/*-FP8; quant_method "modelopt", or hf_quant_config.json's
    "quantization"): E4M3 weights with one weight_scale and one static input_scale per layer (AutoFP8's layout),
    `exclude_modules` float (names or "*" wildcards), KV scales as k_proj.k_scale / v_proj.v_scale."""

    name = "modelopt"
    ignore_parents = True  # (its exclusion list read as module names, suffixes and parents)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "ModelOptFp8Config":
        q = config.get("quantization") if isinstance(config.get("quantization"), dict) else config
        algo, kv_algo = q.get("quant_algo"), q.get("kv_cache_quant_algo")
        if str(algo).upper() != "FP8" or kv_algo not in (None, "FP8", "fp8"):
            raise ValueError(f"ModelOpt checkpoints with quant_algo={algo!r}, kv_cache_quant_algo={kv_algo!r} are "
                             f"not supported; pagedllm reads ModelOpt's per-tensor FP8 checkpoints.")
        _check_kv_cache_scheme(q.get("kv_cache_scheme"))  # (newer exports: a compressed-tensors style config)
        weights = Scheme("fp8", "float-quantized", 8, "tensor", -1, True, None, False, ("Linear",))
        # ModelOpt's wildcards ("model.layers.0.self_attn*", "*mlp.gate") as the regexes is_layer_skipped reads
        ignore = ["re:" + re.escape(e).replace(r"\*", ".*") + "$" if "*" in e else e
                  for e in config_names(q.get("exclude_modules") or q.get("ignore"))]
        return cls([weights], ignore)


class CTWNA16Method(PackedIntLinearMethod):
    def __init__(self, scheme: Scheme) -> None:
        super().__init__(scheme.bits, scheme.group_size)
        self.scheme = scheme
        self.method_name = f"compressed-tensors W{scheme.bits}A16"

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, weight_loader):
        s, pack = self.scheme, 32 // self.scheme.bits
        k, n = input_size_per_partition, sum(output_partition_sizes)
        group = s.group_size if s.group_size != -1 else input_size
        sharded_k = k != input_size
        act_order = s.actorder == "group"
        split_groups = sharded_k and s.group_size != -1 and not act_order
        if input_size % group:  # the model's own shape, whatever the tensor-parallel size
            raise ValueError(f"compressed-tensors layer {layer.prefix} has {input_size} inputs, not a multiple of "
                             f"group_size {group}; pagedllm reads whole groups only.")
        if split_groups and k % group:
            raise ValueError(f"compressed-tensors layer {layer.prefix}: {k} inputs per rank do not hold whole "
                             f"groups of {group}; use a smaller tensor-parallel size.")
        if any(size % pack for size in output_partition_sizes) or k % pack:
            raise ValueError(f"compressed-tensors layer {layer.prefix}: sizes {output_partition_sizes} x {k} per "
                             f"rank are not multiples of {pack}.")
        groups = 1 if s.group_size == -1 else (k if split_groups else input_size) // group
        group_dim = None if sharded_k and not split_groups else 1
        if s.fmt == "naive-quantized":
            weight = nn.Parameter(torch.empty(n, k, dtype=torch.int8), requires_grad=False)
            set_quant_param_attrs(weight, weight_loader=weight_loader, input_dim=1, output_dim=0)
            layer.register_parameter("weight", weight)
        else:
            packed = nn.Parameter(torch.empty(n, k // pack, dtype=torch.int32), requires_grad=False)
            set_quant_param_attrs(packed, weight_loader=weight_loader, input_dim=1, output_dim=0, packed_dim=1,
                                  pack_factor=pack)
            layer.register_parameter("weight_packed", packed)
        scale = nn.Parameter(torch.empty(n, groups, dtype=params_dtype), requires_grad=False)
        set_quant_param_attrs(scale, weight_loader=weight_loader, input_dim=group_dim, output_dim=0)
        layer.register_parameter("weight_scale", scale)
        if not s.symmetric:
            if s.fmt == "naive-quantized":
                zp = nn.Parameter(torch.empty(n, groups, dtype=torch.int8), requires_grad=False)
                set_quant_param_attrs(zp, weight_loader=weight_loader, input_dim=group_dim, output_dim=0)
            else:
                zp = nn.Parameter(torch.empty(n // pack, groups, dtype=torch.int32), requires_grad=False)
                set_quant_param_attrs(zp, weight_loader=weight_loader, input_dim=group_dim, output_dim=0,
                                      packed_dim=0, pack_factor=pack)
            layer.register_parameter("weight_zero_point", zp)
        if act_order:
            g_idx = nn.Parameter(torch.empty(k, dtype=torch.int32), requires_grad=False)
            first = layer.tp_rank * k if sharded_k else 0
            set_quant_param_attrs(g_idx, weight_loader=weight_loader, input_dim=0, dummy_init=lambda p: p.data.copy_(
                (torch.arange(p.numel(), device=p.device) + first) // group))
            layer.register_parameter("weight_g_idx", g_idx)
        layer.ct_first_group = layer.tp_rank * k // group if split_groups else 0
        self.group_size = group if s.group_size != -1 else k

    def convert(self, layer):
        bits, offset = self.bits, 1 << (self.bits - 1)
        if self.scheme.fmt == "naive-quantized":
            q = layer.weight.data.to(torch.int32) + offset  # [N, K] unsigned
        else:
            q = unpack_int32(layer.weight_packed.data, bits, dim=1)  # already offset
        scales = layer.weight_scale.data.t()
        if self.scheme.symmetric:
            zeros = torch.full_like(scales, offset, dtype=torch.float32)
        elif self.scheme.fmt == "naive-quantized":
            zeros = (layer.weight_zero_point.data.to(torch.int32) + offset).t()
        else:
            zeros = unpack_int32(layer.weight_zero_point.data, bits, dim=0).t()
        g_idx = getattr(layer, "weight_g_idx", None)
        if g_idx is not None and bool((g_idx.data == -1).any()):
            # the library's "no order set" (its initial value, kept by a layer never calibrated with act-order):
            # it dequantizes such a layer in column order; indexing with -1 read the last group's scales
            g_idx = None
        if g_idx is not None:
            g_idx = g_idx.data.long() - layer.ct_first_group
            groups = scales.shape[0]
            if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
                raise ValueError(f"compressed-tensors layer {layer.prefix}: weight_g_idx points outside its "
                                 f"{groups} groups.")
        return pack_int32(q.t(), bits, dim=0), scales, zeros, g_idx


class CTW8A8Method(Fp8LinearMethod):
    """FP8 or INT8 weights with per-tensor (per fused shard) or per-channel scales; W8A8, or FP8 weight-only."""

    def __init__(self, scheme: Scheme) -> None:
        self.scheme = scheme
        self.method_name = ("compressed-tensors FP8" if scheme.kind == "fp8" else "compressed-tensors INT8") + (
            " W8A16" if scheme.act_dynamic is None else " W8A8")

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, weight_loader):
        dtype = torch.float8_e4m3fn if self.scheme.kind == "fp8" else torch.int8
        weight = nn.Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=dtype),
                              requires_grad=False)
        set_quant_param_attrs(weight, weight_loader=weight_loader, input_dim=1, output_dim=0)
        layer.register_parameter("weight", weight)
        if self.scheme.strategy == "channel":
            scale = nn.Parameter(torch.empty(weight.shape[0], 1, dtype=torch.float32), requires_grad=False)
            set_quant_param_attrs(scale, weight_loader=weight_loader, output_dim=0)
        else:
            scale = nn.Parameter(torch.empty(len(output_partition_sizes), dtype=torch.float32), requires_grad=False)
            set_quant_param_attrs(scale, weight_loader=weight_loader, per_shard=True)
        layer.register_parameter("weight_scale", scale)
        if self.scheme.act_dynamic is False:
            input_scale = nn.Parameter(torch.empty(len(output_partition_sizes), dtype=torch.float32),
                                       requires_grad=False)
            set_quant_param_attrs(input_scale, weight_loader=weight_loader, per_shard=True)
            layer.register_parameter("input_scale", input_scale)
        layer.ct_partition_sizes = list(output_partition_sizes)

    def process_weights_after_loading(self, layer):
        scale = layer.weight_scale.data
        if self.scheme.strategy == "channel":
            scale = scale.reshape(-1)
        else:  # per-tensor scale of each fused shard -> the same value on each of its rows
            sizes = torch.tensor(layer.ct_partition_sizes, device=scale.device)
            scale = torch.repeat_interleave(scale, sizes)
        del layer.weight_scale
        layer.register_buffer("weight_scale", scale.float().contiguous(), persistent=False)
        input_scale = getattr(layer, "input_scale", None)
        if input_scale is not None:  # one static scale for the fused input: the largest shard's
            del layer.input_scale
            layer.input_scale = input_scale.data.max().reshape(1)
        else:
            layer.input_scale = None
        if self.scheme.act_dynamic is not None:  # W8A8: the CUDA GEMM's split-K counters
            add_w8a8_counters(layer)

    def apply(self, layer, x, bias=None):
        if self.scheme.act_dynamic is None:  # FP8 weight-only: dequantize and multiply in the model dtype
            return F.linear(x, (layer.weight.to(x.dtype) * layer.weight_scale.to(x.dtype)[:, None]), bias)
        if self.scheme.kind == "int8_w8a8":
            return int8_w8a8_linear(x, layer.weight, layer.weight_scale, bias, layer.input_scale,
                                    getattr(layer, "w8a8_counters", None), take_prequantized(layer, x))
        return super().apply(layer, x, bias)

    def norm_quant_dtype(self, layer) -> Optional[torch.dtype]:
        if self.scheme.act_dynamic is None:  # weight-only
            return None
        if self.scheme.kind == "int8_w8a8":
            if layer.input_scale is None and int8_cuda_path(layer.weight.device):
                return torch.int8
            return None
        return super().norm_quant_dtype(layer)
