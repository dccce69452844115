"""AWQ checkpoints (AutoAWQ's GEMM layout), loaded as they are on disk.

Per linear layer (K in, N out, G = K / group_size groups):
    qweight int32 [K, N / 8]   8 x 4-bit along N, logical column order[i] in bits [4i, 4i+4), order 0 2 4 6 1 3 5 7
    qzeros  int32 [G, N / 8]   the same packing; real zero points (no offset)
    scales  fp16  [G, N]
    w[n, k] = (q[k, n] - zero[k // group_size, n]) * scales[k // group_size, n]
Tensor parallelism: column-parallel layers split N (packed: offsets / 8), row-parallel ones split K (groups too).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from pagedllm.quantization.base import (QuantizationConfig, check_patterns, config_int, config_names, is_layer_skipped,
                                        set_quant_param_attrs)
from pagedllm.quantization.packed import check_group_size, pack_int32, unpack_int32
from pagedllm.quantization.packed_method import PackedIntLinearMethod

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


class AWQConfig(QuantizationConfig):
    name = "awq"
    supports_lora = True  # the LoRA wrappers add a float delta around apply(), whatever the base weight's storage

    def __init__(self, bits: int, group_size: int, zero_point: bool,
                 modules_to_not_convert: Optional[list[str]] = None) -> None:
        if bits != 4:
            raise ValueError(f"AWQ with bits={bits} is not supported; AWQ's GEMM format is 4-bit.")
        if not zero_point:
            raise ValueError("AWQ checkpoints without zero points (zero_point=false) are not supported; use a "
                             "checkpoint quantized with zero_point=true (AutoAWQ's default).")
        check_group_size("AWQ", group_size)
        self.bits = bits
        self.group_size = group_size
        self.zero_point = zero_point
        self.modules_to_not_convert = config_names(modules_to_not_convert)
        check_patterns("The AWQ modules_to_not_convert", self.modules_to_not_convert)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "AWQConfig":
        version = str(config.get("version", "gemm")).lower()
        # transformers' AwqConfig versions "exllama" / "ipex" pick kernels for GEMM-layout checkpoints (AutoAWQ:
        # "Exllama kernels only support GEMM version"); a checkpoint saved with one is GEMM on disk
        if version not in ("gemm", "exllama", "ipex"):
            raise ValueError(f"AWQ version {version!r} is not supported; pagedllm reads AutoAWQ's GEMM layout "
                             f"(version 'gemm').")
        return cls(bits=config_int("AWQ", config, "bits" if "bits" in config else "w_bit", 4),
                   group_size=config_int("AWQ", config, "group_size" if "group_size" in config else "q_group_size",
                                         128),
                   zero_point=bool(config.get("zero_point", True)),
                   modules_to_not_convert=config.get("modules_to_not_convert"))

    def get_linear_method(self, layer: nn.Module, prefix: str) -> Optional["AWQLinearMethod"]:
        if is_layer_skipped(prefix, self.modules_to_not_convert):
            return None
        return AWQLinearMethod(self)


class AWQLinearMethod(PackedIntLinearMethod):
    def __init__(self, config: AWQConfig) -> None:
        super().__init__(config.bits, config.group_size)
        self.config = config

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, weight_loader):
        pack = 32 // self.bits
        k, n = input_size_per_partition, sum(output_partition_sizes)
        group = self.config.group_size if self.config.group_size != -1 else k
        if k != input_size and self.config.group_size == -1:
            raise ValueError(f"AWQ layer {layer.prefix}: group_size=-1 cannot be split by tensor parallelism.")
        if k % group or k % pack:
            raise ValueError(f"AWQ layer {layer.prefix}: {k} inputs per rank is not a multiple of group_size "
                             f"{group}; use a smaller tensor-parallel size or another checkpoint.")
        if any(size % pack for size in output_partition_sizes):
            raise ValueError(f"AWQ layer {layer.prefix}: output sizes {output_partition_sizes} per rank are not "
                             f"multiples of {pack}; use a smaller tensor-parallel size.")
        self.group_size = group
        qweight = nn.Parameter(torch.empty(k, n // pack, dtype=torch.int32), requires_grad=False)
        set_quant_param_attrs(qweight, weight_loader=weight_loader, input_dim=0, output_dim=1, packed_dim=1,
                              pack_factor=pack)
        qzeros = nn.Parameter(torch.empty(k // group, n // pack, dtype=torch.int32), requires_grad=False)
        set_quant_param_attrs(qzeros, weight_loader=weight_loader, input_dim=0, output_dim=1, packed_dim=1,
                              pack_factor=pack)
        scales = nn.Parameter(torch.empty(k // group, n, dtype=params_dtype), requires_grad=False)
        set_quant_param_attrs(scales, weight_loader=weight_loader, input_dim=0, output_dim=1)
        for name, param in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
            layer.register_parameter(name, param)

    def convert(self, layer):
        q = unpack_int32(layer.qweight.data, self.bits, dim=1, order=AWQ_PACK_ORDER)  # [K, N]
        zeros = unpack_int32(layer.qzeros.data, self.bits, dim=1, order=AWQ_PACK_ORDER)  # [G, N]
        return pack_int32(q, self.bits, dim=0), layer.scales.data, zeros, None
