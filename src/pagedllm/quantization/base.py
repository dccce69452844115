"""The quantization seam: a per-method `QuantizationConfig` that hands each linear layer its `LinearMethodBase`.

    QuantizationConfig.from_config(hf_quantization_config_dict) -> config   (or from `--quantization NAME`)
    config.get_linear_method(layer, prefix) -> LinearMethodBase | None     (None: the layer stays unquantized)
    config.check_supported(device, dtype)   -> raises ValueError in one sentence if this machine cannot run it

A linear layer (`layers/linear.py`) asks its `quant_config` for a method at construction; the method's
`create_weights` registers the layer's parameters (e.g. GPTQ's qweight/qzeros/scales/g_idx) tagged with how they
shard (see `set_quant_param_attrs`), the layer's own `weight_loader` slices each checkpoint tensor for merged
(qkv, gate_up) and tensor-parallel layers, `process_weights_after_loading` repacks once, `apply` multiplies.
The unquantized path is one such method (`UnquantizedLinearMethod`, used when `get_linear_method` returns None).
"""
from __future__ import annotations

import re
from typing import Any, ClassVar, Iterable, Optional

import torch
from torch import nn

from pagedllm.layers.linear import LinearMethodBase, UnquantizedLinearMethod

__all__ = ["LinearMethodBase", "UnquantizedLinearMethod", "QuantizationConfig", "is_layer_skipped", "check_patterns",
           "config_int", "config_names",
           "set_quant_param_attrs", "FUSED_LAYER_SHARDS"]

# Our fused layers and the checkpoint layers they stand for: an ignore list names `q_proj`, never `qkv_proj`.
FUSED_LAYER_SHARDS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


class QuantizationConfig:
    """One quantization method's settings, parsed from config.json's `quantization_config` (or built for an online
    method from `--quantization NAME` alone). Subclasses set `name` and implement `from_config` and
    `get_linear_method`; the rest has working defaults."""

    name: ClassVar[str] = ""
    # The oldest CUDA compute capability (major * 10 + minor) its GPU path runs on; None: any GPU.
    min_capability: ClassVar[Optional[int]] = None
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    # Activation dtypes it computes in (CPU runs fp32; the GPU kernels take fp16/bf16).
    supported_act_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.float16, torch.bfloat16)
    supports_lora: ClassVar[bool] = False
    # Whether an unquantized-modules entry naming a parent module keeps all its layers float (is_layer_skipped).
    ignore_parents: ClassVar[bool] = True
    # Checkpoint `quant_method` names this config reads (besides `name`).
    checkpoint_names: ClassVar[tuple[str, ...]] = ()
    # True for methods that quantize a float checkpoint at load time (fp8, int8): no quantization_config needed.
    online: ClassVar[bool] = False
    # (module under pagedllm.quantization, class name) of another config class that reads this method's
    # checkpoints (an online method's checkpoint format); None: this class
    checkpoint_reader: ClassVar[Optional[tuple[str, str]]] = None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "QuantizationConfig":
        """Parse (and validate, in one sentence per problem) the checkpoint's `quantization_config` dict."""
        raise NotImplementedError

    def get_linear_method(self, layer: nn.Module, prefix: str) -> Optional[LinearMethodBase]:
        """The method for the linear layer named `prefix` (e.g. `model.layers.0.self_attn.qkv_proj`), or None to
        keep it unquantized (a skipped module, or a layer kind the method does not cover)."""
        raise NotImplementedError

    def check_supported(self, device: torch.device, act_dtype: torch.dtype) -> None:
        """Raise ValueError (one sentence: what to change) if this method cannot run on `device` in `act_dtype`."""
        if device.type not in self.supported_devices:
            raise ValueError(f"Quantization method {self.name!r} does not run on {device.type}; use one of "
                             f"{', '.join(self.supported_devices)} or another checkpoint.")
        if device.type == "cuda" and self.min_capability is not None:
            major, minor = torch.cuda.get_device_capability(device)
            if major * 10 + minor < self.min_capability:
                raise ValueError(f"Quantization method {self.name!r} needs a GPU of compute capability >= "
                                 f"{self.min_capability / 10:.1f}, this one is {major}.{minor}; pick another "
                                 f"method or run on a newer GPU.")
        if act_dtype not in self.supported_act_dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in self.supported_act_dtypes)
            raise ValueError(f"Quantization method {self.name!r} does not compute in "
                             f"{str(act_dtype).replace('torch.', '')}; pass --dtype one of {names}.")

    def skipped_checkpoint_suffixes(self) -> tuple[str, ...]:
        """Checkpoint tensor suffixes the method reads no parameter from (loaded silently, not warned about)."""
        return ()

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


def is_layer_skipped(prefix: str, ignored: Iterable[str], parents: bool = True) -> bool:
    """Whether the layer `prefix` is in a checkpoint's list of unquantized modules.

    Entries are module names or name suffixes (`lm_head`, `model.layers.0.mlp.down_proj`, AWQ's `down_proj`) or
    compressed-tensors regexes (`re:.*lm_head`). A fused layer (`qkv_proj`) is skipped when all of its checkpoint
    layers are, or when the entry names the fused layer itself (Phi-3 checkpoints store qkv_proj / gate_up_proj
    as one module); only some of them is a checkpoint we cannot load fused, refused with a message. parents=False:
    an entry naming a parent module skips none of its layers (compressed-tensors quantizes the children of an
    ignored parent that its targets match)."""
    ignored = list(ignored or ())
    if not ignored:
        return False
    parent, _, leaf = prefix.rpartition(".")
    if leaf in FUSED_LAYER_SHARDS and _matches(prefix, ignored, parents):
        return True  # a checkpoint storing the layer fused (Phi-3's qkv_proj, gate_up_proj) names it whole
    names = [f"{parent}.{s}" if parent else s for s in FUSED_LAYER_SHARDS.get(leaf, (leaf,))]
    hits = [_matches(name, ignored, parents) for name in names]
    if all(hits):
        return True
    if any(hits):
        raise ValueError(f"The checkpoint quantizes only some of the layers fused into {prefix} "
                         f"({', '.join(n for n, h in zip(names, hits) if not h)}); pagedllm needs all or none.")
    return False


def config_int(what: str, config: dict[str, Any], key: str, default: int) -> int:
    """config[key] (default when absent) as an int, or a ValueError naming the setting: a null or a word there
    was a bare TypeError / "invalid literal for int()" from the parser."""
    value = config.get(key, default)
    try:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise TypeError
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} {key}={value!r} is not an integer.") from None


def config_names(value: Any) -> list[Any]:
    """A config's list of module names, where one name alone was written as a string: iterating that string
    read each of its characters as a module name."""
    return [value] if isinstance(value, str) else list(value or ())


def check_patterns(what: str, patterns: Iterable[str], prefix: str = "re:") -> None:
    """Refuse, naming the entry, a config's regular expression (`re:`-prefixed entries, or all with prefix="")
    that does not compile: matched only while the model is built, it failed there as a bare re.error."""
    for entry in patterns:
        if isinstance(entry, str) and entry.startswith(prefix):
            try:
                re.compile(entry[len(prefix):])
            except re.error as e:
                raise ValueError(f"{what} entry {entry!r} is not a valid regular expression ({e}).") from None


def _matches(name: str, ignored: list[str], parents: bool = True) -> bool:
    for entry in ignored:
        if entry.startswith("re:"):
            if re.fullmatch(entry[3:], name) or re.match(entry[3:], name):
                return True
        elif parents and ("." + entry + ".") in ("." + name + "."):  # the module itself, a suffix of it, a parent
            return True
        elif not parents and ("." + name).endswith("." + entry):  # the module itself or a suffix of its name
            return True
    return False


def set_quant_param_attrs(param: torch.Tensor, *, weight_loader: Any, input_dim: Optional[int] = None,
                          output_dim: Optional[int] = None, packed_dim: Optional[int] = None,
                          pack_factor: int = 1, per_shard: bool = False, optional: bool = False,
                          **extra: Any) -> torch.Tensor:
    """Tag a quantized parameter with how the linear layers' weight loaders must slice it.

    input_dim / output_dim: which dim of the stored tensor runs along the layer's input / output (None: that
        dim is not split by tensor parallelism or by merged layers; e.g. a [1, out] scale of group_size=-1).
    packed_dim, pack_factor: the dim holding `pack_factor` logical values per element (int32 with 8 x 4-bit);
        offsets and sizes along it are divided by it (AWQ packs the output dim, GPTQ's qweight the input dim).
    per_shard: one entry per logical shard (a per-tensor scale of each of q/k/v); shard i loads into row i.
    optional: a checkpoint may leave it out (e.g. GPTQ's g_idx without act-order); no "missing weight" error.
    """
    from pagedllm.layers.weight_utils import set_weight_attrs

    set_weight_attrs(param, {"weight_loader": weight_loader, "input_dim": input_dim, "output_dim": output_dim,
                             "packed_dim": packed_dim, "pack_factor": pack_factor, "per_shard": per_shard,
                             "optional_weight": optional, **extra})
    return param


def create_float_weight(layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                        params_dtype: torch.dtype, weight_loader) -> None:
    """The float weight the unquantized method has, for online methods that quantize it after loading."""
    weight = nn.Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
                          requires_grad=False)
    set_quant_param_attrs(weight, weight_loader=weight_loader, input_dim=1, output_dim=0)
    layer.register_parameter("weight", weight)
