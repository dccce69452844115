"""Worker nodes of a multi-node engine: `pagedllm serve M -tp T -pp P --nnodes N --node-rank R
--master-addr HEAD --master-port PORT` with R > 0 starts this node's share of the ranks, which join the head's
torch.distributed rendezvous (HEAD:PORT) and take their plans from the head's engine core (HEAD:PORT+1). Only
the head serves HTTP. The process exits when its ranks do: 0 on a clean shutdown, else 1.
"""
from __future__ import annotations

import logging
import signal
import tempfile
import time
from typing import Any

logger = logging.getLogger("pagedllm.executor")


def run_worker_node(args: Any) -> int:
    from pagedllm.executor.multiproc import check_devices, prepare_model, spawn_local_workers
    from pagedllm.executor.parallel_config import layout_from_args

    try:
        _, hf_config = prepare_model(args)  # GGUF conversion once per node, before the ranks start
        layout = layout_from_args(args)
        check_devices(args, layout, hf_config)
    except ValueError as e:
        print(f"error: {e}")
        return 2
    driver = f"tcp://{layout.master_addr}:{layout.driver_port}"
    ranks = list(layout.node_ranks())
    logger.info("Node %d of %d: starting ranks %d-%d for the head at %s.", layout.node_rank, layout.nnodes,
                ranks[0], ranks[-1], driver)
    with tempfile.TemporaryDirectory(prefix="pagedllm-node-") as spec_dir:
        procs = spawn_local_workers(args, layout, driver, spec_dir)
        stop = {"signal": False}

        def on_signal(signum, frame) -> None:  # noqa: ARG001
            stop["signal"] = True

        old = signal.signal(signal.SIGTERM, on_signal)
        try:
            while True:
                codes = {rank: p.poll() for rank, p in procs.items()}
                failed = {r: c for r, c in codes.items() if c not in (None, 0)}
                if failed or stop["signal"]:
                    for p in procs.values():
                        if p.poll() is None:
                            p.kill()
                    if failed:
                        rank, code = next(iter(failed.items()))
                        print(f"error: worker rank {rank} exited with code {code}")
                        return 1
                    return 0
                if all(c == 0 for c in codes.values()):
                    return 0
                time.sleep(0.2)
        except KeyboardInterrupt:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
            return 0
        finally:
            signal.signal(signal.SIGTERM, old)
