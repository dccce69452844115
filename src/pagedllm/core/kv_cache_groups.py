"""KV-cache groups: which decoder layers share a block table, and where each layer's K/V lives.

A model whose layers all attend the same way (full attention, or one sliding window on every layer, as Mistral
v0.1) has one group: one block table per request, one KV tensor per layer, exactly the layout without windows.

A model that mixes windows (Gemma 3's five local layers per global one, Qwen2 with max_window_layers) needs a
table per kind of layer, so the local layers' tables can drop the blocks that fell out of their window while the
global ones keep every block. As vLLM's hybrid allocator does, the layers are split into groups of the same size
S (S = the size of the smallest kind; a kind that does not divide by S gets a last group with empty places), and
the pool keeps S KV tensors ("slots"): layer i of every group reads and writes slot i. One block id then names
S layers' worth of memory, and a request holds blocks in every group, all from the same pool, so a block freed
by a local group serves any group next. Memory per request: (full groups x all its blocks + local groups x the
blocks of their windows) x S layers, instead of every layer holding every block.

Pure Python (no torch): the scheduler (core/) and the workers build the same groups from the per-layer windows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class KVCacheGroups:
    windows: tuple[Optional[int], ...]  # per group: its sliding window (None: full attention)
    layer_group: tuple[int, ...]  # per model layer: its group
    layer_slot: tuple[int, ...]  # per model layer: the KV tensor it uses (its place in its group)
    num_slots: int  # KV tensors of the whole model (S; the number of layers with a single group)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def slots_of(self, layers: Sequence[int]) -> list[int]:
        """The slots the given layers use (a pipeline stage allocates only these), ascending."""
        return sorted({self.layer_slot[i] for i in layers})


def blocks_needed(group_windows: Sequence[Optional[int]], tokens: int, chunk_tokens: int, block_size: int) -> int:
    """Block ids one request of `tokens` tokens holds at most, computed at most chunk_tokens at a time: every block
    in a full group; in a sliding group at most a chunk plus the window (the blocks before are freed)."""
    n = -(-tokens // block_size)
    return sum(n if w is None else min(n, -(-(w + chunk_tokens) // block_size) + 1) for w in group_windows)


def effective_window(window: Optional[int], max_model_len: int) -> Optional[int]:
    """A window that never hides a key of a max_model_len sequence is full attention for the KV manager."""
    return window if window is not None and window < max_model_len else None


def kv_cache_groups(layer_windows: Sequence[Optional[int]], max_model_len: int) -> KVCacheGroups:
    """Group the layers by their sliding window (None: full attention), in the order the kinds first appear."""
    windows = [effective_window(w, max_model_len) for w in layer_windows]
    if not windows:
        raise ValueError("A model without attention layers has no KV cache.")
    kinds: dict[Optional[int], list[int]] = {}
    for i, w in enumerate(windows):
        kinds.setdefault(w, []).append(i)
    if len(kinds) == 1:
        return KVCacheGroups(windows=(windows[0],), layer_group=(0,) * len(windows),
                             layer_slot=tuple(range(len(windows))), num_slots=len(windows))
    size = min(len(layers) for layers in kinds.values())
    group_windows: list[Optional[int]] = []
    layer_group = [0] * len(windows)
    layer_slot = [0] * len(windows)
    for w, layers in kinds.items():
        for start in range(0, len(layers), size):
            g = len(group_windows)
            group_windows.append(w)
            for slot, layer in enumerate(layers[start:start + size]):
                layer_group[layer] = g
                layer_slot[layer] = slot
    return KVCacheGroups(windows=tuple(group_windows), layer_group=tuple(layer_group), layer_slot=tuple(layer_slot),
                         num_slots=size)
