"""`--quantization gguf` on CPU: a .gguf model's weights stay in their GGUF block formats in memory.

Linear layers whose checkpoint tensors are all of a type the C++ kernels multiply directly (Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1, Q4_K, Q5_K, Q6_K; kernels/csrc/gguf_ops.cpp) get `GGUFLinearMethod`: the packed rows of each shard
(q/k/v, gate/up) are kept as uint8 [rows, row_bytes] buffers, one part per type, and `apply` runs one kernel
call over all parts (activations quantized to int8 once). The token embedding and the LM head are kept packed
the same way (`prepare_model`): the embedding dequantizes only the rows it looks up. Tensors of other types
(F16, Q2_K, IQ*, ...) are dequantized at load as before, with a log line naming them.

The weights are read from the .gguf itself (`weights_iterator`), not from the float32 conversion; the
converted directory still supplies config.json and the tokenizer. The default for a .gguf on CPU; on CUDA the
model is dequantized at load (there are no GPU GGUF kernels yet).
"""
from __future__ import annotations

import collections
import logging
import os
from typing import Any, Iterator, Optional

import torch
from torch import nn

from pagedllm.kernels.cpu_ops import cpu_ops
from pagedllm.kernels.gguf_ops import gguf_matmul, logical_rows, required_ops, tile_packed, widen_packed
from pagedllm.layers.linear import LinearMethodBase, MergedColumnParallelLinear, QKVParallelLinear
from pagedllm.layers.weight_utils import set_weight_attrs
from pagedllm.quantization.base import QuantizationConfig

logger = logging.getLogger("pagedllm")

_FUSED_SHARDS = {"qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
                 "gate_up_proj": (("gate_proj", 0), ("up_proj", 1))}


class GGUFLinearMethod(LinearMethodBase):
    """The layer's packed GGUF rows: parts [rows_i, row_bytes_i] uint8 with their GGML types, side by side."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, weight_loader):
        # A placeholder the checkpoint's tensors are "loaded into": its loader keeps the packed shards.
        weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        set_weight_attrs(weight, {"weight_loader": self._load_shard})
        layer.register_parameter("weight", weight)
        layer.__dict__["_gguf_pending"] = {}
        layer.__dict__["_gguf_layer"] = (input_size_per_partition, list(output_partition_sizes))
        weight.__dict__["_gguf_owner"] = layer

    @staticmethod
    def _load_shard(param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        qtype = getattr(loaded, "gguf_type", None)
        if qtype is None:
            raise ValueError("this layer keeps GGUF blocks and needs the packed tensor from the .gguf file")
        param.__dict__["_gguf_owner"].__dict__["_gguf_pending"][shard_id] = (loaded, int(qtype))

    def process_weights_after_loading(self, layer):
        pending = layer.__dict__.pop("_gguf_pending", {})
        k, sizes = layer.__dict__["_gguf_layer"]
        if isinstance(layer, QKVParallelLinear):
            order: tuple = ("q", "k", "v")
        elif isinstance(layer, MergedColumnParallelLinear):
            order = tuple(range(len(sizes)))
        else:
            order = (None,)
        parts, types = [], []
        if None in pending and len(order) > 1:  # a fused checkpoint tensor (Phi-3's attn_qkv, ffn_up)
            order, sizes = (None,), [sum(sizes)]
        for shard, rows in zip(order, sizes):
            tensor, qtype = pending[shard]
            if tensor.shape[0] != rows:
                raise ValueError(f"{layer.prefix}: the GGUF tensor has {tensor.shape[0]} rows, the model expects "
                                 f"{rows}")
            tensor, qtype = widen_packed(tensor, qtype)
            if types and types[-1] == qtype:  # same format: one contiguous part (better thread split)
                parts[-1] = torch.cat([parts[-1], tensor])
            else:
                parts.append(tensor)
                types.append(qtype)
        for i, (part, qtype) in enumerate(zip(parts, types)):
            part, types[i] = tile_packed(part.contiguous(), qtype)
            layer.register_buffer(f"gguf_part{i}", part, persistent=False)
        layer.__dict__["_gguf_types"] = types
        layer.__dict__["_gguf_out"] = sum(sizes)
        layer.__dict__["gguf_numel"] = k * sum(sizes)  # logical weights, for the parameter count

    def parts(self, layer) -> list[torch.Tensor]:
        return [getattr(layer, f"gguf_part{i}") for i in range(len(layer.__dict__["_gguf_types"]))]

    def apply(self, layer, x, bias=None):
        return gguf_matmul(x, self.parts(layer), layer.__dict__["_gguf_types"], bias, layer.__dict__["_gguf_out"])

    def dequantized_weight(self, layer):
        k = layer.__dict__["_gguf_layer"][0]
        rows = []
        for part, qtype in zip(self.parts(layer), layer.__dict__["_gguf_types"]):
            out = torch.empty(logical_rows(part, qtype), k, dtype=torch.float32)
            required_ops().gguf_dequantize_rows(out, part, qtype, None)
            rows.append(out)
        return torch.cat(rows)


class GGUFConfig(QuantizationConfig):
    """Keeps a .gguf's tensors packed where the CPU kernels handle their type. Built by the engine for a .gguf
    model on CPU (the default there) or by `--quantization gguf`; `source` is the .gguf path."""

    name = "gguf"
    supported_devices = ("cpu",)
    supported_act_dtypes = (torch.float32, torch.bfloat16)
    online = True

    def __init__(self, source: Optional[str] = None) -> None:
        self.source = source
        self.tensor_types: dict[str, int] = {}
        if source is not None:
            from pagedllm.models.gguf_packed import gguf_tensor_types, packed_type_ids
            self.tensor_types = gguf_tensor_types(source)
            self._packable = packed_type_ids()
            self._log_dequantized()

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "GGUFConfig":
        return cls(config.get("gguf_path"))

    def _log_dequantized(self) -> None:
        from gguf import GGMLQuantizationType as Q
        kinds = collections.Counter(Q(t).name for n, t in self.tensor_types.items()
                                    if t not in self._packable and n.endswith(".weight") and "norm" not in n)
        if kinds:
            logger.info("GGUF: %s weight tensor(s) of type(s) %s have no packed CPU kernel; they (and the tensors "
                        "fused with them) are dequantized at load.", sum(kinds.values()),
                        ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items())))

    def _checkpoint_names(self, prefix: str) -> list[str]:
        parent, _, leaf = prefix.rpartition(".")
        shards = _FUSED_SHARDS.get(leaf)
        if shards is None or f"{prefix}.weight" in self.tensor_types:  # stored fused (Phi-3)
            return [f"{prefix}.weight"]
        return [f"{parent}.{name}.weight" for name, _ in shards]

    def keeps(self, name: str) -> bool:
        """Whether the checkpoint tensor `name` stays packed: its type has a kernel, and so do the types of all
        the tensors fused with it into one layer (q/k/v, gate/up)."""
        if not self.source or self.tensor_types.get(name) not in self._packable:
            return False
        module, _, suffix = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        for shards in _FUSED_SHARDS.values():
            names = [shard for shard, _ in shards]
            if leaf in names:
                return all(self.tensor_types.get(f"{parent}.{n}.{suffix}") in self._packable for n in names)
        return True

    def get_linear_method(self, layer: nn.Module, prefix: str) -> Optional[LinearMethodBase]:
        if getattr(layer, "tp_size", 1) != 1 or not self.source:
            return None
        names = self._checkpoint_names(prefix)
        return GGUFLinearMethod() if all(self.keeps(n) for n in names) else None

    # ---- hooks the loader calls (models/loader.py)

    def prepare_model(self, model: nn.Module) -> None:
        """Swap the embedding's (and the LM head's) float parameter for a placeholder that keeps packed rows."""
        from pagedllm.distributed.pipeline import PPMissingLayer

        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        head = getattr(model, "lm_head", None)
        # (pipeline stages: the first holds the embedding, the last the head; the other is a placeholder)
        embed, head = (None if isinstance(m, PPMissingLayer) else m for m in (embed, head))
        tied = head is not None and embed is not None and head.weight is embed.weight
        # A last stage without the embedding loads a tied head from the embedding's tensor: packed the same way.
        head_name = ("model.embed_tokens.weight" if embed is None and getattr(model, "tie_word_embeddings", False)
                     else "lm_head.weight")
        for module, name in ((embed, "model.embed_tokens.weight"), (None if tied else head, head_name)):
            if module is None or not self.keeps(name) or module.tp_size != 1:
                continue
            targets = [module] + ([head] if tied and module is embed else [])
            placeholder = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)

            def loader(param, loaded, shard_id=None, targets=targets):
                if getattr(loaded, "gguf_type", None) is None:
                    raise ValueError("expected the packed tensor from the .gguf file")
                if loaded.shape[0] != targets[0].org_vocab_size:
                    raise ValueError(f"the GGUF tensor has {loaded.shape[0]} rows, the model expects "
                                     f"{targets[0].org_vocab_size}")
                packed, qtype = tile_packed(loaded, int(loaded.gguf_type))
                for t in targets:
                    t.register_buffer("gguf_weight", packed, persistent=False)
                    t.__dict__["gguf_type"] = qtype
                targets[0].__dict__["gguf_numel"] = targets[0].org_vocab_size * targets[0].embedding_dim

            set_weight_attrs(placeholder, {"weight_loader": loader})
            for t in targets:
                t.__dict__["gguf_dtype"] = t.weight.dtype
                t.weight = placeholder

    def weights_iterator(self, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
        from pagedllm.models.gguf_packed import iter_gguf_weights
        return iter_gguf_weights(self.source, hf_config, lambda name, qtype: self.keeps(name))


def packed_weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of packed GGUF buffers, bytes of float parameters), each tensor counted once."""
    seen: set[int] = set()
    packed = dense = 0
    for name, t in list(model.named_buffers()) + list(model.named_parameters()):
        if id(t) in seen or t.numel() == 0:
            continue
        seen.add(id(t))
        if t.dtype == torch.uint8 and name.rsplit(".", 1)[-1].startswith("gguf_"):
            packed += t.numel()
        elif t.is_floating_point():
            dense += t.numel() * t.element_size()
    return packed, dense


def engine_quant_config(args: Any, hf_config: Any, model_path: str, model_dir: str, device: torch.device,
                        dtype: torch.dtype) -> Optional[QuantizationConfig]:
    """The engine's quantization config: GGUF blocks kept packed when the user's model is a .gguf on CPU (the
    default there; `--quantization gguf` also takes the directory converted from one), `--quantization none`
    to dequantize at load, else the seam's own resolution."""
    from pagedllm.models.gguf_packed import gguf_source_path
    from pagedllm.quantization import checkpoint_quant_config, normalize_method_name, quant_config_for_engine

    method = normalize_method_name(args.quantization) if args.quantization else None
    if method == "none":
        ckpt = checkpoint_quant_config(hf_config, model_dir)
        if ckpt:  # (a float model was built for packed tensors: "missing ...weight" named no cause)
            raise ValueError(f"--quantization none cannot load this checkpoint: its weights are quantized with "
                             f"{ckpt.get('quant_method') or 'an unnamed method'!r} (its quantization config); drop "
                             f"--quantization to read them as they are.")
        return None
    source = gguf_source_path(model_dir)
    if method is None and model_path is not None and os.path.isfile(os.path.join(model_path, "config.json")):
        source = None  # a Hugging Face directory given as such keeps its float weights by default
    if method == "gguf":
        if source is None:
            raise ValueError("--quantization gguf needs a .gguf model (it keeps the file's quantized blocks); "
                             "for a Hugging Face checkpoint use --quantization int8 or drop the flag.")
        if args.load_format == "dummy":
            raise ValueError("--quantization gguf reads the .gguf's weights; it cannot be combined with "
                             "load_format='dummy'.")
        if getattr(args, "enable_lora", False):
            raise ValueError("LoRA is not supported on GGUF weights kept packed; drop --quantization gguf (the "
                             "model is then dequantized at load) or --enable-lora.")
        if getattr(args, "tensor_parallel_size", 1) != 1:
            raise ValueError("--quantization gguf runs on one CPU process (tensor_parallel_size 1); drop it to "
                             "dequantize the model at load for tensor parallelism.")
        config = GGUFConfig(source)
        config.check_supported(device, dtype)
        required_ops()
        return config
    if method is None and source is not None and device.type == "cpu" and args.load_format != "dummy":
        reason = None
        if dtype not in GGUFConfig.supported_act_dtypes:
            reason = f"--dtype {str(dtype).replace('torch.', '')}"
        elif getattr(args, "enable_lora", False):
            reason = "--enable-lora"
        elif getattr(args, "tensor_parallel_size", 1) != 1:
            reason = "tensor parallelism"
        elif cpu_ops() is None:
            reason = "the CPU kernels are unavailable"
        if reason is None:
            return GGUFConfig(source)
        logger.info("GGUF weights are dequantized at load (%s); the packed CPU path needs float32/bfloat16, no "
                    "LoRA and the CPU kernels.", reason)
    return quant_config_for_engine(args, hf_config, model_dir, device, dtype)
