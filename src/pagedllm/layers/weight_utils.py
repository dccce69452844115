"""Parameter-level weight helpers the layers use: loading metadata on parameters, the checked copy of a
checkpoint tensor into a parameter, and building modules in a dtype. Layers sit below models, so these live
here; the checkpoint-file plumbing (finding, iterating, the name-mapping loop) is in models/weight_utils.py.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch


def set_weight_attrs(param: torch.Tensor, attrs: Optional[dict[str, Any]]) -> None:
    """Attach loading metadata (`weight_loader`, `input_dim`, `output_dim`, ...) to a parameter."""
    for key, value in (attrs or {}).items():
        if hasattr(param, key) and key != "weight_loader":
            raise AttributeError(f"Overwriting existing tensor attribute {key!r}.")
        setattr(param, key, value)


# Dtypes only quantized checkpoints store weights in (with scales beside them).
_QUANTIZED_DTYPES = (torch.int8, torch.uint8) + tuple(
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n))


def copy_weight(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy a checkpoint tensor into a parameter (slice), casting dtype and moving device."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"shape mismatch: the checkpoint has {tuple(src.shape)}, the model expects "
                         f"{tuple(dst.shape)}")
    if src.dtype in _QUANTIZED_DTYPES and dst.is_floating_point() and dst.dtype not in _QUANTIZED_DTYPES:
        # FP8 / int8 values cast to float without the scale they need: garbage out, only an "Ignoring" warning
        raise ValueError(f"the checkpoint stores it in {str(src.dtype).replace('torch.', '')}, the model reads it "
                         f"as an unquantized {str(dst.dtype).replace('torch.', '')} tensor; the checkpoint's "
                         f"quantization config (config.json's quantization_config, hf_quant_config.json) is missing "
                         f"or leaves this layer unquantized")
    dst.copy_(src)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
    """For parameters that are the same on every rank (norms, ...)."""
    if loaded_weight.dim() == 0 and param.numel() == 1:  # scalars saved as [] vs [1]
        loaded_weight = loaded_weight.reshape(param.shape)
    copy_weight(param.data, loaded_weight)


@contextlib.contextmanager
def set_default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build modules whose parameters default to `dtype`."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
