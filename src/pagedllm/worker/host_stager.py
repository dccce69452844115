"""HostStager: a step's host int / float arrays to the device in one async copy per dtype, from pinned memory."""
from __future__ import annotations

import numpy as np
import torch

from pagedllm import envs


class HostStager:
    """Double-buffered pinned host memory: a step's int arrays go to the device in one async copy per dtype.

    Slot k is reused two steps later; by then the step that used it has completed (the engine waits for
    step N-1's results before launching step N+1), so its copy is done. On CPU the arrays are used as is.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # Packed into one pinned buffer per dtype (CUDA); tests turn it on for the CPU, where the buffer is pageable.
        self.packed = device.type == "cuda" and envs.PAGEDLLM_PINNED_STAGING
        self.slots: list[dict] = [{}, {}]
        self.k = 0

    def stage(self, arrays: list[np.ndarray], dtype) -> list[torch.Tensor]:
        return self.stage_in(self.k, arrays, dtype)

    def stage_in(self, index: int, arrays: list[np.ndarray], dtype) -> list[torch.Tensor]:
        """stage() into slot `index` (slots are added as needed), for a caller with its own rule for when a slot's
        copy is done (the draft model: every slot of one proposal, until the proposal's wait)."""
        if not self.packed:
            return [torch.from_numpy(np.ascontiguousarray(a, dtype=dtype)).to(self.device, non_blocking=True)
                    for a in arrays]
        offsets = self.layout(arrays, dtype)
        total = offsets[-1]
        while len(self.slots) <= index:
            self.slots.append({})
        slot = self.slots[index]
        buf = slot.get(dtype)
        if buf is None or buf.numel() < total:
            size = max(total, 2 * (0 if buf is None else buf.numel()), 1024)
            buf = torch.from_numpy(np.zeros(size, dtype=dtype))
            buf = buf.pin_memory() if self.device.type == "cuda" else buf
            slot[dtype] = buf
        host = buf.numpy()
        # The device views come from one split (array, gap to the next, array, ...): a step stages up to ~20
        # arrays, and a slice plus a view each cost the host two dispatches per array.
        sizes = []
        for a, start, end in zip(arrays, offsets, offsets[1:]):
            host[start:start + a.size] = a.reshape(-1)
            sizes += (a.size, end - start - a.size)
        parts = buf[:total].to(self.device, non_blocking=True).split_with_sizes(sizes)
        return [p if a.ndim == 1 else p.view(a.shape) for p, a in zip(parts[0::2], arrays)]

    @staticmethod
    def layout(arrays: list[np.ndarray], dtype) -> list[int]:
        """Element offsets of the arrays in the packed buffer, then the total: each starts 64-byte aligned.

        Triton specializes pointer arguments on 16-byte alignment, so packed arrays whose offsets moved with
        the batch size (after an int32 array of num_reqs + 1 entries, say) made it compile new kernel
        variants in the middle of a run.
        """
        align = max(1, 64 // np.dtype(dtype).itemsize)
        offsets = [0]
        for a in arrays:
            offsets.append(offsets[-1] + -(-a.size // align) * align)
        return offsets

    def next_step(self) -> None:
        self.k ^= 1
