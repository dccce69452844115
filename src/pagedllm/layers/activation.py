"""Activations used by the gated MLPs (output of the fused gate_up projection -> MLP hidden)."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import envs
from pagedllm.kernels import cpu_ops

_TRITON_MODULES: dict[str, Optional[Any]] = {}


def triton_kernels(module: str) -> Optional[Any]:
    """`pagedllm.kernels.<module>` when Triton kernels are enabled and importable, else None (cached).

    Shared by the layers of this package: on CUDA tensors they call the fused Triton kernel, elsewhere (CPU,
    no triton, PAGEDLLM_USE_TRITON_KERNELS=0) the plain-torch `forward_native` with the same numerics.
    """
    if module not in _TRITON_MODULES:
        loaded = None
        if envs.PAGEDLLM_USE_TRITON_KERNELS:
            try:
                import importlib
                loaded = importlib.import_module(f"pagedllm.kernels.{module}")
            except Exception:  # no triton (CPU installs) or an unsupported platform
                loaded = None
        _TRITON_MODULES[module] = loaded
    return _TRITON_MODULES[module]


class SiluAndMul(nn.Module):
    """x = [gate | up] along the last dim -> silu(gate) * up.  [..., 2 * d] -> [..., d]"""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            kernels = triton_kernels("activation")
            if kernels is not None:
                return kernels.silu_and_mul(x)
        else:
            out = _cpu_gated(x, "silu_and_mul")
            if out is not None:
                return out
        return self.forward_native(x)

    @staticmethod
    def forward_native(x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


def _cpu_gated(x: torch.Tensor, op: str) -> Optional[torch.Tensor]:
    """[gate | up] through the C++ CPU kernel `op` (2-D, last dim contiguous), or None where it does not apply."""
    if x.dim() != 2 or x.stride(-1) != 1:
        return None
    ops = cpu_ops.usable(x)
    if ops is None:
        return None
    out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype)
    getattr(ops, op)(out, x)
    return out


class GeluAndMul(nn.Module):
    """[gate | up] -> gelu(gate) * up (tanh approximation when `approximate="tanh"`)."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # CPU, tanh form (Gemma): one C++ kernel, the one the fused CPU decode stack runs too.
        if self.approximate == "tanh" and not x.is_cuda:
            out = _cpu_gated(x, "gelu_tanh_and_mul")
            if out is not None:
                return out
        return self.forward_native(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]


_GATED_ACTIVATIONS = {"silu": SiluAndMul, "swish": SiluAndMul,
                      "gelu": GeluAndMul, "gelu_pytorch_tanh": lambda: GeluAndMul("tanh")}


def get_gated_act_fn(hidden_act: str) -> nn.Module:
    """The `...AndMul` module for a HF config's `hidden_act`; ValueError if unsupported."""
    if hidden_act not in _GATED_ACTIVATIONS:
        raise ValueError(f"Activation {hidden_act!r} is not supported; supported: {sorted(_GATED_ACTIVATIONS)}.")
    return _GATED_ACTIVATIONS[hidden_act]()
