"""The server's LoRA adapters: `--lora-modules`, the names the `model` field routes to, and the run-time
load/unload routes (`POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter`).

With several API server processes each has its LoRAModels: all load the `--lora-modules` adapters with the same
ids (1, 2, ...; the engine registers an id and path once); a run-time load takes an id of its own process's
sequence (ids do not collide across processes) and returns once every other process routes the name (the engine
core sends them a LoraEvent, `apply_event`, and answers after all of them applied it).

Names live here (the API process); the engine knows adapters by integer id, assigned here in load order.
Loading reads and validates the adapter in the engine before the name is served, so a bad path or an
unsupported adapter is a 400 with the reason and nothing is registered. A lora_path that is a Hugging Face repo id
is downloaded first, in a thread (lora/resolve.py; a repo not found, or not cached offline, is a 404). Unloading removes the name at once
(new requests get 404); requests already running with it finish first.
"""
from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass
from typing import Any, Optional

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from pagedllm import envs
from pagedllm.entrypoints.openai.body import parse_body
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.lora.request import LoRARequest


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_path: str
    base_model_name: Optional[str] = None
    load_inplace: bool = False  # reload a loaded name (new weights at its path, or another path)


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's body; lora_int_id is accepted and not needed)."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_int_id: Optional[int] = None


@dataclass
class LoRAModulePath:
    name: str
    path: str
    base_model_name: Optional[str] = None


def parse_lora_modules(values: Optional[list[str]]) -> list[LoRAModulePath]:
    """`--lora-modules name=path ...` or JSON objects `{"name": ..., "path": ..., "base_model_name": ...}`."""
    modules = []
    for value in values or []:
        value = value.strip()
        if value.startswith("{"):
            try:
                data = json.loads(value)
            except ValueError as e:
                raise ValueError(f"--lora-modules {value!r} is not valid JSON: {e}.")
            if not isinstance(data, dict) or not data.get("name") or not data.get("path"):
                raise ValueError(f"--lora-modules {value!r} needs \"name\" and \"path\".")
            unknown = set(data) - {"name", "path", "base_model_name"}
            if unknown:
                raise ValueError(f"--lora-modules {value!r} has unknown key(s) {', '.join(sorted(unknown))}.")
            modules.append(LoRAModulePath(str(data["name"]), str(data["path"]), data.get("base_model_name")))
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {value!r} must be name=path or a JSON object.")
            modules.append(LoRAModulePath(name, path))
    names = [m.name for m in modules]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"--lora-modules names must be unique; {', '.join(duplicates)} appear(s) twice.")
    return modules


async def _local_path(path: str, refresh: bool) -> str:
    """The adapter's local directory; a hub id is downloaded in a thread (the event loop serves on meanwhile) and
    once per server (refresh: load_inplace asks the hub again). Not found: 404; not an adapter: 400."""
    from pagedllm.lora.peft import LoRAError
    from pagedllm.lora.resolve import LoRANotFoundError, resolve_lora_path

    try:
        return await asyncio.to_thread(resolve_lora_path, path, None, refresh)
    except LoRANotFoundError as e:
        raise APIError(str(e), status=404, param="lora_path", code="lora_adapter_not_found") from None
    except LoRAError as e:
        raise APIError(str(e), status=400, param="lora_path") from None


def runtime_updates_allowed() -> bool:
    return envs.PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING


class LoRAModels:
    """Adapter name -> LoRARequest, for an engine started with enable_lora (`enabled`)."""

    def __init__(self, engine: Any, base_names: list[str], enabled: bool) -> None:
        self.engine = engine
        self.base_names = base_names
        self.enabled = enabled
        self.adapters: dict[str, LoRARequest] = {}
        self.names_by_id: dict[int, str] = {}  # also after unload (metrics of requests still running)
        self._pending: set[str] = set()
        self.roots: dict[str, str] = {}  # name -> lora_path as given (a hub id; requests hold its local snapshot)
        self._ids = itertools.count(1)
        self._announce = False  # set by share_ids: other API processes learn of run-time loads
        self._lock = asyncio.Lock()

    def get(self, name: Optional[str]) -> Optional[LoRARequest]:
        return self.adapters.get(name) if name else None

    def share_ids(self, client_index: int, num_clients: int) -> None:
        """Run-time loads of API process `client_index` of `num_clients` take ids no other process takes."""
        start = max(self.names_by_id, default=0) + 1 + client_index
        self._ids = itertools.count(start, num_clients)
        self._announce = num_clients > 1

    def apply_event(self, event: Any) -> None:
        """Another API process loaded (event.added) or unloaded an adapter (a messages.LoraEvent)."""
        if event.added:
            request = LoRARequest(lora_name=event.lora_name, lora_int_id=event.lora_int_id,
                                  lora_path=event.lora_path, base_model_name=event.base_model_name)
            self.adapters[event.lora_name] = request
            self.names_by_id[event.lora_int_id] = event.lora_name
            # a path this process once loaded the name from is not this adapter's: its card shows the event's path
            self.roots.pop(event.lora_name, None)
        else:
            for name, request in list(self.adapters.items()):
                if request.lora_int_id == event.lora_int_id:
                    del self.adapters[name]
                    self.roots.pop(name, None)

    async def load(self, name: Any, path: Any, base_model_name: Optional[str] = None,
                   load_inplace: bool = False) -> LoRARequest:
        """Register `name`; with load_inplace an already loaded name is read again under a new id (so no cached
        prefix block or host copy of the old weights serves it), taking the name over once the load succeeded.
        Requests running with the old weights finish with them."""
        if not self.enabled:
            raise APIError("LoRA adapters need the server started with --enable-lora.", status=400)
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise APIError("Both 'lora_name' and 'lora_path' must be non-empty strings.", status=400,
                           param="lora_name" if not isinstance(name, str) or not name else "lora_path")
        old = self.adapters.get(name) if load_inplace else None
        if (name in self.adapters and old is None) or name in self._pending or name in self.base_names:
            hint = "" if name in self.base_names else " Set 'load_inplace' to true to reload it."
            raise APIError(f"The lora adapter '{name}' has already been loaded.{hint}", status=400, param="lora_name")
        self._pending.add(name)
        try:
            local = await _local_path(path, refresh=load_inplace)
            async with self._lock:  # ids in load order; one adapter read at a time
                request = LoRARequest(lora_name=name, lora_int_id=next(self._ids), lora_path=local,
                                      base_model_name=base_model_name)
                replaces = {} if old is None else {"replaces": old.lora_int_id}
                if self._announce:
                    await self.engine.add_lora(request, announce=True, **replaces)
                else:
                    await self.engine.add_lora(request, **replaces)
                # an unload of the name while this one loaded has removed the old adapter already: removing it
                # again is the engine's "not loaded", which answered this load (that did take the name) with a 404
                still_old = old is not None and self.adapters.get(name) is old
                self.adapters[name] = request
                self.roots[name] = path
                self.names_by_id[request.lora_int_id] = name
                if still_old:
                    await self.engine.remove_lora(old.lora_int_id)
        finally:
            self._pending.discard(name)
        return request

    async def unload(self, name: Any) -> None:
        if not self.enabled:
            raise APIError("LoRA adapters need the server started with --enable-lora.", status=400)
        request = self.adapters.get(name) if isinstance(name, str) else None
        if request is None:
            raise APIError(f"The lora adapter '{name}' cannot be found.", status=404, param="lora_name",
                           code="model_not_found")
        del self.adapters[name]
        self.roots.pop(name, None)
        await self.engine.remove_lora(request.lora_int_id)

    def cards(self, created: int, max_model_len: int) -> list[dict]:
        return [{"id": name, "object": "model", "created": created, "owned_by": "pagedllm",
                 "root": self.roots.get(name, req.lora_path),
                 "parent": req.base_model_name or self.base_names[0], "max_model_len": max_model_len}
                for name, req in self.adapters.items()]


async def serve_lora_modules(engine: Any, base_names: list[str], engine_args: Any, values: Optional[list[str]],
                             metrics: Any = None, client_index: int = 0, num_clients: int = 1) -> LoRAModels:
    """The server's LoRAModels with the `--lora-modules` adapters loaded (ValueError naming the one that failed);
    API process `client_index` of `num_clients`."""
    loras = LoRAModels(engine, base_names, enabled=bool(engine_args.enable_lora))
    for module in parse_lora_modules(values):
        try:
            await loras.load(module.name, module.path, module.base_model_name)
        except (APIError, ValueError) as e:
            raise ValueError(f"--lora-modules {module.name}: {e}")
    if num_clients > 1:
        loras.share_ids(client_index, num_clients)
        engine.lora_listener = loras.apply_event
    if metrics is not None and loras.enabled:
        metrics.enable_lora_info(engine_args.max_loras, loras.names_by_id)
    return loras


def _check_runtime_updates() -> None:
    if not runtime_updates_allowed():
        raise APIError("Loading and unloading LoRA adapters at run time is off: start the server with "
                       "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (or PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING=1).",
                       status=404)


def loras_of(state: Any) -> LoRAModels:
    """The server's LoRAModels; a server built without one (no --enable-lora) answers with a clear 400."""
    loras = getattr(state, "loras", None)
    if loras is None:
        loras = LoRAModels(getattr(state, "engine", None), list(getattr(state, "served_model_names", [])),
                           enabled=False)
    return loras


async def load_lora_adapter(request: Request, loras: LoRAModels) -> Response:
    _check_runtime_updates()
    req = await parse_body(request, LoadLoRAAdapterRequest)
    await loras.load(req.lora_name, req.lora_path, req.base_model_name, load_inplace=req.load_inplace)
    return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.", media_type="text/plain")


async def unload_lora_adapter(request: Request, loras: LoRAModels) -> Response:
    _check_runtime_updates()
    req = await parse_body(request, UnloadLoRAAdapterRequest)
    await loras.unload(req.lora_name)
    return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.", media_type="text/plain")
