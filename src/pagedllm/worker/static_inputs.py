"""Copies of a step's token arrays into a CUDA graph's static input buffer (worker/cuda_graph.py, mixed_graph.py)."""
from __future__ import annotations

import torch


def copy_rows(dst: torch.Tensor, arrays: tuple[torch.Tensor, ...], n: int) -> None:
    """arrays[i] (int64 [n] each) into dst[i, :n]: one strided copy where the arrays are views of one buffer at one
    stride (as the runner's host stager lays a step's arrays out, one after another), else one copy each."""
    first = arrays[0]
    step = arrays[1].data_ptr() - first.data_ptr() if len(arrays) > 1 else 0
    if (step > 0 and step % first.element_size() == 0
            and all(b.data_ptr() - a.data_ptr() == step for a, b in zip(arrays, arrays[1:]))
            and all(a.dtype == dst.dtype and a.shape == (n,) and a.stride(0) == 1 for a in arrays)
            and first.device == dst.device
            and first.untyped_storage().data_ptr() == arrays[-1].untyped_storage().data_ptr()):
        dst[:len(arrays), :n].copy_(first.as_strided((len(arrays), n), (step // first.element_size(), 1)),
                                    non_blocking=True)
        return
    for row, a in zip(dst, arrays):
        row[:n].copy_(a, non_blocking=True)
