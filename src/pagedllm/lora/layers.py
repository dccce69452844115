"""LoRA-aware wrappers around the model's linear layers, and the batched delta they add.

`LoRALinear` keeps the base layer (whatever its LinearMethod: unquantized, fp8, int8, GGUF, ...) and adds,
for every token of the step at once, `x @ A[slot]^T @ B[slot]` where `slot` is the device slot of that token's
adapter (or none). Weights are never merged and adapters are never run one at a time:
  CUDA: kernels/lora.py's shrink + expand (tokens gathered by slot, Punica style); on steps of a few rows
        (decode, verify) the few-token shrink / expand kernels, which load A / B before the PDL wait, gate_up's
        expand applying the SiLU-and-mul, and for a layer fed by a norm alone (qkv, gate_up) the shrink computed by
        the norm kernel (`norm_and_shrink`): five launches per decoder layer beyond the base model's instead of
        eight plus the unfused SiLU.
  CPU:  one matmul against every slot's A, a mask keeping each token's own slot, one matmul against every B.

A merged layer (qkv_proj = [q; k; v], gate_up_proj = [gate; up]) stacks its slices: A [S, n_slices * R, in],
B [S, R, out] with slice j's columns at the same output rows as in the base weight.

Tensor parallelism slices the adapter like the base weight: a column-parallel layer keeps A whole and this
rank's rows of each slice of B; a row-parallel layer keeps this rank's columns of A and all of B, and adds
its partial delta before the all-reduce (the delta is linear in the partial shrink, so the sum is exact).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from pagedllm.distributed.parallel_state import tensor_model_parallel_all_reduce
from pagedllm.layers.activation import triton_kernels
from pagedllm.layers.linear import (ColumnParallelLinear, LinearBase, MergedColumnParallelLinear, QKVParallelLinear,
                                    RowParallelLinear, UnquantizedLinearMethod, gemv_kernels)

# The few-row path (shrink in the norm, few-token shrink / expand kernels); False runs the general shrink / expand
# kernels at every size. For A/B tests and benchmarks only.
FUSED_DECODE = True
# Most rows for which a norm computes its consumer's shrink (beyond, the shrink kernel reads A once per slot).
NORM_SHRINK_MAX_ROWS = 8
# The split-KV decode attention's reduce kernel computes o_proj's shrink of its output on few-row steps (a launch
# less per decoder layer). False: the separate few-token shrink (the A/B: benchmarks/lora.py latency --ab-fold).
FOLD_O_SHRINK = True
# The few-row path's expand in the base layer's GEMV (kernels/gemv.py, `lora=`) where that kernel takes the base
# layer (unquantized, <= PAGEDLLM_GEMV_MAX_ROWS rows): no expand launch of its own. False: the separate expand
# kernels (the A/B: benchmarks/lora.py latency --ab-gemv, benchmarks/gpu_lora.sh gemv).
GEMV_EXPAND = True


@dataclass
class LoRASlice:
    """One logical output of a layer (e.g. the k of qkv_proj) as this rank stores it."""

    peft_name: str  # module name in a PEFT checkpoint, e.g. "model.layers.0.self_attn.k_proj"
    out_offset: int  # first row of this slice in the layer's local output
    out_size: int  # rows on this rank
    full_out: int  # rows in the checkpoint (all ranks)
    shard_index: int  # which of num_shards equal slices of the checkpoint rows this rank holds
    num_shards: int


class LoRABatchState:
    """The step's token -> slot map, shared by every LoRALinear of a model.

    On CUDA the tensors are persistent buffers refreshed by device copies before each forward, so captured CUDA
    graphs replay whatever adapters the next batch uses. `active` (host) is False when no token of the step
    has an adapter; eager forwards then skip the delta (a graph is captured for each value).
    """

    def __init__(self, max_num_tokens: int, num_slots: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.device = device
        self.active = False
        self.token_slots = torch.full((max_num_tokens,), -1, dtype=torch.int32, device=device)  # -1: no adapter
        self.sorted_token_ids = torch.zeros(max_num_tokens, dtype=torch.int32, device=device)
        self.slot_starts = torch.zeros(num_slots + 1, dtype=torch.int32, device=device)
        # kernels/lora.lora_shrink_rows' per-token split counters (zero between kernels)
        self.split_counters = torch.zeros(max_num_tokens, dtype=torch.int32, device=device)

    def load(self, token_slots: torch.Tensor, sorted_token_ids: torch.Tensor, slot_starts: torch.Tensor,
             active: bool) -> None:
        n = token_slots.shape[0]
        self.token_slots[:n].copy_(token_slots, non_blocking=True)
        self.sorted_token_ids[:sorted_token_ids.shape[0]].copy_(sorted_token_ids, non_blocking=True)
        self.slot_starts.copy_(slot_starts, non_blocking=True)
        self.active = active

    def clear(self) -> None:
        self.slot_starts.zero_()
        self.active = False


class LoRALinear(nn.Module):
    """A linear layer plus the batched LoRA delta of device slots 0..num_slots-1."""

    def __init__(self, base: LinearBase, slices: list[LoRASlice], state: LoRABatchState, num_slots: int,
                 rank: int, row_parallel: bool) -> None:
        super().__init__()
        self.base_layer = base
        self.slices = slices
        self.state = state
        self.rank = rank  # padded: a power of two >= 16 (the kernels' tile)
        self.row_parallel = row_parallel
        self.in_local = getattr(base, "input_size_per_partition", base.input_size)
        self.out_local = getattr(base, "output_size_per_partition", base.output_size)
        dtype = base.params_dtype
        device = state.device
        # [S, n_slices * R, in] and [S, R, out]; slots start (and are reset to) zero.
        self.register_buffer("lora_a", torch.zeros(num_slots, len(slices) * rank, self.in_local, dtype=dtype,
                                                   device=device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(num_slots, rank, self.out_local, dtype=dtype, device=device),
                             persistent=False)
        self._slice_spans = [(s.out_offset, s.out_size) for s in slices]
        self._pending: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (a norm's output, its shrink)

    def __getattr__(self, name: str) -> Any:  # the base layer's attributes (sizes, tp rank, linear_method...)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["base_layer"], name)

    # ---- slots ----------------------------------------------------------------------------------------

    def expected_shapes(self) -> dict[str, tuple[int, int]]:
        """PEFT module name -> (in_features, out_features) of the full (unsharded) checkpoint module."""
        return {s.peft_name: (self.base_layer.input_size, s.full_out) for s in self.slices}

    def fused_names(self) -> dict[str, list[str]]:
        """A merged layer's own PEFT name -> its slices' names (row order): Phi-3's checkpoints, and so its PEFT
        adapters, keep qkv_proj / gate_up_proj whole."""
        prefix = getattr(self.base_layer, "prefix", "")
        if len(self.slices) < 2 or not prefix:
            return {}
        return {prefix: [s.peft_name for s in self.slices]}

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy an adapter's A / B*scaling (full checkpoint shapes, host) into `slot`; modules it lacks get zeros."""
        r = self.rank
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        base = self.base_layer
        for j, s in enumerate(self.slices):
            pair = weights.get(s.peft_name)
            if pair is None:
                continue
            a, b = pair  # [rank, in], [full_out, rank]
            rank = a.shape[0]
            if self.row_parallel:
                a = a.narrow(1, base.tp_rank * self.in_local, self.in_local)
            else:
                b = b.narrow(0, s.shard_index * s.out_size, s.out_size)
            self.lora_a[slot, j * r:j * r + rank].copy_(a)
            self.lora_b[slot, :rank, s.out_offset:s.out_offset + s.out_size].copy_(b.t())

    # ---- forward --------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        if not self.row_parallel:
            out = self._few_rows(x, base.bias) if self.state.active else None
            if out is None:
                out = base.linear_method.apply(base, x, base.bias)  # [T, out_local]
                if self.state.active:
                    self.add_delta(x, out)
            return out
        if not base.input_is_parallel and base.tp_size > 1:
            x = x.chunk(base.tp_size, dim=-1)[base.tp_rank].contiguous()
        bias = base.bias if base.tp_rank == 0 else None
        out = self._few_rows(x, bias) if self.state.active else None
        if out is None:
            out = base.linear_method.apply(base, x, bias)
            if self.state.active:
                self.add_delta(x, out)  # this rank's partial delta joins the partial sums before the reduce
        if base.reduce_results and base.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out

    def silu_and_mul(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The base layer's fused gate_up + SiLU; with adapters, the few-row path's expand + SiLU (the delta must come
        before the activation), else None (the caller runs forward and the activation)."""
        if self.state.active:
            return self._few_rows(x, self.base_layer.bias, gated=True)
        fused = getattr(self.base_layer, "silu_and_mul", None)
        return None if fused is None else fused(x)

    def _few_rows(self, x: torch.Tensor, bias: Optional[torch.Tensor], gated: bool = False
                  ) -> Optional[torch.Tensor]:
        """A step's few rows on CUDA: the shrink (the norm's, or the few-token kernel's), the base layer, then the
        few-token expand (gated: with SiLU-and-mul). None where this path does not apply."""
        if not (FUSED_DECODE and x.is_cuda and x.dim() == 2 and 0 < x.shape[0]):
            return None
        kernels = triton_kernels("lora")
        if kernels is None or x.shape[0] > kernels.SHRINK_ROWS_MAX:
            return None
        spans = self._slice_spans
        if gated and not (len(spans) == 2 and spans[1] == (spans[0][1], spans[0][1])
                          and 2 * spans[0][1] == self.out_local):
            return None
        h = self._shrink(x)
        base = self.base_layer
        slots = self.state.token_slots
        if GEMV_EXPAND and type(base.linear_method) is UnquantizedLinearMethod:
            gemv = gemv_kernels(x, base.weight, lora=True)
            if gemv is not None:
                starts = () if gated else tuple(off for off, _ in spans[1:])
                return gemv.gemv(x, base.weight, bias, gated=gated,
                                 lora=gemv.GemvLoRA(h, self.lora_b, slots, starts))
        out = base.linear_method.apply(base, x, bias)
        if gated:
            return kernels.lora_expand_rows(h, self.lora_b, out, slots, silu=True)
        kernels.lora_expand_rows(h, self.lora_b, out, slots, tuple(off for off, _ in spans[1:]))
        return out

    def _shrink(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """x's shrink partial sums [SPLIT, T, n_slices * R]: the one the norm before computed, else the kernel's."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] is x:
            return pending[1]
        kernels = triton_kernels("lora")
        if kernels is None:
            return None
        x2 = x if x.stride(-1) == 1 else x.contiguous()
        state = self.state
        if FUSED_DECODE and x2.shape[0] <= kernels.SHRINK_ROWS_MAX:
            return kernels.lora_shrink_rows(x2, self.lora_a, state.token_slots, state.split_counters)
        return kernels.lora_shrink(x2, self.lora_a, state.sorted_token_ids, state.slot_starts)

    def norm_and_shrink(self, norm: nn.Module, x: torch.Tensor, residual: Optional[torch.Tensor]):
        """`norm(x, residual)` (the RMSNorm whose output is this layer's input alone) with this layer's shrink
        computed by the same kernel on few-row CUDA steps with adapters; None where that does not apply (the norm
        then runs alone). The shrink waits for `forward` / `silu_and_mul`, which take it only for that output."""
        state = self.state
        if not (state.active and FUSED_DECODE and x.dim() == 2 and 0 < x.shape[0] <= NORM_SHRINK_MAX_ROWS
                and (residual is None or residual.shape == x.shape) and x.shape[1] == self.in_local):
            return None
        kernels = triton_kernels("norm")
        if kernels is None:
            return None
        out, new_residual, h = kernels.rms_norm_shrink(x, residual, norm.weight, norm.variance_epsilon,
                                                       norm.fp32_product, self.lora_a, state.token_slots)
        self._pending = (out, h)
        return out if residual is None else (out, new_residual)

    def attention_output_shrink(self, num_tokens: int, width: int) -> Optional[Any]:
        """For o_proj: a `kernels.paged_attention.OutputShrink` the decode attention before it may compute on
        few-row CUDA steps with adapters (FOLD_O_SHRINK), else None."""
        state = self.state
        if not (FOLD_O_SHRINK and FUSED_DECODE and state.active and state.device.type == "cuda"
                and self.lora_a.shape[2] == width):
            return None
        kernels, attention = triton_kernels("lora"), triton_kernels("paged_attention")
        if kernels is None or attention is None or not 0 < num_tokens <= kernels.SHRINK_ROWS_MAX:
            return None
        h = torch.empty((1, num_tokens, self.lora_a.shape[1]), dtype=torch.float32, device=state.device)
        return attention.OutputShrink(self.lora_a, state.token_slots, state.split_counters, h)

    def take_output_shrink(self, out: torch.Tensor, shrink: Any) -> None:
        """The attention computed this layer's shrink of `out` (its next input): forward takes it for that tensor."""
        self._pending = (out, shrink.h)

    def add_delta(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += x @ A[slot(t)]^T @ B[slot(t)] for every token t with an adapter, in place."""
        state = self.state
        if x.is_cuda:
            kernels = triton_kernels("lora")
            if kernels is not None:
                h = self._shrink(x)
                kernels.lora_expand(h, self.lora_b, out, state.sorted_token_ids, state.slot_starts,
                                    self._slice_spans)
                return
        out += batched_lora_delta(x, self.lora_a, self.lora_b, state.token_slots[:x.shape[0]],
                                  self._slice_spans).to(out.dtype)


def batched_lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor,
                       slices: list[tuple[int, int]]) -> torch.Tensor:
    """The delta of every token in two matmuls (the CPU path; also a reference): x [T, in], a [S, n*R, in],
    b [S, R, out], token_slots [T] (-1 = none) -> [T, out]."""
    num_slots, nr, _ = a.shape
    r = b.shape[1]
    num_tokens = x.shape[0]
    h = x @ a.reshape(num_slots * nr, -1).t()  # [T, S * n * R]: every slot's shrink
    own = torch.nn.functional.one_hot((token_slots.long() + 1).clamp(min=0), num_slots + 1)[:, 1:]  # [T, S]
    h = h.view(num_tokens, num_slots, nr) * own.to(h.dtype)[:, :, None]  # other slots' columns -> 0
    out = x.new_zeros((num_tokens, b.shape[2]))
    b_rows = b.reshape(num_slots * r, -1)  # [S * R, out]
    for j, (off, n) in enumerate(slices):
        hj = h[:, :, j * r:(j + 1) * r].reshape(num_tokens, num_slots * r)
        out[:, off:off + n] = hj @ b_rows[:, off:off + n]
    return out


def lora_slices(layer: LinearBase, stacked_params_mapping: list[tuple[str, str, Any]]) -> Optional[list[LoRASlice]]:
    """The PEFT-named slices of a linear layer (None for a layer LoRA cannot target)."""
    prefix = getattr(layer, "prefix", "")
    if not prefix:
        return None
    head, _, leaf = prefix.rpartition(".")
    parts = [(weight, shard) for param, weight, shard in stacked_params_mapping if param == leaf]

    def name(weight: str) -> str:
        return f"{head}.{weight}" if head else weight

    if isinstance(layer, QKVParallelLinear):
        if len(parts) != 3:
            return None
        by_shard = {shard: weight for weight, shard in parts}
        kv_full = layer.total_num_kv_heads * layer.head_size
        reps = layer.num_kv_head_replicas
        kv_shards = (layer.tp_rank // reps, layer.tp_size // reps)
        return [LoRASlice(name(by_shard["q"]), 0, layer.q_size, layer.total_num_heads * layer.head_size,
                          layer.tp_rank, layer.tp_size),
                LoRASlice(name(by_shard["k"]), layer.q_size, layer.kv_size, kv_full, *kv_shards),
                LoRASlice(name(by_shard["v"]), layer.q_size + layer.kv_size, layer.kv_size, kv_full, *kv_shards)]
    if isinstance(layer, MergedColumnParallelLinear):
        if len(parts) != len(layer.output_sizes):
            return None
        by_shard = {shard: weight for weight, shard in parts}
        slices, offset = [], 0
        for i, (full, local) in enumerate(zip(layer.output_sizes, layer.output_partition_sizes)):
            slices.append(LoRASlice(name(by_shard[i]), offset, local, full, layer.tp_rank, layer.tp_size))
            offset += local
        return slices
    if isinstance(layer, ColumnParallelLinear):
        return [LoRASlice(prefix, 0, layer.output_size_per_partition, layer.output_size, layer.tp_rank,
                          layer.tp_size)]
    if isinstance(layer, RowParallelLinear):
        return [LoRASlice(prefix, 0, layer.output_size, layer.output_size, 0, 1)]
    return None
