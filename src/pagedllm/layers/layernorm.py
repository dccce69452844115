"""RMSNorm, optionally fused with the residual add that precedes it (vLLM style)."""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from pagedllm import envs
from pagedllm.kernels import cpu_ops
from pagedllm.layers.activation import triton_kernels
from pagedllm.layers.weight_utils import default_weight_loader, set_weight_attrs


# Whether link_norm_quant links norms to the W8A8 layers they feed (False: each layer quantizes its own input, one
# kernel more per layer; the same numbers).
FUSE_NORM_QUANT = True


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), normalized in float32 and cast back before the scale (as HF).

    `forward(x)` returns y. `forward(x, residual)` first forms `x + residual` (the decoder layer's residual
    stream) and returns `(norm(x + residual), x + residual)`, so layers never materialize the add twice.
    """

    # The weight's product taken in float32 and rounded once (Gemma), not after rounding x / rms(x) (Llama).
    fp32_product = False
    # The module this norm's output feeds alone, when it has input-side work the norm kernel can do
    # (`norm_and_shrink(norm, x, residual)`): LoRA's shrink (set by lora/manager.py), a MoE block's router
    # (models/moe.MoEDecoderLayer).
    shrink_consumer = None
    # The W8A8 layer this norm's output feeds alone: on CUDA the norm kernel also quantizes its output per token
    # into quant_dtype for it (kernels/norm.rms_norm_quant), which the layer takes instead of quantizing; both set
    # by link_norm_quant (the layer method's choice, made once at load).
    quant_consumer = None
    quant_dtype = None
    # The unquantized linear layer this norm's output feeds alone: at one-row decode steps on CUDA its GEMV computes
    # this norm too (LinearBase.norm_and_gemv); set by link_norm_gemv.
    gemv_consumer = None

    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype or torch.get_default_dtype()),
                                   requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": default_weight_loader})

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
                ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        # x, residual: [..., hidden_size] in the model dtype. CUDA: one Triton kernel; CPU: one C++ kernel
        # (kernels/csrc/cpu_ops.cpp) instead of ~7 elementwise ops each.
        if x.is_cuda:
            if self.shrink_consumer is not None:
                fused = self.shrink_consumer.norm_and_shrink(self, x, residual)
                if fused is not None:
                    return fused
            if self.quant_consumer is not None:
                fused = self._norm_and_quantize(x, residual)
                if fused is not None:
                    return fused
            if self.gemv_consumer is not None and self.shrink_consumer is None:
                fused = self.gemv_consumer.norm_and_gemv(self, x, residual)
                if fused is not None:
                    return fused
            kernels = triton_kernels("norm")  # one fused kernel instead of ~7 elementwise ones
            if kernels is not None:
                if residual is None:
                    return kernels.rms_norm(x, self.weight, self.variance_epsilon, self.fp32_product)
                return kernels.fused_add_rms_norm(x, residual, self.weight, self.variance_epsilon,
                                                  self.fp32_product)
        elif x.dim() == 2 or (x.dim() == 3 and residual is None):
            ops = cpu_ops.usable(x)
            if ops is not None and self.weight.dtype == x.dtype and x.stride(-1) == 1 and (residual is None or (
                    residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1)):
                out = torch.empty(x.shape, dtype=x.dtype)
                if residual is None:
                    ops.rms_norm(out, x, self.weight, self.variance_epsilon)
                    return out
                new_residual = torch.empty(x.shape, dtype=x.dtype)
                ops.add_rms_norm(out, new_residual, x, residual, self.weight, self.variance_epsilon)
                return out, new_residual
        return self.forward_native(x, residual)

    def _norm_and_quantize(self, x: torch.Tensor, residual: Optional[torch.Tensor]):
        """The CUDA norm whose kernel also quantizes its output for `quant_consumer` (left on that layer, with the
        output it belongs to: quantization.kernels.take_prequantized); None where that does not apply."""
        kernels = triton_kernels("norm")
        if kernels is None or (residual is not None and residual.shape != x.shape):
            return None
        out, new_residual, quantized = kernels.rms_norm_quant(x, residual, self.weight, self.variance_epsilon,
                                                              self.fp32_product, self.quant_dtype)
        self.quant_consumer.__dict__["_prequantized"] = (out, quantized)
        return out if residual is None else (out, new_residual)

    def forward_native(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
                       ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        x, residual, xf = self._add_and_normalize(x, residual)
        out = self.weight * xf.to(x.dtype)
        return out if residual is None else (out, residual)

    def _add_and_normalize(self, x: torch.Tensor, residual: Optional[torch.Tensor]
                           ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        """(x + residual, the new residual (None without one), x / rms(x) in float32): what every RMSNorm does
        before its weight, which the subclasses apply in their own dtype."""
        if residual is not None:
            x = x + residual
            residual = x
        xf = x.to(torch.float32)
        return x, residual, xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}"


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm (Gemma 2 / 3, incl. their per-head q/k norms): y = (x / rms(x)) * (1 + w), the product taken
    in float32 and only then cast to the input dtype (HF's Gemma*RMSNorm; Llama's casts before the product).

    The checkpoint holds w; the parameter holds 1 + w in float32 (the loader adds 1 to w rounded to the model dtype,
    as HF computes `1.0 + weight.float()`), so the fused kernels apply it as a plain RMSNorm weight: in float32
    models on every device; on CUDA in every dtype through the Triton kernel's float32 product (`fp32_product`).
    Other dtypes on the CPU take the float32 product in torch (the C++ kernel rounds x / rms(x) to the activation
    dtype before the weight)."""

    fp32_product = True  # RMSNorm.forward: the Triton kernels' float32 product; the CPU kernel needs x in float32

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        self.model_dtype = torch.get_default_dtype()
        super().__init__(hidden_size, eps, params_dtype=torch.float32)
        set_weight_attrs(self.weight, {"weight_loader": self._load_offset_weight})

    def _load_offset_weight(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        default_weight_loader(param, loaded_weight.to(self.model_dtype).to(torch.float32) + 1.0)

    def forward_native(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
                       ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        x, residual, xf = self._add_and_normalize(x, residual)
        out = (xf * self.weight).to(x.dtype)
        return out if residual is None else (out, residual)


def is_plain_rms_norm(module: nn.Module) -> bool:
    """An RMSNorm running RMSNorm.forward (no subclass forward): its CUDA kernel can take a consumer's
    input-side work (`shrink_consumer`)."""
    return isinstance(module, RMSNorm) and type(module).forward is RMSNorm.forward


def fed_norms(model: nn.Module):
    """(norm, layer) for every RMSNorm whose output is one layer's input alone (each decoder layer's `norm_feeds`),
    where the norm is a plain RMSNorm forward (its kernel can do the layer's input-side work)."""
    for module in model.modules():
        feeds = getattr(module, "norm_feeds", None)
        if not callable(feeds):
            continue
        for norm_path, layer_path in feeds():
            try:
                norm, layer = module.get_submodule(norm_path), module.get_submodule(layer_path)
            except AttributeError:  # e.g. a MoE block where a dense MLP would be
                continue
            if is_plain_rms_norm(norm):
                yield norm, layer


def link_norm_quant(model: nn.Module) -> int:
    """Point each RMSNorm whose output feeds one W8A8 layer alone (`fed_norms`) at that layer, where the layer's
    method takes its input quantized by the norm (`norm_quant_dtype`: dynamic per-token activations on CUDA): the
    norm kernel then quantizes too, and the layer skips its own quantization kernel. Returns how many were linked."""
    if not FUSE_NORM_QUANT:
        return 0
    linked = 0
    for norm, layer in fed_norms(model):
        wants = getattr(getattr(layer, "linear_method", None), "norm_quant_dtype", None)
        dtype = wants(layer) if callable(wants) else None
        if dtype is not None:
            norm.__dict__["quant_consumer"] = layer  # a plain reference, not a submodule of the norm
            norm.__dict__["quant_dtype"] = dtype
            linked += 1
    return linked


def link_norm_gemv(model: nn.Module) -> int:
    """Point each RMSNorm whose output feeds one unquantized linear layer alone (`norm_feeds`) at that layer, so that
    at one-row decode steps on CUDA the layer's GEMV computes the norm as well (one launch instead of two; the
    product gated with SiLU where the MLP fuses it; PAGEDLLM_NORM_GEMV=0 turns it off). Returns how many linked."""
    if not envs.PAGEDLLM_NORM_GEMV:
        return 0
    from pagedllm.layers.linear import ColumnParallelLinear, UnquantizedLinearMethod

    linked = 0
    for module in model.modules():
        feeds = getattr(module, "norm_feeds", None)
        if not callable(feeds):
            continue
        for norm_path, layer_path in feeds():
            parent_path = layer_path.rpartition(".")[0]
            try:
                norm, layer = module.get_submodule(norm_path), module.get_submodule(layer_path)
                parent = module.get_submodule(parent_path) if parent_path else module
            except AttributeError:  # e.g. a MoE block where a dense MLP would be
                continue
            if (not is_plain_rms_norm(norm) or norm.quant_consumer is not None
                    or not isinstance(layer, ColumnParallelLinear)
                    or type(layer.linear_method) is not UnquantizedLinearMethod):
                continue
            # The MLP asks for silu(gate) * up in one kernel (LlamaMLP.fuse_silu): the norm's GEMV is that one.
            gated = bool(getattr(parent, "fuse_silu", False)) and getattr(parent, "gate_up_proj", None) is layer
            norm.__dict__["gemv_consumer"] = layer  # a plain reference, not a submodule of the norm
            layer.__dict__["norm_gemv_gated"] = gated
            linked += 1
    return linked
