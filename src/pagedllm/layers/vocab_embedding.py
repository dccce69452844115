"""Vocabulary-parallel token embedding and LM head.

The vocabulary is padded to a multiple of `padding_size * tp` and split into equal contiguous ranges, one
per tensor-parallel rank. Rows past the real vocabulary are zero and their logits are cut off, so padding
never reaches the sampler.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import envs
from pagedllm.distributed.parallel_state import (get_tensor_model_parallel_rank,
                                                 get_tensor_model_parallel_world_size,
                                                 tensor_model_parallel_all_gather,
                                                 tensor_model_parallel_all_reduce)
from pagedllm.kernels import cpu_ops
from pagedllm.kernels.gguf_ops import gguf_embedding, gguf_matmul, logical_rows
from pagedllm.layers.linear import cpu_packed_linear, gemv_kernels
from pagedllm.layers.weight_utils import copy_weight, set_weight_attrs
from pagedllm.structured_output.bitmask import apply_token_bitmask_

DEFAULT_VOCAB_PADDING_SIZE = 64


def pad_vocab_size(vocab_size: int, pad_to: int = DEFAULT_VOCAB_PADDING_SIZE) -> int:
    return ((vocab_size + pad_to - 1) // pad_to) * pad_to


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows [vocab_start_index, vocab_end_index) live on this rank.

    Invariant: `weight` is [num_embeddings_per_partition, embedding_dim]; rows for ids >= org_vocab_size
    are zero.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, params_dtype: Optional[torch.dtype] = None,
                 padding_size: int = DEFAULT_VOCAB_PADDING_SIZE, prefix: str = "") -> None:
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.org_vocab_size = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, padding_size * self.tp_size)
        self.num_embeddings_per_partition = self.num_embeddings_padded // self.tp_size
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.prefix = prefix
        weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim,
                                          dtype=params_dtype or torch.get_default_dtype()), requires_grad=False)
        set_weight_attrs(weight, {"output_dim": 0, "weight_loader": self.weight_loader})
        self.weight = weight

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if loaded_weight.shape[0] != self.org_vocab_size:
            raise ValueError(f"shape mismatch: the checkpoint has {tuple(loaded_weight.shape)}, the model expects "
                             f"({self.org_vocab_size}, {self.embedding_dim}) (vocab_size from config.json)")
        num_rows = max(0, min(self.vocab_end_index, self.org_vocab_size) - self.vocab_start_index)
        copy_weight(param.data[:num_rows], loaded_weight[self.vocab_start_index:self.vocab_start_index + num_rows])
        param.data[num_rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [num_tokens] -> [num_tokens, embedding_dim]
        if "gguf_type" in self.__dict__:  # rows kept in a GGUF block format (kernels/gguf_ops.py)
            return gguf_embedding(input_ids, self.gguf_weight, self.__dict__["gguf_type"], self.embedding_dim,
                                  self.__dict__["gguf_dtype"])
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index) * in_range
        out = F.embedding(local_ids, self.weight)
        out.masked_fill_(~in_range.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)

    def extra_repr(self) -> str:
        return (f"vocab={self.org_vocab_size} (padded {self.num_embeddings_padded}), dim={self.embedding_dim}, "
                f"tp={self.tp_size}")


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection sharded over the vocabulary like the embedding (so the two can be tied)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
                 prefix: str = "") -> None:
        super().__init__(num_embeddings, embedding_dim, params_dtype, padding_size, prefix)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.num_embeddings_per_partition, dtype=self.weight.dtype),
                                     requires_grad=False)
            set_weight_attrs(self.bias, {"output_dim": 0, "weight_loader": self._bias_loader})
        else:
            self.register_parameter("bias", None)

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> "ParallelLMHead":
        """Share the embedding's parameter (`tie_word_embeddings`): one tensor, loaded once."""
        self.weight = embed_tokens.weight
        return self

    def _bias_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        num_rows = max(0, min(self.vocab_end_index, self.org_vocab_size) - self.vocab_start_index)
        copy_weight(param.data[:num_rows], loaded_weight[self.vocab_start_index:self.vocab_start_index + num_rows])
        param.data[num_rows:].zero_()

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # hidden_states: [num_tokens, hidden] -> logits [num_tokens, org_vocab_size] float32
        return self._logits(hidden_states).to(torch.float32).contiguous()

    def _logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[num_tokens, org_vocab_size] logits in the product's dtype (the model dtype), all ranks gathered."""
        packed = self.__dict__.get("cpu_packed_weight")
        if "gguf_type" in self.__dict__:  # a GGUF-packed LM head (quantization/gguf.py)
            rows = logical_rows(self.gguf_weight, self.__dict__["gguf_type"])
            return gguf_matmul(hidden_states, [self.gguf_weight], [self.__dict__["gguf_type"]],
                               None if self.bias is None else self.bias[:rows], rows)
        gemv = gemv_kernels(hidden_states, self.weight)
        if packed is not None:
            logits = cpu_packed_linear(hidden_states, packed, self.bias)
        elif gemv is not None:  # one decode row on CUDA: the weight-streaming GEMV (kernels/gemv.py)
            logits = gemv.gemv(hidden_states, self.weight, self.bias)
        else:
            logits = F.linear(hidden_states, self.weight, self.bias)
        logits = tensor_model_parallel_all_gather(logits, dim=-1)
        if logits.shape[-1] != self.org_vocab_size:
            logits = logits[..., :self.org_vocab_size]
        return logits

    # ---- exact greedy decoding on CPU through a bf16 screen (see kernels/csrc/cpu_ops.cpp: greedy_screen)

    def prepare_cpu_greedy_screen(self) -> bool:
        """Keep a oneDNN-packed bf16 copy of the (fp32, CPU, unsharded, bias-free) weight and its row norms.

        The bf16 product runs at twice the fp32 rate and reads half the bytes; an error bound then narrows
        the vocabulary to a few candidates whose logits are recomputed exactly (the LM head's time halves:
        docs/benchmarks.md, CPU section)."""
        w = self.weight
        if w.device.type != "cpu" or w.dtype != torch.float32 or self.tp_size != 1 or self.bias is not None:
            return False
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().to(torch.bfloat16), 32)
            probe = torch.ops.mkldnn._linear_pointwise(torch.zeros(1, w.shape[1], dtype=torch.bfloat16), packed,
                                                        None, "none", [], "")
        except (RuntimeError, AttributeError):  # no bf16 oneDNN linear in this build / on this CPU
            return False
        if probe.dtype != torch.bfloat16 or probe.shape != (1, w.shape[0]):
            return False
        self.__dict__["cpu_greedy_screen"] = (packed, w.detach().norm(dim=1).float().contiguous())
        return True

    def greedy_token_ids(self, hidden_states: torch.Tensor,
                         token_bitmask: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """argmax of compute_logits(hidden_states) per row, or None where no shortcut applies.

        On CUDA: the argmax of the logits in the model dtype. compute_logits only widens them to fp32, which is
        exact and keeps their order, so the argmax (first index among equal maxima) is the same; it skips
        writing and re-reading fp32 logits. For few rows a split Triton argmax spreads each row over many SMs.
        On CPU: an exact bf16 screen (below).
        token_bitmask (int32 [N, ceil(V/32)], structured outputs): the argmax is taken over the allowed tokens only
        (forbidden logits, and forbidden screen values, are -inf)."""
        if hidden_states.is_cuda:
            logits = self._logits(hidden_states)
            if token_bitmask is not None:
                apply_token_bitmask_(logits, token_bitmask)
            if envs.PAGEDLLM_USE_TRITON_KERNELS and logits.dim() == 2:
                from pagedllm.kernels.argmax import argmax_rows

                return argmax_rows(logits)
            return logits.argmax(dim=-1)
        screen = self.__dict__.get("cpu_greedy_screen")
        if screen is None or hidden_states.dim() != 2 or hidden_states.dtype != torch.float32:
            return None
        ops = cpu_ops.usable(hidden_states)
        if ops is None:
            return None
        packed, norms = screen
        x = hidden_states.contiguous()
        approx = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), packed, None, "none", [], "")
        if token_bitmask is not None:  # a forbidden token is never a candidate (its bound is NaN, never >= thr)
            apply_token_bitmask_(approx[:, :self.org_vocab_size], token_bitmask)
        hidden = x.shape[1]
        # |approx - logit| <= c |x| |w_t| + out_err |approx|: bf16 rounding of x and w (2^-8 each), fp32
        # accumulation over `hidden` terms, and the bf16 rounding of the output (2^-7, conservatively).
        c = 2.0 ** -7 + 2.0 ** -16 + 1.01 * hidden * 2.0 ** -24
        out = torch.empty(x.shape[0], dtype=torch.int64)
        ops.greedy_screen(out, approx, x, self.weight, norms, self.org_vocab_size, c, 2.0 ** -7,
                          _GREEDY_MAX_CANDIDATES)
        missed = (out < 0).nonzero().flatten()
        if missed.numel():  # too many near-ties to screen: those rows take the full fp32 logits
            logits = self.compute_logits(x.index_select(0, missed))
            if token_bitmask is not None:
                apply_token_bitmask_(logits, token_bitmask.index_select(0, missed))
            out[missed] = logits.argmax(dim=-1)
        return out

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is not called directly; use compute_logits(hidden_states).")


# Rows with more candidate tokens than this (after the bf16 screen) fall back to full fp32 logits.
_GREEDY_MAX_CANDIDATES = 256
