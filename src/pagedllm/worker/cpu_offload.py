"""`--cpu-offload-gb N`: up to N GB of decoder layers keep their weights in pinned host memory and are copied to
the GPU just ahead of use, so a model larger than the GPU still runs (slower: every step streams them over PCIe).

Whole decoder layers are offloaded, spread evenly through the stack so each copy overlaps the compute of the
resident layers before it. Two device slots, each shaped like one layer's parameters, take turns: while an
offloaded layer runs from one slot, a side stream fills the other with the next offloaded layer. A layer's
forward pre-hook waits for its copy and points its parameters at the slot; its forward hook records when the slot
is free and queues the copy of the offloaded layer two ahead into it (wrapping to the next step's first ones).

CUDA graphs are turned off with offloading (the copies are issued by these hooks at run time); the Worker logs
that. The CPU path here (plain copies, no streams) exists so the mechanics are tested without a GPU.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

logger = logging.getLogger("pagedllm")


def _layer_params(layer: nn.Module) -> dict[str, nn.Parameter]:
    return dict(layer.named_parameters())


class CpuOffloader:
    def __init__(self, model: nn.Module, offload_bytes: float, device: torch.device) -> None:
        self.device = torch.device(device)
        layers = list(model.model.layers)
        signature = [tuple((n, tuple(p.shape), p.dtype) for n, p in _layer_params(layer).items()) for layer in layers]
        if len(set(signature)) != 1:
            raise ValueError("--cpu-offload-gb needs decoder layers of one shape; this model's layers differ.")
        layer_bytes = sum(p.numel() * p.element_size() for p in _layer_params(layers[0]).values())
        count = min(len(layers), int(offload_bytes // layer_bytes)) if layer_bytes else 0
        if count == 0:
            raise ValueError(f"--cpu-offload-gb {offload_bytes / 2**30:g} is less than one decoder layer "
                             f"({layer_bytes / 2**30:.3f} GB); give at least that, or 0 to turn offloading off.")
        # evenly spread, so resident layers sit between offloaded ones and hide their copies
        self.indices = sorted({int(i * len(layers) / count) for i in range(count)})
        self.layers = [layers[i] for i in self.indices]
        self.offloaded_bytes = layer_bytes * len(self.layers)
        cuda = self.device.type == "cuda"
        self.host: list[dict[str, torch.Tensor]] = []
        for layer in self.layers:
            host = {}
            for name, p in _layer_params(layer).items():
                t = p.data.to("cpu")
                host[name] = t.pin_memory() if cuda else t.clone()
                p.data = host[name]
            self.host.append(host)
        _move_resident(model, self.device, skip={id(p) for layer in self.layers for p in layer.parameters()})
        template = self.host[0]
        self.slots = [{n: torch.empty(t.shape, dtype=t.dtype, device=self.device) for n, t in template.items()}
                      for _ in range(min(2, len(self.layers)))]
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self.copied = [torch.cuda.Event() if cuda else None for _ in self.slots]
        self.freed = [torch.cuda.Event() if cuda else None for _ in self.slots]
        self._pending: list[Optional[int]] = [None] * len(self.slots)  # offloaded index whose copy is queued
        for k, layer in enumerate(self.layers):
            layer.register_forward_pre_hook(self._make_pre_hook(k))
            layer.register_forward_hook(self._make_post_hook(k))
        model.register_forward_pre_hook(lambda module, args: self._start_step())
        logger.info("CPU offload: %d of %d decoder layers (%.2f GB) stay in %s host memory and stream to %s "
                    "ahead of use.", len(self.layers), len(layers), self.offloaded_bytes / 2**30,
                    "pinned" if cuda else "plain", self.device)

    # ---- the copy pipeline ----------------------------------------------------------------------

    def _queue_copy(self, k: int) -> None:
        """Copy offloaded layer k into its slot (k % 2) once the slot's previous user has finished."""
        s = k % len(self.slots)
        if self._pending[s] == k:
            return
        slot, host = self.slots[s], self.host[k]
        if self.copy_stream is None:
            for name, t in host.items():
                slot[name].copy_(t)
        else:
            self.copy_stream.wait_event(self.freed[s])
            with torch.cuda.stream(self.copy_stream):
                for name, t in host.items():
                    slot[name].copy_(t, non_blocking=True)
            self.copied[s].record(self.copy_stream)
        self._pending[s] = k

    def _start_step(self) -> None:
        for k in range(len(self.slots)):
            self._queue_copy(k)

    def _make_pre_hook(self, k: int):
        def hook(module: nn.Module, args) -> None:
            self._queue_copy(k)  # no-op when prefetched (the usual case)
            s = k % len(self.slots)
            if self.copy_stream is not None:
                torch.cuda.current_stream(self.device).wait_event(self.copied[s])
            for name, p in _layer_params(module).items():
                p.data = self.slots[s][name]
        return hook

    def _make_post_hook(self, k: int):
        def hook(module: nn.Module, args, output) -> None:
            s = k % len(self.slots)
            if self.copy_stream is not None:
                self.freed[s].record(torch.cuda.current_stream(self.device))
            for name, p in _layer_params(module).items():
                p.data = self.host[k][name]
            self._pending[s] = None
            nxt = k + len(self.slots)
            if nxt >= len(self.layers) and len(self.layers) % len(self.slots) == 0:
                nxt -= len(self.layers)  # past the last: the next step's first (same slot parity)
            if nxt < len(self.layers):
                self._queue_copy(nxt)
        return hook


def _move_resident(model: nn.Module, device: torch.device, skip: set[int]) -> None:
    """Move every parameter (model.parameters() yields a shared one once) not in `skip` and every buffer."""
    for p in model.parameters():
        if id(p) not in skip:
            p.data = p.data.to(device)
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)
