"""Per-layer scales of an FP8 (E4M3) KV cache: the cache holds K / k_scale and V / v_scale.

Where they come from, in order:
- the checkpoint, under the names FP8 exporters write (vLLM's `self_attn.k_scale` / `v_scale`, llm-compressor's
  `self_attn.k_proj.output_scale` / `v_proj.output_scale`, ModelOpt's `k_proj.k_scale` / `v_proj.v_scale`, and
  AutoFP8's single `kv_scale` for both);
- else the amax of this layer's real K and V in the engine's first step (which holds the first prompt), mapped to
  K_AMAX_TARGET / V_AMAX_TARGET: below E4M3's 448, so later tokens a few times larger still fit (beyond that they
  saturate), and far above its smallest normal (2**-6), so small values keep 3 mantissa bits instead of becoming
  subnormals. With scale 1 that is not so: many of a small model's V values lie below 2**-6 (docs/benchmarks.md,
FP8 KV cache).
Scales are a float32 [2] device tensor per layer (k, v), read by the kernels at run time: the CUDA graphs captured
before calibration pick up the calibrated values. PAGEDLLM_KV_SCALES=0 leaves K and V unscaled (A/B).
"""
from __future__ import annotations

import re
from typing import Optional

import torch

K_AMAX_TARGET = 200.0
V_AMAX_TARGET = 100.0
_MIN_SCALE = 1e-6

_CKPT_NAME = re.compile(r"^(?P<attn>.*\.self_attn)\.(?:(?P<proj>[qkv])_proj\.)?"
                        r"(?P<kind>k_scale|v_scale|kv_scale|q_scale|output_scale)$")


def checkpoint_kv_scale(name: str) -> Optional[tuple[str, str]]:
    """For a checkpoint tensor holding a KV-cache scale: (the attention module's name, which of "k", "v", "kv", or
    "q" for a query scale, which the cache does not use); None for any other tensor."""
    match = _CKPT_NAME.match(name)
    if match is None:
        return None
    kind, proj = match.group("kind"), match.group("proj")
    if kind == "output_scale":
        if proj is None:
            return None
        which = proj
    else:
        which = {"k_scale": "k", "v_scale": "v", "kv_scale": "kv", "q_scale": "q"}[kind]
    return f"{match.group('attn')}.attn", which


def load_checkpoint_kv_scale(modules: dict, name: str, tensor: torch.Tensor) -> bool:
    """Load `tensor` into its attention layer if `name` is a KV-cache scale; returns whether it was one (a scale
    of a layer this rank does not hold, or a query scale, is dropped)."""
    target = checkpoint_kv_scale(name)
    if target is None:
        return False
    module_name, which = target
    layer = modules.get(module_name)
    if layer is None or which == "q" or not hasattr(layer, "set_kv_scale"):
        return True
    value = float(tensor.float().reshape(-1).max())  # per-tensor; a per-head vector keeps its largest
    for part in which:
        layer.set_kv_scale(part, value)
    return True


def calibrated_scales(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """(k_scale, v_scale) float32 [2] from the amax of real K and V (on their device, no host sync)."""
    amax = torch.stack([key.detach().abs().amax().float(), value.detach().abs().amax().float()])
    target = torch.tensor([K_AMAX_TARGET, V_AMAX_TARGET], dtype=torch.float32, device=amax.device)
    return (amax / target).clamp_(min=_MIN_SCALE)


def kv_scale_summary(layers: list) -> str:
    """'k_scale 0.0312..0.0934, v_scale 0.0030..0.1198 (calibrated)' for the log (one host sync)."""
    scales = torch.stack([layer.kv_scales for layer in layers]).cpu()
    sources = sorted({layer.kv_scale_source or "unscaled" for layer in layers})
    return (f"k_scale {scales[:, 0].min():.4g}..{scales[:, 0].max():.4g}, v_scale {scales[:, 1].min():.4g}.."
            f"{scales[:, 1].max():.4g} ({', '.join(sources)})")
