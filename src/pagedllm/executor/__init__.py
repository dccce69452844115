"""Executors: what runs the model for the engine core, behind the Worker interface
(`launch(plan) -> pending`, `execute_model(plan)`, `empty_output()`, `shutdown()` and the model facts the core
reads: model_dir, hf_config, max_model_len, vocab_size, eos_token_ids, num_blocks, max_num_seqs,
max_num_batched_tokens, async_scheduling).

  * uniproc  (world size 1, the default): the Worker itself, in the engine core's process - no extra cost.
  * mp       (tensor / pipeline parallel, or asked for): one spawned process per rank (executor/multiproc.py).
  * ray      (asked for): the same worker processes placed on a Ray cluster (executor/ray_executor.py).
"""
from __future__ import annotations

from typing import Any


def make_executor(args: Any) -> Any:
    backend = args.distributed_executor_backend
    world_size = args.tensor_parallel_size * args.pipeline_parallel_size
    if backend is None:
        backend = "uni" if world_size == 1 and args.nnodes == 1 else "mp"
    if backend == "uni":
        if world_size != 1:
            raise ValueError("--distributed-executor-backend uni runs one device; use mp (or ray) for "
                             f"tensor_parallel_size x pipeline_parallel_size = {world_size}.")
        from pagedllm.executor.uniproc import UniprocExecutor

        return UniprocExecutor(args)
    if backend == "ray":
        from pagedllm.executor.ray_executor import RayExecutor

        return RayExecutor(args)
    from pagedllm.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(args)
