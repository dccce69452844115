"""Sleep mode's weight side (LLM.sleep / wake_up): the model's tensors moved to host memory (level 1) or dropped
and reloaded from the model's files (level 2). The KV cache and CUDA graphs are the runner's (ModelRunner.sleep).

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
        self.level = 0  # 0: awake; 1: on the host (or in place on a CPU); 2: parameters discarded
        # On a CPU "host memory" is where the weights already are: level 1 leaves them in place (tests force the
        # move there to exercise the device path's bookkeeping).
        self.offload = device.type != "cpu"
        self._storages: list[_Storage] = []

    def _tensors(self, parameters: bool = True) -> list[torch.Tensor]:
        seen: set[int] = set()
        out = []
        for module in self.model.modules():
            tensors = list(module._buffers.values())
            if parameters:
                tensors += list(module._parameters.values())
            for t in tensors:
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    out.append(t)
        return out

    def sleep(self, level: int) -> None:
        if self.level:
            return
        if level == 2:
            self._discard_parameters()
        if self.offload:
            self._offload(self._tensors(parameters=level == 1))
        self.level = level
        reset_fast_paths(self.model)

    def wake_up(self) -> None:
        if not self.level:
            return
        self._restore()
        if self.level == 2:
            self._reload_parameters()
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

    def _discard_parameters(self) -> None:
        for module in self.model.modules():
            for name in DERIVED_CPU_COPIES:
                module.__dict__.pop(name, None)
        for p in self._tensors(parameters=True):
            if isinstance(p, torch.nn.Parameter):
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    @torch.no_grad()
    def _reload_parameters(self) -> None:
        start = time.perf_counter()
        fresh = self.reload()
        old = inner_model(self.model)
        targets = dict(old.named_parameters(remove_duplicate=False))
        loaded = dict(fresh.named_parameters(remove_duplicate=False))
        missing = set(targets) - set(loaded)
        if missing:
            raise RuntimeError(f"Reloading the weights found no tensor for {sorted(missing)[:3]}; this is a bug.")
        for name, param in targets.items():
            param.data = loaded[name].data
        del fresh, loaded
        if self.after_reload is not None:
            self.after_reload(old)
        logger.info("Reloaded the weights from the model's files in %.1f s.", time.perf_counter() - start)
