"""The engine-core process's side of the dashboard: the answer to one `GetDashboard` message.

Asked at most ~4 times a second, and only while a dashboard page is open. The KV grid is a copy of the block
pool's state bytes (`BlockPool.block_states`, kept by the pool itself), so the answer costs the engine a memcpy
of one byte per block plus a pass over the waiting queue, never a walk over blocks or running requests.
"""
from __future__ import annotations

import os
import platform
import sys
from typing import Any, Optional, Union

from pagedllm.core.request import RequestStatus
from pagedllm.entrypoints import messages as m


def dashboard_reply(core: Any, msg: m.GetDashboard, engine_index: int = 0) -> m.DashboardReply:
    scheduler = core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    preempted = sum(1 for r in scheduler.waiting if r.status == RequestStatus.PREEMPTED)
    return m.DashboardReply(seq=msg.seq, block_states=bytes(pool.block_states), num_preempted=preempted,
                            info=engine_info(core) if msg.with_info else None, engine_index=engine_index,
                            lora_requests=lora_requests(scheduler))


def lora_requests(scheduler: Any) -> Optional[dict[int, tuple[int, int]]]:
    """Adapter id (0: the base model) -> (running, waiting) requests; None without LoRA."""
    if scheduler.max_loras is None:
        return None
    counts: dict[int, list[int]] = {}
    for column, requests in ((0, scheduler.running), (1, scheduler.waiting)):
        for r in requests:
            counts.setdefault(r.lora_id or 0, [0, 0])[column] += 1
    return {k: (v[0], v[1]) for k, v in counts.items()}


def engine_info(core: Any) -> dict[str, Union[str, int]]:
    """Facts that do not change while the engine runs, as the engine resolved them (device, dtype, ...)."""
    import pagedllm

    args = core.engine_args
    worker = core.worker
    device = getattr(worker, "device", None)
    dtype = getattr(worker, "dtype", None)
    spec = getattr(worker, "speculative", None)
    info: dict[str, Union[str, int]] = {
        "device": str(device) if device is not None else str(args.device),
        "device_name": _device_name(device),
        "dtype": str(dtype).replace("torch.", "") if dtype is not None else str(args.dtype),
        "kv_cache_dtype": str(args.kv_cache_dtype),
        "quantization": str(getattr(args, "quantization", None) or "none"),
        "max_model_len": int(core.max_model_len),
        "block_size": int(core.block_size),
        "num_blocks": int(core.num_blocks),
        "max_num_seqs": int(getattr(worker, "max_num_seqs", args.max_num_seqs)),
        "max_num_batched_tokens": int(getattr(worker, "max_num_batched_tokens", 0) or 0),
        "tensor_parallel_size": int(args.tensor_parallel_size),
        "pipeline_parallel_size": int(args.pipeline_parallel_size),
        "prefix_caching": "on" if args.enable_prefix_caching else "off",
        "async_scheduling": "on" if getattr(core, "async_scheduling", False) else "off",
        "speculative": f"{spec.method} x{spec.num_speculative_tokens}" if spec is not None else "off",
        "lora": f"max {args.max_loras} adapters, rank {args.max_lora_rank}" if args.enable_lora else "off",
        "engine_pid": os.getpid(),
        "pagedllm": pagedllm.__version__,
        "python": platform.python_version(),
    }
    for lib in ("torch", "transformers"):
        mod = sys.modules.get(lib)
        version = getattr(mod, "__version__", None)
        if version is None:
            try:
                from importlib.metadata import version as dist_version

                version = dist_version(lib)
            except Exception:  # noqa: BLE001 - a missing library is reported as such
                version = "not installed"
        info[lib] = str(version)
    return info


def _device_name(device: Any) -> str:
    if device is None or getattr(device, "type", "") != "cuda":
        return platform.processor() or platform.machine()
    try:
        import torch

        return torch.cuda.get_device_name(device)
    except Exception:  # noqa: BLE001 - only a label
        return "cuda"
