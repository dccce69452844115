"""Tensor-parallel linear layers (Megatron/vLLM style) with a pluggable `LinearMethod`.

Sharding, for tensor-parallel size `tp` and rank `r`:
  ColumnParallelLinear    weight [out/tp, in]: rank r owns output rows r*out/tp ... ; no communication
                          (optionally all-gathers the output).
  MergedColumnParallelLinear  several column-parallel outputs stored as one matrix (gate_up_proj): each
                          logical shard is split across ranks separately, so rank r holds
                          [gate_r; up_r] and one matmul computes both.
  QKVParallelLinear       q/k/v fused the same way; with GQA the kv heads are split across ranks, or
                          replicated when tp > num_kv_heads (each kv head then serves tp/num_kv_heads ranks).
  RowParallelLinear       weight [out, in/tp]: consumes a column-parallel output and all-reduces the
                          partial sums (bias added once, on rank 0, before the reduce).

Every parameter carries `weight_loader(param, loaded_weight, shard_id=None)`, which takes the FULL
checkpoint tensor and copies this rank's slice into `param`. How weights are stored and multiplied is the
layer's `LinearMethod`: `UnquantizedLinearMethod`, or what the model's `quant_config`
(`pagedllm.quantization.QuantizationConfig`) hands the layer for its `prefix`. The loaders slice any parameter
by its tags (`input_dim`, `output_dim`, `packed_dim` + `pack_factor`, `per_shard`; see
`quantization.base.set_quant_param_attrs`), so quantized weights, scales, zero points and g_idx split with
the weights for merged (qkv, gate_up) and tensor-parallel layers.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import (get_tensor_model_parallel_rank,
                                                 get_tensor_model_parallel_world_size,
                                                 tensor_model_parallel_all_gather,
                                                 tensor_model_parallel_all_reduce)
from pagedllm.layers.activation import triton_kernels
from pagedllm.layers.weight_utils import copy_weight, set_weight_attrs

ShardId = Union[int, str, None]


def pack_factor_along(param: torch.Tensor, dim: int) -> int:
    """How many logical values one element of `param` holds along `dim` (8 for int32-packed 4-bit there)."""
    return getattr(param, "pack_factor", 1) if getattr(param, "packed_dim", None) == dim else 1


def load_replicated(layer: nn.Module, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """Load a parameter that every shard of a merged layer shares (GPTQ's g_idx, a [1, out]-less scale): the
    first shard's copy is taken, later ones must be equal (a merged layer cannot hold two different ones)."""
    key = next((n for n, p in layer.named_parameters(recurse=False) if p is param), str(id(param)))
    shared = layer.__dict__.setdefault("_shared_loaded", set())
    if key in shared and tuple(param.shape) == tuple(loaded_weight.shape) \
            and not torch.equal(param.data, loaded_weight.to(param.device, param.dtype)):
        raise ValueError(f"the shards fused into {getattr(layer, 'prefix', '') or 'this layer'} have different "
                         f"{key} tensors, which one fused layer cannot hold")
    copy_weight(param.data, loaded_weight.reshape(param.shape) if loaded_weight.numel() == param.numel()
                and loaded_weight.dim() != param.dim() else loaded_weight)
    shared.add(key)


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by the tensor parallel size {denominator}.")
    return numerator // denominator


def narrow_shard(loaded_weight: torch.Tensor, dim: int, shard_size: int, shard_index: int,
                 num_shards: int) -> torch.Tensor:
    """Shard `shard_index` of `num_shards` equal slices along `dim`, checking the full size first (a wrong
    config must fail loudly instead of silently loading a prefix of a larger tensor)."""
    if loaded_weight.shape[dim] != shard_size * num_shards:
        expected = list(loaded_weight.shape)
        expected[dim] = shard_size * num_shards
        raise ValueError(f"shape mismatch: the checkpoint has {tuple(loaded_weight.shape)}, the model expects "
                         f"{tuple(expected)}")
    return loaded_weight.narrow(dim, shard_index * shard_size, shard_size)


class LinearMethodBase:
    """How a linear layer stores its weight and computes `x @ W.T + b`. One per layer (a quantization config
    may share one instance across layers: keep per-layer state on the layer, not on the method)."""

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, weight_loader: Callable) -> None:
        """Register this rank's parameters on `layer` (tagging `input_dim`/`output_dim`/`weight_loader`)."""
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack weights once all are loaded (e.g. quantize, transpose for a kernel). Optional."""

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """This rank's weight as a dense [out, in] float tensor (references, tests, LoRA merging)."""
        raise NotImplementedError(f"{type(self).__name__} cannot dequantize its weight.")


class UnquantizedLinearMethod(LinearMethodBase):
    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, weight_loader):
        weight = nn.Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition,
                                          dtype=params_dtype), requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, "weight_loader": weight_loader})
        layer.register_parameter("weight", weight)

    def apply(self, layer, x, bias=None):
        done = _norm_gemv_result(layer, x, gated=False)
        if done is not None:
            return done
        gemv = gemv_kernels(x, layer.weight)
        if gemv is not None:
            return gemv.gemv(x, layer.weight, bias)
        packed = layer.__dict__.get("cpu_packed_weight")
        if packed is not None and x.dim() == 2 and not x.requires_grad:
            return cpu_packed_linear(x, packed, bias)
        return F.linear(x, layer.weight, bias)

    def apply_silu_and_mul(self, layer, x, bias=None) -> Optional[torch.Tensor]:
        """`silu(gate) * up` of a merged [gate; up] layer in one kernel, or None where that kernel does not apply
        (the caller then runs `apply` and the activation)."""
        done = _norm_gemv_result(layer, x, gated=True)
        if done is not None:
            return done
        gemv = gemv_kernels(x, layer.weight)
        return None if gemv is None else gemv.gemv(x, layer.weight, bias, gated=True)

    def dequantized_weight(self, layer):
        return layer.weight


def _norm_gemv_result(layer: nn.Module, x: torch.Tensor, gated: bool) -> Optional[torch.Tensor]:
    """The product the norm before `layer` computed with its own output x (ColumnParallelLinear.norm_and_gemv),
    taken once; None where it computed none for this x."""
    done = layer.__dict__.get("_norm_gemv")
    if done is None or done[0] is not x or done[1] != gated:
        return None
    del layer.__dict__["_norm_gemv"]
    return done[2]


def gemv_kernels(x: torch.Tensor, weight: torch.Tensor, lora: bool = False):
    """kernels.gemv when its few-row GEMVs handle `x @ weight.T` (CUDA, fp16/bf16, <= PAGEDLLM_GEMV_MAX_ROWS rows
    or 2 to PAGEDLLM_GEMV_MMA_MAX_ROWS on the tensor cores; lora: with a LoRA delta, the Triton GEMV's rows only)."""
    if not x.is_cuda:
        return None
    kernels = triton_kernels("gemv")
    return kernels if kernels is not None and kernels.gemv_applies(x, weight, lora) else None


# oneDNN's prepacked fp32 linear (the kernel torch.compile's CPU backend uses) beats MKL's sgemm through
# F.linear on this kind of CPU, most at decode-sized batches and for the LM head (docs/benchmarks.md, CPU).
_PACK_BATCH_HINT = 32


def cpu_pack_weight(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """A oneDNN-prepacked copy of a CPU float32 weight, or None where it does not apply."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)
    except (RuntimeError, AttributeError):  # a torch build without the oneDNN linear ops
        return None


def cpu_packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def pack_cpu_weights(model: nn.Module) -> int:
    """Prepack every unquantized linear weight (and the LM head) of a CPU float32 model; returns how many.
    The packed copy lives beside the parameter (not in state_dict) and is what decode steps multiply by."""
    count = 0
    for module in model.modules():
        pack_own = getattr(module, "pack_cpu_weights", None)  # a layer of several weights (the MoE experts)
        if callable(pack_own):
            count += pack_own()
            continue
        weight = getattr(module, "weight", None)
        is_linear = isinstance(getattr(module, "linear_method", None), UnquantizedLinearMethod)
        if weight is None or not (is_linear or hasattr(module, "compute_logits")):
            continue
        packed = cpu_pack_weight(weight)
        if packed is not None:
            module.__dict__["cpu_packed_weight"] = packed
            count += 1
            prepare_greedy = getattr(module, "prepare_cpu_greedy_screen", None)
            if prepare_greedy is not None:
                prepare_greedy()
    return count


class LinearBase(nn.Module):
    """Common state: sizes, dtype, tp rank/size and the LinearMethod."""

    def __init__(self, input_size: int, output_size: int, params_dtype: Optional[torch.dtype] = None,
                 linear_method: Optional[LinearMethodBase] = None, prefix: str = "",
                 quant_config: Any = None) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.prefix = prefix
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        if linear_method is None and quant_config is not None:
            linear_method = quant_config.get_linear_method(self, prefix)
        self.linear_method = linear_method or UnquantizedLinearMethod()

    def _create_bias(self, size: int, output_dim: Optional[int]) -> None:
        bias = nn.Parameter(torch.zeros(size, dtype=self.params_dtype), requires_grad=False)
        set_weight_attrs(bias, {"output_dim": output_dim, "weight_loader": self.weight_loader})
        self.register_parameter("bias", bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, tp={self.tp_size}, bias={self.bias is not None}"


class ColumnParallelLinear(LinearBase):
    """Y = X A^T with A split along its output rows; this rank computes Y[:, rank's columns]."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = False,
                 output_sizes: Optional[Sequence[int]] = None, **kwargs: Any) -> None:
        super().__init__(input_size, output_size, **kwargs)
        self.gather_output = gather_output
        self.output_size_per_partition = divide(output_size, self.tp_size)
        self.output_sizes = list(output_sizes) if output_sizes is not None else [output_size]
        # Logical sub-matrices (e.g. [gate, up]) as stored on this rank, in order.
        self.output_partition_sizes = [divide(size, self.tp_size) for size in self.output_sizes]
        self.linear_method.create_weights(self, input_size, self.output_partition_sizes, input_size, output_size,
                                          self.params_dtype, self.weight_loader)
        if bias:
            self._create_bias(self.output_size_per_partition, output_dim=0)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param, loaded_weight, shard_id=None):
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:
            load_replicated(self, param, loaded_weight)
            return
        loaded_weight = narrow_shard(loaded_weight, output_dim, param.data.shape[output_dim], self.tp_rank,
                                     self.tp_size)
        copy_weight(param.data, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear_method.apply(self, x, self.bias)  # [num_tokens, output_size_per_partition]
        if self.gather_output:
            out = tensor_model_parallel_all_gather(out, dim=-1)
        return out

    def norm_and_gemv(self, norm: nn.Module, x: torch.Tensor, residual: Optional[torch.Tensor]):
        """`norm(x, residual)`'s result, with this layer's product of it computed by the same kernel (the Triton
        GEMV with its norm: kernels/gemv.GemvNorm) and kept for this layer's call on the norm's output; None where
        that kernel does not take the rows (then the norm runs alone). Set up by layernorm.link_norm_gemv."""
        if self.gather_output or x.dim() != 2 or not x.is_contiguous() or x.shape[1] != self.weight.shape[1] \
                or (residual is not None and (residual.shape != x.shape or not residual.is_contiguous())):
            return None
        gated = self.__dict__.get("norm_gemv_gated", False)
        if gated and (len(self.output_partition_sizes) != 2
                      or self.output_partition_sizes[0] != self.output_partition_sizes[1]):
            return None
        kernels = gemv_kernels(x, self.weight)
        if kernels is None or kernels._rows_kernel(x.shape[0], self.weight, x) != "gemv":
            return None
        out = torch.empty_like(x)
        new_residual = None if residual is None else torch.empty_like(residual)
        spec = kernels.GemvNorm(norm.weight, norm.variance_epsilon, norm.fp32_product, out, residual, new_residual)
        product = kernels.gemv(x, self.weight, self.bias, gated=gated, mma=False, norm=spec)
        self.__dict__["_norm_gemv"] = (out, gated, product)
        return out if residual is None else (out, new_residual)

    def _load_shard(self, param: nn.Parameter, loaded_weight: torch.Tensor, dst_offset: int, shard_size: int,
                    src_shard_index: int, num_src_shards: int, shard_index: int = 0) -> None:
        """Copy slice `src_shard_index` (of `num_src_shards`) of logical shard number `shard_index` to output
        rows [dst_offset, +shard_size) (logical rows: divided by the pack factor along a packed output dim)."""
        if getattr(param, "per_shard", False):  # one value per logical shard (per-tensor scales of q/k/v)
            copy_weight(param.data[shard_index], loaded_weight.reshape(param.data[shard_index].shape))
            return
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:  # not split along the output (e.g. g_idx, a group_size=-1 scale): whole, once
            load_replicated(self, param, loaded_weight)
            return
        factor = pack_factor_along(param, output_dim)
        dst = param.data.narrow(output_dim, dst_offset // factor, shard_size // factor)
        copy_weight(dst, narrow_shard(loaded_weight, output_dim, shard_size // factor, src_shard_index,
                                      num_src_shards))

    def _load_fused(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_ids: Sequence[ShardId],
                    full_sizes: Sequence[int]) -> None:
        """A checkpoint that already stores the shards fused (e.g. `qkv_proj`): split and load each."""
        output_dim = getattr(param, "output_dim", None)
        if getattr(param, "per_shard", False) and loaded_weight.numel() == 1 < param.numel():
            # one per-tensor scale of the whole fused module (Phi-3's FP8 qkv_proj): each shard's
            copy_weight(param.data, loaded_weight.reshape(1).expand(param.shape[0]))
            return
        if output_dim is None or getattr(param, "per_shard", False):
            load_replicated(self, param, loaded_weight)
            return
        factor = pack_factor_along(param, output_dim)
        for shard_id, part in zip(shard_ids, loaded_weight.split([s // factor for s in full_sizes],
                                                                 dim=output_dim)):
            self.weight_loader(param, part, shard_id)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel linears over the same input, one matmul (e.g. gate_up_proj = [gate; up]).

    `shard_id` is the index of the logical output in `output_sizes`.
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = True, **kwargs: Any) -> None:
        super().__init__(input_size, sum(output_sizes), bias=bias, output_sizes=output_sizes, **kwargs)

    def weight_loader(self, param, loaded_weight, shard_id=None):
        if shard_id is None:
            self._load_fused(param, loaded_weight, range(len(self.output_sizes)), self.output_sizes)
            return
        assert isinstance(shard_id, int) and 0 <= shard_id < len(self.output_sizes), shard_id
        offset = sum(self.output_partition_sizes[:shard_id])
        self._load_shard(param, loaded_weight, offset, self.output_partition_sizes[shard_id], self.tp_rank,
                         self.tp_size, shard_index=shard_id)


    def silu_and_mul(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """For a [gate, up] layer: `silu(x @ gate^T) * (x @ up^T)` in one fused kernel where one applies, else None."""
        fused = getattr(self.linear_method, "apply_silu_and_mul", None)
        if fused is None or self.gather_output or len(self.output_partition_sizes) != 2 \
                or self.output_partition_sizes[0] != self.output_partition_sizes[1]:
            return None
        return fused(self, x, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection. Output on this rank: [q (num_heads*head_size) | k | v (num_kv_heads*head_size)].

    When tp > total_num_kv_heads each rank keeps one kv head, replicated on tp/total_num_kv_heads ranks.
    `shard_id` is "q", "k" or "v".
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: Optional[int] = None, bias: bool = True, **kwargs: Any) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.num_heads = divide(total_num_heads, tp_size)
        if tp_size >= self.total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, self.total_num_kv_heads)
        else:
            self.num_kv_heads = divide(self.total_num_kv_heads, tp_size)
            self.num_kv_head_replicas = 1
        self.q_size = self.num_heads * head_size  # on this rank
        self.kv_size = self.num_kv_heads * head_size
        super().__init__(hidden_size, (self.q_size + 2 * self.kv_size) * tp_size, bias=bias,
                         output_sizes=[self.q_size * tp_size, self.kv_size * tp_size, self.kv_size * tp_size],
                         **kwargs)

    def weight_loader(self, param, loaded_weight, shard_id=None):
        if shard_id is None:
            total_kv = self.total_num_kv_heads * self.head_size
            self._load_fused(param, loaded_weight, ("q", "k", "v"),
                             (self.total_num_heads * self.head_size, total_kv, total_kv))
            return
        if shard_id == "q":
            self._load_shard(param, loaded_weight, 0, self.q_size, self.tp_rank, self.tp_size, shard_index=0)
        elif shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            self._load_shard(param, loaded_weight, offset, self.kv_size, self.tp_rank // self.num_kv_head_replicas,
                             self.tp_size // self.num_kv_head_replicas, shard_index=1 if shard_id == "k" else 2)
        else:
            raise ValueError(f"QKVParallelLinear shard_id must be 'q', 'k' or 'v', got {shard_id!r}.")


class RowParallelLinear(LinearBase):
    """Y = X A^T with A split along its input columns; partial products are all-reduced across ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, input_is_parallel: bool = True,
                 reduce_results: bool = True, **kwargs: Any) -> None:
        super().__init__(input_size, output_size, **kwargs)
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.input_size_per_partition = divide(input_size, self.tp_size)
        self.linear_method.create_weights(self, self.input_size_per_partition, [output_size], input_size,
                                          output_size, self.params_dtype, self.weight_loader)
        if bias:
            self._create_bias(output_size, output_dim=None)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param, loaded_weight, shard_id=None):
        input_dim = getattr(param, "input_dim", None)
        if input_dim is None:
            load_replicated(self, param, loaded_weight)
            return
        loaded_weight = narrow_shard(loaded_weight, input_dim, param.data.shape[input_dim], self.tp_rank,
                                     self.tp_size)
        copy_weight(param.data, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel and self.tp_size > 1:
            x = x.chunk(self.tp_size, dim=-1)[self.tp_rank].contiguous()
        # The bias must enter the sum exactly once.
        bias = self.bias if self.tp_rank == 0 else None
        out = self.linear_method.apply(self, x, bias)  # [num_tokens, output_size] partial sum
        if self.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out


class ReplicatedLinear(LinearBase):
    """Y = X A^T with the whole weight on every rank: layers too small to split (MoE routers, the shared expert's
    gate), whose output every rank needs in full. Never quantized by the models that use it."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, **kwargs: Any) -> None:
        super().__init__(input_size, output_size, **kwargs)
        self.linear_method.create_weights(self, input_size, [output_size], input_size, output_size,
                                          self.params_dtype, self.weight_loader)
        if bias:
            self._create_bias(output_size, output_dim=None)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param, loaded_weight, shard_id=None):
        copy_weight(param.data, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x, self.bias)  # [num_tokens, output_size]
