"""GGUF tensors read for the CPU path that keeps weights in their GGUF block formats.

`gguf_tensor_types(path)` maps the Hugging Face names of the file's tensors to their GGML types, so a
quantization config can decide per layer whether it stays packed. `iter_gguf_weights(path, hf_config, keep)`
yields (HF name, tensor): a uint8 [rows, row_bytes] tensor of the file's blocks (tagged `gguf_type`) where
`keep(name, type)` says so, else the float32 dequantization (as the converted checkpoint holds it). Mixture-of-
experts routers and experts are always dequantized, and their experts yielded stacked ([E, rows, cols]).

llama.cpp's converter permutes the Q/K rows of `llama` models for its interleaved rope; that is a permutation
of whole rows, so it is undone on the packed rows exactly as on the dequantized ones (models/gguf.py
`to_hf_layout`, which also turns Gemma's stored 1 + w norms back into w).
"""
from __future__ import annotations

import json
import logging
import os
import struct
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch

from pagedllm.models.gguf import (SUPPORTED_GGUF_ARCHITECTURES, _SKIPPED_TENSORS, _hf_name, is_moe_dense_tensor,
                                  moe_tensor_shape, open_gguf, to_hf_layout)

logger = logging.getLogger("pagedllm")

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
    out = {}
    index = read_gguf_index(gguf_path)
    for tensor in index.tensors:
        name = _hf_name(tensor.name, index.arch)
        if name is not None and tensor.name not in _SKIPPED_TENSORS:
            out[name] = tensor.tensor_type
    return out


# ------------------------------------------------------------------------------------- a fast tensor index
# gguf's GGUFReader builds a numpy view per metadata item, ~1M of them for a tokenizer's 49k-token vocabulary
# and merges: seconds at every start. Loading the packed weights needs only the architecture and the tensor
# table, so this reads the header with struct, skipping the metadata values, and maps the data once.

_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value types
_STRING, _ARRAY = 8, 9
_FLOAT_DTYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64,
                 28: np.float64}


class GGUFTensor:
    __slots__ = ("name", "tensor_type", "data")

    def __init__(self, name: str, tensor_type: int, data: np.ndarray) -> None:
        self.name, self.tensor_type, self.data = name, tensor_type, data


class GGUFIndex:
    def __init__(self, arch: Optional[str], tensors: list[GGUFTensor]) -> None:
        self.arch, self.tensors = arch, tensors


_index_cache: dict[tuple, GGUFIndex] = {}


def read_gguf_index(gguf_path: str) -> GGUFIndex:
    """The file's architecture and tensors (numpy views of a read-only map, shaped as GGUFReader shapes them:
    float types [..., cols], block types uint8 [rows, row_bytes]); cached per (path, size, mtime)."""
    st = os.stat(gguf_path)
    key = (os.path.abspath(gguf_path), st.st_size, st.st_mtime_ns)
    if key not in _index_cache:
        try:
            index = _parse_index(gguf_path)
        except (ValueError, struct.error, IndexError, KeyError, OverflowError):
            # Something this parser does not handle (a big-endian file, say): gguf's reader, which raises the
            # one-sentence error for a corrupt or unsupported file.
            reader = open_gguf(gguf_path)
            from pagedllm.models.gguf import _field
            index = GGUFIndex(_field(reader, "general.architecture"),
                              [GGUFTensor(t.name, int(t.tensor_type), t.data) for t in reader.tensors])
        if index.arch not in SUPPORTED_GGUF_ARCHITECTURES:
            open_gguf(gguf_path)  # the architecture error
        seen: set = set()
        for t in index.tensors:  # a second copy would silently replace the first (gguf's own reader refuses it)
            if t.name in seen:
                raise ValueError(f"Tensor {t.name!r} is stored twice in {gguf_path}; a tensor name must appear "
                                 f"once (re-convert the model).")
            seen.add(t.name)
        _index_cache.clear()  # one model's map at a time
        _index_cache[key] = index
    return _index_cache[key]


def clear_index_cache() -> None:
    """Forget the cached map (an engine's shutdown): it would keep the file mapped after its weights are gone."""
    _index_cache.clear()


def _parse_index(gguf_path: str) -> GGUFIndex:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    mm = np.memmap(gguf_path, dtype=np.uint8, mode="r")
    buf = memoryview(mm)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError("not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version < 2:
        raise ValueError(f"GGUF version {version} is not supported")
    pos = 24

    def string(at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, at)
        return bytes(buf[at + 8:at + 8 + n]).decode("utf-8", errors="replace"), at + 8 + n

    def skip_value(vtype: int, at: int) -> int:
        if vtype == _STRING:
            return at + 8 + struct.unpack_from("<Q", buf, at)[0]
        if vtype == _ARRAY:
            etype, count = struct.unpack_from("<IQ", buf, at)
            at += 12
            if etype == _STRING:
                for _ in range(count):
                    at += 8 + struct.unpack_from("<Q", buf, at)[0]
                return at
            if etype == _ARRAY:
                for _ in range(count):
                    at = skip_value(_ARRAY, at)
                return at
            return at + count * _SCALAR_SIZES[etype]
        return at + _SCALAR_SIZES[vtype]

    arch, alignment = None, 32
    for _ in range(n_kv):
        key, pos = string(pos)
        (vtype,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if key == "general.architecture" and vtype == _STRING:
            arch, _ = string(pos)
        elif key == "general.alignment" and vtype == 4:
            (alignment,) = struct.unpack_from("<I", buf, pos)
        pos = skip_value(vtype, pos)
    infos = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        ttype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos.append((name, dims, ttype, offset))
    start = (pos + alignment - 1) // alignment * alignment
    tensors = []
    for name, dims, ttype, offset in infos:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        shape = tuple(int(d) for d in reversed(dims))  # row-major: the last dimension is ggml's ne[0]
        nbytes = int(np.prod(shape, dtype=np.int64)) // block * type_size
        raw = mm[start + offset:start + offset + nbytes]
        if raw.size != nbytes:
            raise ValueError(f"tensor {name} runs past the end of the file")
        if ttype in _FLOAT_DTYPES:
            data = raw.view(_FLOAT_DTYPES[ttype]).reshape(shape)
        else:
            data = raw.reshape(*shape[:-1], shape[-1] // block * type_size)
        tensors.append(GGUFTensor(name, int(ttype), data))
    return GGUFIndex(arch, tensors)


def report_unmapped_tensors(gguf_path: str, hf_config: Any) -> None:
    """Warn once about the file's tensors that have no Hugging Face name (the model reads nothing of them)."""
    from pagedllm.models.weight_utils import report_unused_gguf_tensors

    index = read_gguf_index(gguf_path)
    report_unused_gguf_tensors([t.name for t in index.tensors if t.name not in _SKIPPED_TENSORS
                                and _hf_name(t.name, index.arch) is None], hf_config)


def iter_gguf_weights(gguf_path: str, hf_config: Any, keep: Callable[[str, int], bool],
                      show_progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from pagedllm.models.weight_utils import _maybe_bar

    index = read_gguf_index(gguf_path)
    arch = index.arch
    report_unmapped_tensors(gguf_path, hf_config)
    pbar = _maybe_bar(len(index.tensors), show_progress)
    moe_dequantized = 0
    try:
        for tensor in index.tensors:
            if pbar is not None:
                pbar.update(1)
            name = _hf_name(tensor.name, arch)
            if name is None or tensor.name in _SKIPPED_TENSORS:
                continue
            qtype = int(tensor.tensor_type)
            packed = keep(name, qtype)
            if packed and is_moe_dense_tensor(name):  # no packed MoE kernel yet
                packed = False
                moe_dequantized += 1
            if packed:
                data = np.array(tensor.data, dtype=np.uint8)  # [rows, row_bytes], an owned copy of the blocks
            else:
                data = np.array(dequantize(tensor.data, GGMLQuantizationType(qtype)), dtype=np.float32)
            data = to_hf_layout(arch, name, data, hf_config, packed)
            out = torch.from_numpy(np.ascontiguousarray(moe_tensor_shape(name, data)))
            if packed:
                out.gguf_type = qtype
            yield name, out
    finally:
        if pbar is not None:
            pbar.close()
    if moe_dequantized:
        logger.info("GGUF: %d mixture-of-experts tensor(s) (experts, routers) are dequantized at load: there is no "
                    "packed MoE kernel yet.", moe_dequantized)
