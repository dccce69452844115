"""The matmuls of the quantized linear methods: torch references (the CPU path: dequantize on the fly) and,
on CUDA, the Triton kernels where they apply. Each function computes `x @ dequant(W)^T + bias`."""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from pagedllm import envs
from pagedllm.kernels.tiled_layout import dequantize_tiled
from pagedllm.layers.activation import triton_kernels
from pagedllm.quantization.packed import dequantize_packed_kn


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """W8A16: qweight int8 [out, in], per-output-channel scale [out]."""
    out = F.linear(x, qweight.to(x.dtype)) * scale.to(x.dtype)
    return out if bias is None else out + bias


def packed_int_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                      bits: int, group_size: int, g_idx: Optional[torch.Tensor] = None,
                      bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """4/8-bit weight-only: the internal layout of `quantization/packed.py` (CUDA: the Triton dequant kernel)."""
    if x.is_cuda:
        kernels = triton_kernels("dequant_gemm")
        if kernels is not None:
            return kernels.dequant_matmul(x, qweight, scales, zeros, bits, group_size, g_idx, bias)

    w = dequantize_packed_kn(qweight, scales, zeros, bits, group_size, g_idx, dtype=x.dtype)  # [K, N]
    out = x @ w
    return out if bias is None else out + bias


def tiled_int_linear(x: torch.Tensor, layer: torch.nn.Module, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """4/8-bit weight-only over the tiled layout (`kernels/tiled_layout.py`): the CUDA-core GEMV up to
    layer.quant_gemv_max_rows rows, else the tensor-core kernel; the dense torch reference off CUDA / without
    Triton."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    args = (layer.qweight, layer.scales, layer.zeros, layer.quant_bits, layer.quant_group_size, layer.quant_perm)
    kernel = None
    if x.is_cuda:
        rows = x2.shape[0]
        name = "qgemv" if rows <= layer.quant_gemv_max_rows else "qgemm"
        module = triton_kernels(name)
        if module is not None:
            kernel = module.quant_gemv if name == "qgemv" else module.quant_gemm
    if kernel is not None:
        out = kernel(x2, *args, bias, layer.quant_counters)
    else:
        out = F.linear(x2, dequantize_tiled(*args, dtype=x.dtype), bias)
    return out.reshape(*shape[:-1], out.shape[-1])


def mma_int_linear(x: torch.Tensor, layer: torch.nn.Module, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """4-bit weight-only over the mma layout (`kernels/qgemv_mma.py`): on CUDA for fp16 / bf16 activations of the
    scales' dtype the tensor-core GEMV up to MMA_MAX_ROWS rows, above that the weight dequantized into a buffer and
    one cuBLAS GEMM (act-order: the activations permuted instead of the weight); else the dense torch reference."""
    from pagedllm.kernels.qgemv_mma import MMA_MAX_ROWS, dense_weight, dequantize_mma, quant_gemv_mma

    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    args = (layer.qweight, layer.scales, layer.zeros, layer.quant_group_size, layer.quant_perm)
    if x.is_cuda and x.dtype == layer.scales.dtype and x2.shape[0] > MMA_MAX_ROWS:
        if layer.quant_perm is not None:
            x2 = x2.index_select(1, layer.quant_perm)
        out = F.linear(x2, dense_weight(*args[:4]), bias)
    elif x.is_cuda and x.dtype == layer.scales.dtype:
        if x2.stride(-1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:
            x2 = x2.contiguous()
        out = quant_gemv_mma(x2, *args, bias)
    else:
        out = F.linear(x2, dequantize_mma(*args, dtype=x.dtype), bias)
    return out.reshape(*shape[:-1], out.shape[-1])


FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# Per-token scales are amax times these fp32 reciprocals (exact as Python floats): torch's CUDA division by a Python
# number multiplies by the reciprocal and its CPU division divides, so the product is spelled out to give the same
# bits on both devices and in the Triton kernels (kernels/quant_act.py).
FP8_INV_MAX = float(torch.tensor(1.0) / torch.tensor(FP8_MAX))
INT8_INV_MAX = float(torch.tensor(1.0) / torch.tensor(127.0))


def quantize_fp8_per_token(x: torch.Tensor, static_scale: Optional[torch.Tensor] = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (E4M3 [M, K], fp32 scale [M, 1]): dynamic per-token scales (or one static scale)."""
    if static_scale is not None:
        scale = static_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    elif x.is_cuda and envs.PAGEDLLM_FUSED_ACT_QUANT:
        from pagedllm.kernels.quant_act import fp8_per_token

        return fp8_per_token(x)  # one kernel, the same numbers
    else:
        scale = (x.abs().amax(dim=-1, keepdim=True).float() * FP8_INV_MAX).clamp(min=1e-12)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale.contiguous()


# Up to this many rows the CUDA FP8 product is the Triton GEMM (kernels/w8a8_gemm.py); above, torch._scaled_mm
# (cuBLAS), which is faster once the tiles fill the GPU but produces bf16 only (fp16 / fp32 models keep Triton).
FP8_TRITON_MAX_ROWS = 64


def take_prequantized(layer: torch.nn.Module, x: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(x_q, x_scale) of x where the RMSNorm that produced x quantized it for this W8A8 layer (kernels/norm.
    rms_norm_quant; the norm is linked by layers/layernorm.link_norm_quant), else None. The norm leaves its output
    tensor beside them, so they are taken for that very tensor only, and never twice."""
    pre = layer.__dict__.pop("_prequantized", None)
    return pre[1] if pre is not None and pre[0] is x else None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: Optional[torch.Tensor] = None, input_scale: Optional[torch.Tensor] = None,
               counters: Optional[torch.Tensor] = None, backend: Optional[str] = None,
               prequantized: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """W8A8 FP8: weight E4M3 [N, K] with fp32 per-channel scale [N]; activations quantized per token.
    CUDA: the Triton FP8 GEMM (scales and bias in its epilogue; `counters` the layer's split-K counters) up to
    FP8_TRITON_MAX_ROWS rows and at every size for fp16 / fp32 activations, one torch._scaled_mm (row-wise scales,
    bf16 out) above; backend "triton" / "scaled_mm" forces one (benchmarks, tests). Elsewhere the same
    arithmetic, emulated in fp32. prequantized: x's (E4M3 [M, K], scale [M, 1]) already made (`take_prequantized`)."""
    if backend not in (None, "triton", "scaled_mm"):
        raise ValueError(f"unknown FP8 GEMM backend {backend!r} (triton, scaled_mm)")
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    x_q, x_scale = prequantized if prequantized is not None else quantize_fp8_per_token(x2, input_scale)
    if x.is_cuda:
        triton_gemm = backend == "triton" or (backend is None and (x2.shape[0] <= FP8_TRITON_MAX_ROWS
                                                                    or x.dtype != torch.bfloat16))
        if triton_gemm and triton_kernels("w8a8_gemm") is not None:
            from pagedllm.kernels.w8a8_gemm import w8a8_gemm

            out = w8a8_gemm(x_q, x_scale, weight, weight_scale, bias, x.dtype, counters)
        else:
            out = torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=weight_scale.reshape(1, -1),
                                   out_dtype=x.dtype, bias=bias)
    else:
        out = (x_q.float() @ weight.float().t()) * x_scale * weight_scale.reshape(1, -1)
        out = out.to(x.dtype) if bias is None else (out + bias.float()).to(x.dtype)
    return out.reshape(*shape[:-1], weight.shape[0])


def quantize_int8_per_token(x: torch.Tensor, static_scale: Optional[torch.Tensor] = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], fp32 scale [M, 1]), symmetric: scale = amax / 127 (as vLLM's dynamic int8).
    compressed-tensors' own fake quantization divides by 127.5, which puts every token's largest negative value
    exactly on a rounding boundary (-127.5), so the last bit of the input decides it; 127 avoids that."""
    if static_scale is not None:
        scale = static_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    else:
        scale = (x.abs().amax(dim=-1, keepdim=True).float() * INT8_INV_MAX).clamp(min=1e-12)
    return torch.round(x.float() / scale).clamp(-128, 127).to(torch.int8), scale.contiguous()


def int8_w8a8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: Optional[torch.Tensor] = None, input_scale: Optional[torch.Tensor] = None,
                     counters: Optional[torch.Tensor] = None,
                     prequantized: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """W8A8 INT8: weight int8 [N, K] with fp32 per-channel scale [N]; activations quantized per token (or by one
    static scale). CUDA: two Triton kernels (kernels/quant_act.int8_per_token, kernels/w8a8_gemm: int8 tensor cores,
    the scales in the epilogue; `counters` the layer's split-K counters), or the GEMM alone on `prequantized`
    (`take_prequantized`); elsewhere the same arithmetic in torch."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if int8_cuda_path(x.device):
        from pagedllm.kernels.w8a8_gemm import w8a8_gemm
        from pagedllm.kernels.quant_act import int8_per_token

        x_q, x_scale = prequantized if prequantized is not None else int8_per_token(x2, input_scale)
        out = w8a8_gemm(x_q, x_scale, weight, weight_scale, bias, x.dtype, counters)
        return out.reshape(*shape[:-1], weight.shape[0])
    return int8_w8a8_linear_torch(x2, weight, weight_scale, bias, input_scale).reshape(*shape[:-1], weight.shape[0])


def int8_cuda_path(device: torch.device) -> bool:
    """Whether `int8_w8a8_linear` runs its Triton kernels on `device`."""
    return device.type == "cuda" and _int8_tensor_cores(device) and triton_kernels("w8a8_gemm") is not None


@functools.lru_cache(maxsize=None)
def _int8_tensor_cores(device: torch.device) -> bool:
    """Triton's int8 dot is built for compute capability 8.0 and up; older GPUs keep the torch form."""
    return torch.cuda.get_device_capability(device)[0] >= 8


def int8_w8a8_linear_torch(x2: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                           bias: Optional[torch.Tensor] = None, input_scale: Optional[torch.Tensor] = None
                           ) -> torch.Tensor:
    """The torch form of `int8_w8a8_linear` for x2 [M, K]: torch._int_mm and elementwise ops."""
    x_q, x_scale = quantize_int8_per_token(x2, input_scale)
    rows = x_q.shape[0]
    if x2.is_cuda and rows <= 16:  # cuBLAS int8 GEMM needs more than 16 rows
        x_q = F.pad(x_q, (0, 0, 0, 32 - rows))
    acc = torch._int_mm(x_q, weight.t())[:rows]
    out = acc.float() * x_scale * weight_scale.reshape(1, -1)
    out = out if bias is None else out + bias.float()
    return out.to(x2.dtype)
