"""Sleep mode's weight side (LLM.sleep / wake_up): the model's tensors moved to host memory (level 1) or dropped
and reloaded from the model's files (level 2). The KV cache and CUDA graphs are the runner's (ModelRunner.sleep_kv_cache).

Tensors keep their Python objects (a Parameter is refilled through `.data`), so the modules, the norm / GEMV links
and anything else holding a module stay valid; what held a tensor itself (CUDA graphs, the CPU decode stack's
argument lists, CPU prepacked copies) is dropped and rebuilt on wake-up.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

import torch

logger = logging.getLogger("pagedllm")

# Tensors derived from the weights beside the parameters (not in state_dict): rebuilt from them after a reload.
DERIVED_CPU_COPIES = ("cpu_packed_weight", "cpu_greedy_screen", "cpu_packed_experts")
# Buffers that hold run-time state, not something the model's files give (FP8 KV scales calibrated at the first
# step): level 2 keeps them (in host memory), as vLLM keeps buffers. Every other buffer (rope tables, quantized
# layouts such as GGUF's packed parts) is discarded with the parameters and rebuilt by the reload.
KEPT_BUFFERS = ("kv_scales",)


def inner_model(model: torch.nn.Module) -> torch.nn.Module:
    """The causal LM under a pipeline stage's wrapper (its parameter names are the checkpoint's)."""
    return getattr(model, "inner", model)


def reset_fast_paths(model: torch.nn.Module) -> None:
    """The CPU decode stack keeps the weights and KV views it was built with: rebuilt at the next step."""
    for module in model.modules():
        path = module.__dict__.get("fast_path")
        reset = getattr(path, "reset", None)
        if reset is not None:
            reset()


class _Storage:
    """One device storage's host copy and the tensors (parameters, buffers; views, ties) that live on it."""

    def __init__(self, host: torch.Tensor, members: list) -> None:
        self.host = host  # uint8 [nbytes] (pinned on CUDA)
        self.members = members  # (tensor, storage offset, size, stride)


class WeightSleeper:
    """Moves a model's weights off the device and back. `reload` builds a fresh copy of the model from its files
    (models/loader.get_model with the engine's arguments) for level 2."""

    def __init__(self, model: torch.nn.Module, device: torch.device, reload: Callable[[], torch.nn.Module],
                 after_reload: Optional[Callable[[torch.nn.Module], None]] = None) -> None:
        self.model = model
        self.device = device
        self.reload = reload
        self.after_reload = after_reload
        self.level = 0  # 0: awake; 1: on the host (or in place on a CPU); 2: discarded (KEPT_BUFFERS aside)
        # On a CPU "host memory" is where the weights already are: level 1 leaves them in place (tests force the
        # move there to exercise the device path's bookkeeping).
        self.offload = device.type != "cpu"
        self._storages: list[_Storage] = []

    def _tensors(self, everything: bool = True) -> list[torch.Tensor]:
        """The model's parameters and buffers (each once); only the KEPT_BUFFERS with everything=False."""
        seen: set[int] = set()
        out = []
        for module in self.model.modules():
            named = list(module._buffers.items()) + (list(module._parameters.items()) if everything else [])
            for name, t in named:
                if t is not None and id(t) not in seen and (everything or name in KEPT_BUFFERS):
                    seen.add(id(t))
                    out.append(t)
        return out

    def sleep(self, level: int) -> None:
        """Level 1: every parameter and buffer to host memory; level 2: discarded, KEPT_BUFFERS to host memory."""
        if self.level:
            return
        if level == 2:
            self._discard()
        if self.offload:
            self._offload(self._tensors(everything=level == 1))
        self.level = level
        reset_fast_paths(self.model)

    def wake_up(self) -> None:
        """Back on the device: copied back (level 1) or reloaded from the model's files (level 2)."""
        if not self.level:
            return
        self._restore()
        if self.level == 2:
            self._reload()
        self.level = 0
        reset_fast_paths(self.model)

    def _offload(self, tensors: list[torch.Tensor]) -> None:
        """Copy each device storage once (tied / viewed tensors share it) into pinned host memory, then point its
        tensors at an empty placeholder so the device memory is freed."""
        groups: dict[int, tuple[Any, list]] = {}
        for t in tensors:
            if t.numel() == 0:  # (a discarded parameter)
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            groups.setdefault(key, (storage, []))[1].append((t, t.storage_offset(), tuple(t.shape), t.stride()))
        pin = self.device.type == "cuda"
        self._storages = []
        for storage, members in groups.values():
            source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
            host.copy_(source, non_blocking=pin)
            self._storages.append(_Storage(host, members))
        if pin:
            torch.cuda.synchronize(self.device)  # the copies are done before the device memory goes
        for entry in self._storages:
            for t, *_ in entry.members:
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)

    def _restore(self) -> None:
        for entry in self._storages:
            device_storage = entry.host.to(self.device).untyped_storage()
            for t, offset, size, stride in entry.members:
                view = torch.empty(0, dtype=t.dtype, device=self.device)
                view.set_(device_storage, offset, size, stride)
                t.data = view
        self._storages = []

    def _discard(self) -> None:
        for module in self.model.modules():
            for name in DERIVED_CPU_COPIES:
                module.__dict__.pop(name, None)
            named = list(module._parameters.items()) + list(module._buffers.items())
            for name, t in named:
                if t is not None and name not in KEPT_BUFFERS:
                    t.data = torch.empty(0, dtype=t.dtype, device=t.device)

    @torch.no_grad()
    def _reload(self) -> None:
        start = time.perf_counter()
        fresh = self.reload()
        old = inner_model(self.model)
        targets, loaded = _discarded_tensors(old), _discarded_tensors(fresh)
        missing = set(targets) - set(loaded)
        if missing:
            raise RuntimeError(f"Reloading the weights found no tensor for {sorted(missing)[:3]}; this is a bug.")
        for name, tensor in targets.items():
            tensor.data = loaded[name].data  # the same Python objects: whatever holds them sees the new values
        del fresh, loaded
        if self.after_reload is not None:
            self.after_reload(old)
        logger.info("Reloaded the weights from the model's files in %.1f s.", time.perf_counter() - start)


def _discarded_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """name -> parameter or buffer that level 2 discards (every name of a tied tensor)."""
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update((name, t) for name, t in model.named_buffers(remove_duplicate=False)
               if name.rpartition(".")[2] not in KEPT_BUFFERS)
    return out
