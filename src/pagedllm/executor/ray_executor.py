"""The Ray executor (`--distributed-executor-backend ray`): the same worker ranks as executor/multiproc.py,
each run inside a Ray actor placed on a running Ray cluster (one GPU per rank on GPU clusters), so a cluster
that Ray already manages needs no per-node `pagedllm serve --node-rank` command.

Ray is an optional extra (`pip install "pagedllm[ray]"`), imported only when this backend is asked for.
The engine core (this process) hosts the torch.distributed store and the plan socket; ranks reach both over
TCP at this node's address. `ray.init()` joins the cluster named by $RAY_ADDRESS (or `ray start` on this
machine), else starts a local one.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from pagedllm import envs
from pagedllm.executor.multiproc import MultiprocExecutor, _free_port, collective_timeout_s
from pagedllm.executor.parallel_config import ParallelLayout
from pagedllm.executor.worker_proc import RANK_DEFAULTS, WorkerSpec

logger = logging.getLogger("pagedllm.executor")


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ValueError("--distributed-executor-backend ray needs Ray, which is not installed: "
                         "pip install 'pagedllm[ray]' (or use the default mp backend).") from None
    return ray


class _RayRank:
    """A rank's actor, with the process-handle interface the executor polls (poll / kill / wait / pid)."""

    def __init__(self, ray: Any, actor: Any, ref: Any, pid: int) -> None:
        self.ray, self.actor, self.ref, self.pid = ray, actor, ref, pid
        self._code: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self._code is None:
            done, _ = self.ray.wait([self.ref], timeout=0)
            if done:
                try:
                    self._code = int(self.ray.get(done[0]))
                except Exception:  # noqa: BLE001 - the actor died (node lost, killed)
                    self._code = -9
        return self._code

    def kill(self) -> None:
        self.ray.kill(self.actor, no_restart=True)

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        self.ray.wait([self.ref], timeout=timeout)
        return self.poll()


class _RankActor:
    def pid(self) -> int:
        import os

        return os.getpid()

    def run(self, spec: WorkerSpec) -> int:
        from pagedllm.executor.worker_proc import run_worker

        return run_worker(spec, watch_parent=False)


class RayExecutor(MultiprocExecutor):
    remote_workers = True

    def __init__(self, args: Any, log_level: str = "INFO") -> None:
        self.ray = import_ray()
        if not self.ray.is_initialized():
            self.ray.init(ignore_reinit_error=True, log_to_driver=True)
        self._store = None
        super().__init__(args, log_level)

    def _make_layout(self, args: Any, local_only: bool) -> ParallelLayout:
        import datetime

        import torch.distributed as dist

        ip = self.ray.util.get_node_ip_address()
        port = _free_port()
        # This process hosts the rendezvous store, so rank 0 may run on any node of the cluster.
        self._store = dist.TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=collective_timeout_s()))
        # driver_port is master_port + 1: the plan socket; the store's port is passed to the ranks separately.
        self._store_addr = f"store://{ip}:{port}"
        return ParallelLayout(args.tensor_parallel_size, args.pipeline_parallel_size, 1, 0, ip, _free_port() - 1)

    def _start_workers(self, args: Any, layout: ParallelLayout, addr: str, log_level: str) -> dict:
        ray = self.ray
        cuda = args.device != "cpu" and _cluster_has_gpus(ray)
        # One GPU per rank on GPU clusters; CPU ranks take no CPU reservation (torch threads are set per rank).
        # Ray starts the ranks' processes: pagedllm's variables for them go in their runtime environment.
        actor_cls = ray.remote(num_cpus=0, num_gpus=1 if cuda else 0,
                               runtime_env={"env_vars": envs.child_vars(**RANK_DEFAULTS)})(_RankActor)
        ranks = {}
        for rank in range(layout.world_size):
            actor = actor_cls.remote()
            spec = WorkerSpec(rank=rank, local_rank=0, layout=layout, engine_args=args,
                              init_method=self._store_addr, driver_addr=addr, timeout_s=collective_timeout_s(),
                              num_threads=1, log_level=log_level)
            pid = ray.get(actor.pid.remote())  # before run(): an actor runs its calls one at a time
            ranks[rank] = _RayRank(ray, actor, actor.run.remote(spec), pid)
        return ranks

    def shutdown(self) -> None:
        super().shutdown()
        self._store = None


def _cluster_has_gpus(ray: Any) -> bool:
    return ray.cluster_resources().get("GPU", 0) > 0
