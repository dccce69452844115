"""Parallel layout checks, done once before any worker starts: each failure is one sentence saying what to
change (a TP size that does not divide the heads, more ranks than devices, more stages than layers)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class ParallelLayout:
    tensor_parallel_size: int
    pipeline_parallel_size: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def node_ranks(self, node_rank: Optional[int] = None) -> range:
        node = self.node_rank if node_rank is None else node_rank
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    @property
    def output_rank(self) -> int:
        """The rank that reports sampled tokens: the first rank of the last pipeline stage."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size

    @property
    def init_method(self) -> str:
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"tcp://{host}:{self.master_port}"

    @property
    def driver_port(self) -> int:
        """Where the head node's engine core hands plans to the workers of every node."""
        return self.master_port + 1


def layout_from_args(args: Any, master_port: Optional[int] = None) -> ParallelLayout:
    from pagedllm import envs

    addr = args.master_addr or envs.MASTER_ADDR or "127.0.0.1"
    port = args.master_port or (int(envs.MASTER_PORT) if envs.MASTER_PORT else None) or master_port
    return ParallelLayout(args.tensor_parallel_size, args.pipeline_parallel_size, args.nnodes, args.node_rank,
                          addr, port or DEFAULT_MASTER_PORT)


def check_layout(layout: ParallelLayout, hf_config: Any, device_type: str, num_devices: int) -> None:
    tp, pp = layout.tensor_parallel_size, layout.pipeline_parallel_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {heads} attention heads; "
                         f"use a divisor of {heads}.")
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"tensor_parallel_size={tp} and the model's {kv_heads} KV heads do not divide one "
                         "another; use a tensor_parallel_size that divides or is a multiple of "
                         f"{kv_heads}.")
    inter = getattr(hf_config, "intermediate_size", None)
    if inter and inter % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's intermediate size {inter}.")
    layers = hf_config.num_hidden_layers
    if pp > layers:
        raise ValueError(f"pipeline_parallel_size={pp} is larger than the model's {layers} layers; use at most "
                         f"{layers}.")
    if layout.world_size % layout.nnodes:
        raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {layout.world_size} ranks do not "
                         f"split evenly over --nnodes {layout.nnodes}.")
    if not 0 <= layout.node_rank < layout.nnodes:
        raise ValueError(f"--node-rank {layout.node_rank} must be in [0, {layout.nnodes}).")
    if device_type == "cuda" and layout.ranks_per_node > num_devices:
        raise ValueError(f"{layout.ranks_per_node} ranks per node (tensor_parallel_size={tp} x "
                         f"pipeline_parallel_size={pp} / nnodes={layout.nnodes}) need {layout.ranks_per_node} "
                         f"GPUs but this node has {num_devices}.")
