"""Tensor-parallel world: which rank this process is, how many there are, and the collectives layers use.

Until `initialize_model_parallel()` runs (the single-device case) the world is one rank: rank 0 of size 1,
and every collective is the identity, so layers never need to branch on "is distributed on".

With several ranks the executor, in each worker process, calls
    init_distributed_environment(world_size, rank, distributed_init_method, local_rank)
    initialize_model_parallel(tensor_model_parallel_size)
(the executor's worker processes also pass pipeline_model_parallel_size) and the layers' `tensor_model_parallel_all_reduce` / `..._all_gather` become real torch.distributed calls
on the tensor-parallel group (NCCL on CUDA, gloo on CPU).

Invariant: all tensor-parallel ranks build the same model and call the same collectives in the same order.
"""
from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass
class GroupCoordinator:
    """One process group plus this process's place in it.

    `device_group` carries tensors (NCCL on CUDA, gloo on CPU); `cpu_group` (gloo) the host-side barrier and
    integer minimum.
    """

    ranks: list[int]  # global ranks in the group, in group order
    rank_in_group: int
    device_group: Any = None  # torch.distributed ProcessGroup, None for a one-rank group
    cpu_group: Any = None

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place (returns x)."""
        if self.world_size == 1:
            return x
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim`, in rank order."""
        if self.world_size == 1:
            return x
        dim = dim % x.dim()
        x = x.contiguous()
        # [world_size, *x.shape]: rank-major, then moved next to `dim` and merged into it.
        out = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
        if dist.get_backend(self.device_group) == "nccl":
            dist.all_gather_into_tensor(out, x, group=self.device_group)
        else:
            dist.all_gather(list(out.unbind(0)), x, group=self.device_group)
        out = out.movedim(0, dim)
        return out.reshape(*x.shape[:dim], self.world_size * x.shape[dim], *x.shape[dim + 1:])

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Broadcast from the group's `src`-th rank, in place."""
        if self.world_size == 1:
            return x
        dist.broadcast(x, src=self.ranks[src], group=self.device_group)
        return x

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.cpu_group)

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def send(self, x: torch.Tensor, dst: int) -> None:
        """Point-to-point send to the group's `dst`-th rank (pipeline activations)."""
        dist.send(x.contiguous(), dst=self.ranks[dst], group=self.device_group)

    def recv(self, shape: tuple, dtype: torch.dtype, device: torch.device, src: int) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(out, src=self.ranks[src], group=self.device_group)
        return out

    def all_reduce_min_int(self, value: int) -> int:
        """The smallest `value` over the group (e.g. the KV block count every rank can hold)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


_SINGLE = GroupCoordinator(ranks=[0], rank_in_group=0)
_TP: Optional[GroupCoordinator] = None
_PP: Optional[GroupCoordinator] = None
_WORLD: Optional[GroupCoordinator] = None
_GROUP_KWARGS: dict = {}


def init_distributed_environment(world_size: int = 1, rank: int = 0, distributed_init_method: str = "env://",
                                 local_rank: int = 0, backend: Optional[str] = None,
                                 timeout_s: Optional[float] = None) -> None:
    """Join the global torch.distributed world (no-op for one rank or if already initialized).

    `timeout_s` bounds the rendezvous and every later collective: a rank that died or hangs makes the others
    fail with an error instead of waiting forever."""
    if world_size == 1 or dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    logger.info("Initializing torch.distributed: rank %d of %d (%s, %s).", rank, world_size, backend,
                distributed_init_method)
    global _GROUP_KWARGS
    kwargs = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    _GROUP_KWARGS = kwargs  # sub-groups get the same timeout (new_group's default is 30 minutes)
    if distributed_init_method.startswith("store://"):  # a TCPStore hosted by the engine core (Ray executor)
        host, port = distributed_init_method[len("store://"):].rsplit(":", 1)
        store = dist.TCPStore(host, int(port), world_size, is_master=False,
                              timeout=kwargs.get("timeout", datetime.timedelta(minutes=30)))
        dist.init_process_group(backend=backend, store=store, world_size=world_size, rank=rank, **kwargs)
        return
    dist.init_process_group(backend=backend, init_method=distributed_init_method, world_size=world_size,
                            rank=rank, **kwargs)


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1) -> None:
    """Split the world into tensor-parallel groups of `tensor_model_parallel_size` consecutive ranks and
    pipeline groups of the ranks with the same place in their tensor group (global rank = stage * tp + tp rank).
    """
    global _TP, _PP, _WORLD
    if tensor_model_parallel_size * pipeline_model_parallel_size == 1 and not dist.is_initialized():
        _TP = _PP = _WORLD = _SINGLE
        return
    if not dist.is_initialized():
        raise RuntimeError("tensor_model_parallel_size > 1 needs init_distributed_environment() first.")
    world_size = dist.get_world_size()
    if world_size % tensor_model_parallel_size != 0:
        raise ValueError(f"World size {world_size} is not divisible by tensor_model_parallel_size "
                         f"{tensor_model_parallel_size}.")
    rank = dist.get_rank()
    # Every rank must create every group, in the same order (torch.distributed's rule).
    for start in range(0, world_size, tensor_model_parallel_size):
        ranks = list(range(start, start + tensor_model_parallel_size))
        device_group = dist.new_group(ranks, **_GROUP_KWARGS)
        cpu_group = dist.new_group(ranks, backend="gloo", **_GROUP_KWARGS)
        if rank in ranks:
            _TP = GroupCoordinator(ranks=ranks, rank_in_group=ranks.index(rank), device_group=device_group,
                                   cpu_group=cpu_group)
    tp = tensor_model_parallel_size
    num_stages = world_size // tp
    if pipeline_model_parallel_size not in (1, num_stages):
        raise ValueError(f"World size {world_size} is not tensor_model_parallel_size {tp} x "
                         f"pipeline_model_parallel_size {pipeline_model_parallel_size}.")
    for first in range(tp):
        ranks = list(range(first, world_size, tp))
        device_group = dist.new_group(ranks, **_GROUP_KWARGS)
        cpu_group = dist.new_group(ranks, backend="gloo", **_GROUP_KWARGS)
        if rank in ranks:
            _PP = GroupCoordinator(ranks=ranks, rank_in_group=ranks.index(rank), device_group=device_group,
                                   cpu_group=cpu_group)
    _WORLD = GroupCoordinator(ranks=list(range(world_size)), rank_in_group=rank, device_group=dist.group.WORLD,
                              cpu_group=dist.new_group(list(range(world_size)), backend="gloo", **_GROUP_KWARGS))


def get_tp_group() -> GroupCoordinator:
    return _TP if _TP is not None else _SINGLE


def get_pp_group() -> GroupCoordinator:
    return _PP if _PP is not None else _SINGLE


def get_world_group() -> GroupCoordinator:
    return _WORLD if _WORLD is not None else _SINGLE


def get_tensor_model_parallel_rank() -> int:
    return get_tp_group().rank_in_group


def get_tensor_model_parallel_world_size() -> int:
    return get_tp_group().world_size


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return get_tp_group().all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return get_tp_group().all_gather(x, dim)


def destroy_model_parallel() -> None:
    global _TP, _PP, _WORLD
    _TP = _PP = _WORLD = None


def destroy_distributed_environment() -> None:
    destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
