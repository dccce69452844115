"""GGUF tensors read for the CPU path that keeps weights in their GGUF block formats.

`gguf_tensor_types(path)` maps the Hugging Face names of the file's tensors to their GGML types, so a
quantization config can decide per layer whether it stays packed. `iter_gguf_weights(path, hf_config, keep)`
yields (HF name, tensor): a uint8 [rows, row_bytes] tensor of the file's blocks (tagged `gguf_type`) where
`keep(name, type)` says so, else the float32 dequantization (as the converted checkpoint holds it).

llama.cpp's converter permutes the Q/K rows of `llama` models for its interleaved rope; that is a permutation
of whole rows, so it is undone on the packed rows exactly as on the dequantized ones (models/gguf.py).
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch

from pagedllm.models.gguf import _SKIPPED_TENSORS, _field, _hf_name, _unpermute_rope_rows, open_gguf

# The block formats the CPU kernels multiply directly (kernels/csrc/gguf_ops.cpp), by GGML type name.
PACKED_TYPE_NAMES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


def packed_type_ids() -> set[int]:
    from gguf import GGMLQuantizationType as Q
    return {int(Q[name]) for name in PACKED_TYPE_NAMES}


def gguf_source_path(model_dir: Optional[str]) -> Optional[str]:
    """The .gguf file a converted model directory was made from (models/gguf.py writes the record), or None."""
    if not model_dir:
        return None
    record = os.path.join(model_dir, "pagedllm_gguf_source.json")
    if not os.path.isfile(record):
        return None
    try:
        with open(record) as f:
            path = json.load(f).get("gguf_path")
    except (OSError, ValueError):
        return None
    return path if path and os.path.isfile(path) else None


def gguf_tensor_types(gguf_path: str) -> dict[str, int]:
    """HF tensor name -> GGML type id, for the tensors the model loads."""
    reader = open_gguf(gguf_path)
    out = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is not None and tensor.name not in _SKIPPED_TENSORS:
            out[name] = int(tensor.tensor_type)
    return out


def iter_gguf_weights(gguf_path: str, hf_config: Any, keep: Callable[[str, int], bool],
                      show_progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    from pagedllm.models.weight_utils import _maybe_bar

    reader = open_gguf(gguf_path)
    arch = _field(reader, "general.architecture")
    pbar = _maybe_bar(len(reader.tensors), show_progress)
    try:
        for tensor in reader.tensors:
            if pbar is not None:
                pbar.update(1)
            name = _hf_name(tensor.name)
            if name is None or tensor.name in _SKIPPED_TENSORS:
                continue
            qtype = int(tensor.tensor_type)
            packed = keep(name, qtype)
            if packed:
                data = np.array(tensor.data, dtype=np.uint8)  # [rows, row_bytes], an owned copy of the blocks
            else:
                data = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            if arch == "llama" and ".self_attn.q_proj." in name:
                data = _unpermute_rope_rows(data, hf_config.num_attention_heads)
            elif arch == "llama" and ".self_attn.k_proj." in name:
                data = _unpermute_rope_rows(data, hf_config.num_key_value_heads)
            out = torch.from_numpy(np.ascontiguousarray(data))
            if packed:
                out.gguf_type = qtype
            yield name, out
    finally:
        if pbar is not None:
            pbar.close()
