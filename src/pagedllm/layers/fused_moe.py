"""The experts of a mixture-of-experts block: routing, the expert weights stacked per layer, their loaders.

Weights (per tensor-parallel rank; I = intermediate size / tp):
  gate_up_proj [E, 2I, H]   rows [gate_r; up_r] of every expert (transformers >= 5 names it so too)
  down_proj    [E, H, I]
Tensor parallelism splits each expert's intermediate dimension, as the dense MLP's gate_up / down are split
(column-parallel gate and up, row-parallel down): every rank holds every expert, computes a partial down
product for the tokens routed to it, and the partial sums are all-reduced once per layer.

Forward (`FusedMoE.forward(x, router_logits)`):
  routing: softmax of the router logits in fp32, top-k, renormalized over the k when the config says so
  CUDA (Triton): kernels/fused_moe.py's `fused_moe_routed`, graph-capturable (no host sync, sizes fixed by the
  token count; at decode sizes the routing runs inside the first expert kernel)
  CPU (and CUDA without Triton): `experts_forward_native`: assignments sorted by expert, one pair of matmuls
  per expert that got tokens, the weighted results summed per token in fp32.

Checkpoint layouts the loader takes (`weight_loader(param, tensor, shard_id, expert_id)`):
  per expert (the hub's Mixtral w1/w3/w2, Qwen's gate_proj/up_proj/down_proj): shard "gate"/"up" [I_full, H],
  "down" [H, I_full] with expert_id; stacked over experts (GGUF's ffn_*_exps): the same with a leading E and
  expert_id None; transformers 5's fused `gate_up_proj` [E, 2 I_full, H] as shard "gate_up".
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import (get_tensor_model_parallel_rank,
                                                 get_tensor_model_parallel_world_size,
                                                 tensor_model_parallel_all_reduce)
from pagedllm.layers.activation import SiluAndMul, triton_kernels
from pagedllm.layers.linear import cpu_pack_weight, cpu_packed_linear, narrow_shard
from pagedllm.layers.weight_utils import copy_weight, set_weight_attrs

SHARDS = ("gate", "up", "down")


def route_native(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] -> (topk_weights float32 [T, k], topk_ids int64 [T, k]), as transformers' routers."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_forward_native(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                           topk_ids: torch.Tensor, packed: Optional[tuple[list, list]] = None) -> torch.Tensor:
    """x [T, H] -> [T, H]: the assignments grouped by expert, one gate_up and one down matmul per expert that has
    any, each result scaled by its routing weight and its token's k results summed in fp32. `packed`: every
    expert's oneDNN-prepacked gate_up and down weights (CPU float32: `FusedMoE.pack_cpu_weights`)."""
    num_tokens, hidden = x.shape
    num_experts = w13.shape[0]
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)  # [M] assignment ids grouped by expert
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    token_of = order // top_k
    xs = x.index_select(0, token_of)  # [M, H]
    ys = torch.empty(xs.shape, dtype=x.dtype, device=x.device)
    act_fn = SiluAndMul()
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        if packed is not None:
            act = act_fn(cpu_packed_linear(xs[rows], packed[0][e], None))  # [count, I]
            ys[rows] = cpu_packed_linear(act, packed[1][e], None)  # [count, H]
        else:
            act = act_fn(F.linear(xs[rows], w13[e]))
            torch.mm(act, w2[e].t(), out=ys[rows])
        start += count
    scaled = ys.float() * topk_weights.reshape(-1)[order].float()[:, None]
    # back to assignment order, then each token's k rows summed (index_add_ with repeated rows is far slower on CPU)
    per_assignment = torch.empty_like(scaled).index_copy_(0, order, scaled)
    return per_assignment.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)


def experts_forward_dense(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                          topk_ids: torch.Tensor) -> torch.Tensor:
    """Every expert over every token, weighted by its routing weight (0 where not picked): no host sync, for CUDA
    graph capture without Triton (a debugging configuration; E times the work)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    act_fn = SiluAndMul()
    for e in range(w13.shape[0]):
        weight = (topk_weights.float() * (topk_ids == e)).sum(dim=1)  # [T]
        out += weight[:, None] * F.linear(act_fn(F.linear(x, w13[e])), w2[e]).float()
    return out.to(x.dtype)


class FusedMoE(nn.Module):
    """The experts of one MoE layer (the router is the model's: it passes the logits in).

    Invariant: after loading, every expert's gate, up and down shard was loaded exactly as the checkpoint holds
    it (`missing_shards()` names any that were not)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, reduce_results: bool = True, params_dtype: Optional[torch.dtype] = None,
                 prefix: str = "") -> None:
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        if intermediate_size % self.tp_size:
            raise ValueError(f"tensor_parallel_size={self.tp_size} does not divide the experts' intermediate size "
                             f"{intermediate_size}; use a divisor of {intermediate_size}.")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"{prefix}: {top_k} experts per token is not in [1, {num_experts}].")
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.intermediate_size_per_partition = intermediate_size // self.tp_size
        self.renormalize = renormalize
        self.reduce_results = reduce_results
        self.prefix = prefix
        dtype = params_dtype or torch.get_default_dtype()
        inter = self.intermediate_size_per_partition
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size, dtype=dtype),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, inter, dtype=dtype), requires_grad=False)
        for param in (self.gate_up_proj, self.down_proj):
            set_weight_attrs(param, {"weight_loader": self.weight_loader})
        self._loaded: set[tuple[Optional[int], str]] = set()

    # ---- loading

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str,
                      expert_id: Optional[int] = None) -> None:
        """Copy this rank's slice of a checkpoint tensor (layouts: the module docstring)."""
        if shard_id == "gate_up":
            half = loaded.shape[-2] // 2
            self.weight_loader(param, loaded.narrow(-2, 0, half), "gate", expert_id)
            self.weight_loader(param, loaded.narrow(-2, half, half), "up", expert_id)
            return
        if shard_id not in SHARDS:
            raise ValueError(f"unknown expert shard {shard_id!r}")
        if (param is self.down_proj) != (shard_id == "down"):
            raise ValueError(f"shard {shard_id!r} does not belong in {self.prefix}")
        stacked = expert_id is None
        if stacked and (loaded.dim() != 3 or loaded.shape[0] != self.num_experts):
            raise ValueError(f"expected {self.num_experts} stacked experts, got a tensor of shape "
                             f"{tuple(loaded.shape)}")
        if not stacked and not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert {expert_id} is out of range: the layer has {self.num_experts} experts")
        inter = self.intermediate_size_per_partition
        dst = param.data if stacked else param.data[expert_id]
        if shard_id == "down":  # [.., H, I]: split the input dimension
            part = narrow_shard(loaded, loaded.dim() - 1, inter, self.tp_rank, self.tp_size)
        else:  # [.., I, H]: split the output rows; gate rows first, then up
            part = narrow_shard(loaded, loaded.dim() - 2, inter, self.tp_rank, self.tp_size)
            dst = dst.narrow(dst.dim() - 2, 0 if shard_id == "gate" else inter, inter)
        copy_weight(dst, part)
        self._loaded.add((expert_id, shard_id))

    def missing_shards(self) -> list[str]:
        """'expert N gate|up|down' for every shard no checkpoint tensor has filled."""
        missing = []
        for e in range(self.num_experts):
            for shard in SHARDS:
                if (e, shard) not in self._loaded and (None, shard) not in self._loaded:
                    missing.append(f"expert {e} {shard}")
        return missing

    # ---- forward

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        # x [T, H], router_logits [T, E] -> [T, H] (summed over ranks when reduce_results)
        kernels = triton_kernels("fused_moe") if x.is_cuda else None
        out = None
        if kernels is not None:  # the routing inside the experts' kernels where they can take it
            out = kernels.fused_moe_routed(x, router_logits, self.gate_up_proj, self.down_proj, self.top_k,
                                           self.renormalize)
        else:
            topk_weights, topk_ids = route_native(router_logits, self.top_k, self.renormalize)
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                out = experts_forward_dense(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)
        if out is None:
            out = experts_forward_native(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids,
                                         self.__dict__.get("cpu_packed_experts") if x.dtype == torch.float32 else None)
        if self.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out

    def pack_cpu_weights(self) -> int:
        """oneDNN-prepacked copies of every expert's weights for the CPU path (called by
        `linear.pack_cpu_weights`: MKL's sgemm is several times slower at the few rows an expert gets per step);
        they live beside the parameters, not in the state dict. Returns how many weights were packed."""
        gate_up = [cpu_pack_weight(self.gate_up_proj[e]) for e in range(self.num_experts)]
        down = [cpu_pack_weight(self.down_proj[e]) for e in range(self.num_experts)]
        if any(p is None for p in gate_up + down):
            return 0
        self.__dict__["cpu_packed_experts"] = (gate_up, down)
        return len(gate_up) + len(down)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size_per_partition} (x{self.tp_size}), "
                f"renormalize={self.renormalize}")
