"""The worker's adapter manager: wraps the model's linear layers, owns the device slots and the host cache.

    max_loras device slots      adapters the current step may use; a step never needs more (the scheduler
                                admits requests so that running requests use at most max_loras adapters)
    max_cpu_loras host entries  adapters read from disk and validated, kept in host memory (LRU)

Loading is lazy: `add_lora` reads and validates an adapter into the host cache (so a bad adapter is refused
when it is registered), and a slot is filled only when a step first needs that adapter. An adapter evicted
from the host cache is read again from its path when it is needed next. Slots are reused least recently used
first, never one the step being prepared needs.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Optional, Sequence

import numpy as np
import torch
from torch import nn

from pagedllm.layers.attention import Attention
from pagedllm.layers.layernorm import fed_norms
from pagedllm.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear
from pagedllm.lora.layers import LoRABatchState, LoRALinear, lora_slices
from pagedllm.lora.peft import LoRAAdapter, LoRAError, load_adapter

logger = logging.getLogger("pagedllm")


class AdapterReloadError(LoRAError):
    """An adapter evicted from the host cache could not be read again when a step needed it: its requests' fault
    (the runner fails them alone), not the engine's."""

    def __init__(self, lora_int_id: int, message: str) -> None:
        super().__init__(message)
        self.lora_int_id = lora_int_id


def padded_rank(max_lora_rank: int) -> int:
    """Slot rank: max_lora_rank rounded up to a power of two >= 16 (the kernels' smallest tile)."""
    r = 16
    while r < max_lora_rank:
        r *= 2
    return r


def wrap_lora_layers(model: nn.Module, state: LoRABatchState, num_slots: int, rank: int) -> list[LoRALinear]:
    """Replace every adaptable linear layer of `model` by a LoRALinear around it; returns the wrappers."""
    mapping = getattr(model, "stacked_params_mapping", [])
    targets = []
    for parent_name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            if isinstance(child, LinearBase) and not isinstance(child, LoRALinear):
                targets.append((parent, child_name, child))
    wrapped = []
    for parent, child_name, layer in targets:
        check_supported(layer)
        slices = lora_slices(layer, mapping)
        if slices is None:
            continue
        wrapper = LoRALinear(layer, slices, state, num_slots, rank, row_parallel=isinstance(layer, RowParallelLinear))
        setattr(parent, child_name, wrapper)
        wrapped.append(wrapper)
    if not wrapped:
        raise ValueError(f"enable_lora: {type(model).__name__} has no linear layer LoRA can adapt.")
    link_norms(model)
    link_attention_outputs(model)
    return wrapped


def link_norms(model: nn.Module) -> None:
    """Point each RMSNorm whose output feeds one wrapped layer alone (the decoder layer's `norm_feeds`) at it, so
    few-row steps compute that layer's shrink in the norm kernel."""
    for norm, layer in fed_norms(model):
        if isinstance(layer, LoRALinear):
            norm.__dict__["shrink_consumer"] = layer  # a plain reference, not a submodule of the norm


def link_attention_outputs(model: nn.Module) -> None:
    """Point each attention layer whose output feeds a wrapped o_proj at it, so that few-row decode steps may
    compute o_proj's shrink in the attention's split-KV reduce kernel (layers.FOLD_O_SHRINK)."""
    for module in model.modules():
        attn, o_proj = getattr(module, "attn", None), getattr(module, "o_proj", None)
        if isinstance(attn, Attention) and isinstance(o_proj, LoRALinear):
            attn.__dict__["shrink_consumer"] = o_proj  # a plain reference, not a submodule


def check_supported(layer: LinearBase) -> None:
    """Refuse, at start, the combinations the wrapper does not implement."""
    if isinstance(layer, ColumnParallelLinear) and layer.gather_output:
        raise ValueError(f"enable_lora: the column-parallel layer {layer.prefix} gathers its output, which LoRA does "
                         "not support yet.")
    method = layer.linear_method
    if not callable(getattr(method, "apply", None)):
        raise ValueError(f"enable_lora: layer {layer.prefix} has a linear method ({type(method).__name__}) without "
                         "apply(); LoRA with it is not supported.")
    if getattr(method, "supports_lora", True) is False:
        raise ValueError(f"enable_lora with {type(method).__name__} (layer {layer.prefix}) is not supported yet.")


class LoRAManager:
    def __init__(self, model: nn.Module, *, max_loras: int, max_lora_rank: int, max_cpu_loras: Optional[int],
                 max_num_tokens: int, device: torch.device) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}.")
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.state = LoRABatchState(max_num_tokens, max_loras, device)
        self.layers = wrap_lora_layers(model, self.state, max_loras, padded_rank(max_lora_rank))
        self.expected: dict[str, tuple[int, int]] = {}
        self.fused: dict[str, list[str]] = {}  # merged layer -> its slices (adapters of Phi-3's fused modules)
        for layer in self.layers:
            self.expected.update(layer.expected_shapes())
            self.fused.update(layer.fused_names())
        # Pipeline parallel: this stage builds only its decoder layers; the others' modules are theirs to check.
        decoder = getattr(model, "model", None)
        start, end = getattr(decoder, "start_layer", None), getattr(decoder, "end_layer", None)
        num_layers = len(getattr(decoder, "layers", ()))
        self.local_layers = range(start, end) if start is not None and (start, end) != (0, num_layers) else None
        self.num_layers = num_layers or None
        # a checkpoint's module names -> the model's (Gemma 3's multimodal checkpoints name the language model's)
        self.rename = getattr(model, "lora_module_name", None)
        self.paths: dict[int, tuple[str, str]] = {}  # registered adapters: id -> (name, path)
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # LRU: least recently used first
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> device slot, LRU order
        self.free_slots = list(range(max_loras - 1, -1, -1))
        self.num_slot_loads = 0  # adapters copied into a device slot (for tests and logs)
        self.num_disk_loads = 0

    # ---- registration ----------------------------------------------------------------------------------

    def add_lora(self, lora_int_id: int, name: str, path: str) -> LoRAAdapter:
        """Read and validate an adapter (LoRAError if it cannot be served) and register it; idempotent."""
        if lora_int_id in self.paths and self.paths[lora_int_id][1] == path and lora_int_id in self.host:
            self.host.move_to_end(lora_int_id)
            return self.host[lora_int_id]
        adapter = self._read(lora_int_id, name, path)
        if lora_int_id in self.paths:  # re-registered (new path): its slot holds stale weights
            self._drop_slot(lora_int_id)
        self.paths[lora_int_id] = (name, path)
        self._cache(adapter)
        return adapter

    def remove_lora(self, lora_int_id: int) -> bool:
        if lora_int_id not in self.paths:
            return False
        del self.paths[lora_int_id]
        self.host.pop(lora_int_id, None)
        self._drop_slot(lora_int_id)
        return True

    def list_loras(self) -> list[int]:
        return list(self.paths)

    def _read(self, lora_int_id: int, name: str, path: str) -> LoRAAdapter:
        adapter = load_adapter(lora_int_id, name, path, self.expected, self.max_lora_rank, self.layers[0].lora_a.dtype,
                               local_layers=self.local_layers, fused=self.fused, rename=self.rename,
                               num_layers=self.num_layers)
        self.num_disk_loads += 1
        return adapter

    def _cache(self, adapter: LoRAAdapter) -> None:
        self.host[adapter.lora_int_id] = adapter
        self.host.move_to_end(adapter.lora_int_id)
        while len(self.host) > self.max_cpu_loras:
            evicted, _ = self.host.popitem(last=False)
            logger.debug("LoRA %d evicted from the host cache", evicted)

    def _drop_slot(self, lora_int_id: int) -> None:
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    @torch.inference_mode()
    def warm_up(self, max_num_tokens: int) -> None:
        """On CUDA, compile the shrink / expand kernel variants that steps outside the CUDA graphs use (a variant per
        row-block size and K-split count, which follow the step's token count), so that no adapter request waits
        for the compiler mid-serving; the graphs' sizes compile at capture. The smallest token count of each
        variant runs once per layer shape, before the KV cache is sized."""
        if self.state.device.type != "cuda":
            return
        from pagedllm.kernels import lora as kernels

        self.state.clear()
        self.state.active = True
        shapes = {(layer.in_local, tuple(layer._slice_spans)): layer for layer in self.layers}
        for layer in shapes.values():
            seen = set()
            for num_tokens in range(kernels.SHRINK_ROWS_MAX + 1, max_num_tokens + 1):
                key = (kernels.block_m(num_tokens), kernels.shrink_split(num_tokens, layer.in_local))
                if key in seen:
                    continue
                seen.add(key)
                x = torch.zeros(num_tokens, layer.in_local, dtype=layer.lora_a.dtype, device=self.state.device)
                out = torch.zeros(num_tokens, layer.out_local, dtype=layer.lora_a.dtype, device=self.state.device)
                layer.add_delta(x, out)
                del x, out
        torch.cuda.synchronize(self.state.device)
        self.state.clear()

    # ---- per step --------------------------------------------------------------------------------------

    def activate(self, lora_ids: Sequence[Optional[int]]) -> list[int]:
        """Device slots for the step's adapters (loading the missing ones); returns one slot (or -1) per entry."""
        needed = list(dict.fromkeys(i for i in lora_ids if i is not None))
        if len(needed) > self.max_loras:
            raise RuntimeError(f"A step uses {len(needed)} LoRA adapters but there are only {self.max_loras} slots; "
                               "the scheduler must hold requests back (this is a bug).")
        for lora_id in needed:
            if lora_id not in self.paths:
                raise RuntimeError(f"LoRA adapter id {lora_id} is not registered (this is a bug).")
        # Every re-read first, before any slot or cache changes: a failed step then leaves the state as it was.
        reread = {i: self._reread(i) for i in needed if i not in self.slot_of and i not in self.host}
        if reread:
            self._agree_on_rereads(reread)
        for lora_id in needed:
            if lora_id in self.slot_of:
                self.slot_of.move_to_end(lora_id)
            else:
                self._load_into_slot(lora_id, set(needed), reread.get(lora_id))
        return [-1 if i is None else self.slot_of[i] for i in lora_ids]

    def _reread(self, lora_id: int) -> LoRAAdapter | AdapterReloadError:
        """An adapter evicted from the host cache, read again (or why it could not be)."""
        name, path = self.paths[lora_id]
        try:
            return self._read(lora_id, name, path)
        except LoRAError as e:  # its files went away or changed since it was registered
            err = AdapterReloadError(lora_id, f"LoRA adapter {name!r} could not be read again from {path!r}: "
                                              f"{str(e).rstrip('.')}")
            err.__cause__ = e
            return err

    def _agree_on_rereads(self, reread: dict) -> None:
        """Raise AdapterReloadError if a re-read failed on any rank. With worker ranks every rank makes the same
        cache decisions (same plans, same order), so all of them get here in the same step; the disks may differ
        (nodes), so they agree here, before the step's first collective, and all fail the same adapter alike."""
        from pagedllm.distributed.parallel_state import get_world_group

        failed = [e for e in reread.values() if isinstance(e, AdapterReloadError)]
        world = get_world_group()
        if world.world_size == 1:
            if failed:
                raise failed[0]
            return
        none = 2 ** 62
        mine = min((e.lora_int_id for e in failed), default=none)
        agreed = world.all_reduce_min_int(mine)  # host-side (gloo): no device sync
        if agreed == none:
            return
        own = reread.get(agreed)
        if isinstance(own, AdapterReloadError):
            raise own
        name, path = self.paths[agreed]
        raise AdapterReloadError(agreed, f"LoRA adapter {name!r} could not be read again from {path!r} on another "
                                         "worker rank")

    def _load_into_slot(self, lora_id: int, keep: set[int], adapter: Optional[LoRAAdapter] = None) -> None:
        if adapter is None:
            adapter = self.host[lora_id]
        self._cache(adapter)
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            victim = next(i for i in self.slot_of if i not in keep)
            slot = self.slot_of.pop(victim)
        for layer in self.layers:
            layer.set_slot(slot, adapter.weights)
        self.slot_of[lora_id] = slot
        self.num_slot_loads += 1

    def step_arrays(self, lora_ids: Sequence[Optional[int]], num_scheduled: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
        """Host arrays of a step: (token_slots [T], sorted_token_ids [T'], slot_starts [S + 1], any adapter)."""
        slots = np.asarray(self.activate(lora_ids), dtype=np.int32)
        token_slots = np.repeat(slots, num_scheduled).astype(np.int32)
        active = bool((slots >= 0).any())
        if not active:
            return token_slots, np.zeros(0, dtype=np.int32), np.zeros(self.max_loras + 1, dtype=np.int32), False
        order = np.argsort(token_slots, kind="stable").astype(np.int32)
        num_none = int((token_slots < 0).sum())
        counts = np.bincount(token_slots[token_slots >= 0], minlength=self.max_loras)
        starts = np.zeros(self.max_loras + 1, dtype=np.int32)
        np.cumsum(counts, out=starts[1:])
        return token_slots, order[num_none:], starts, True
