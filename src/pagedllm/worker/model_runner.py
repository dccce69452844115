"""ModelRunner: BatchPlan -> input tensors + attention metadata -> forward -> sample -> ModelOutput.

The runner keeps its own per-request state (token ids, block table, sampling parameters), updated from the
plan's diffs; it never reads scheduler objects. One host sync per step: the sampled token ids.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import numpy as np
import torch

from pagedllm.attention.backend import get_attention_backend
from pagedllm.core.batch_plan import BatchPlan, ModelOutput, TokenLogprobs
from pagedllm.forward_context import AttentionMetadata, set_forward_context
from pagedllm.layers.sampler import Sampler, SamplingMetadata
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.kv_cache import KVCacheSpec, allocate_kv_caches

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, *, hf_config, device: torch.device, dtype: torch.dtype,
                 block_size: int, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                 eos_token_id: Optional[int], vocab_size: int, attention_backend: Optional[str] = None,
                 enforce_eager: bool = True) -> None:
        self.model = model
        self.hf_config = hf_config
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_blocks_per_req = -(-max_model_len // block_size)
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self.attn_backend = get_attention_backend(attention_backend, device)
        self.sampler = Sampler()
        self.input_batch = InputBatch(max_num_seqs, max_model_len, self.max_blocks_per_req, block_size)
        self.kv_caches: list[torch.Tensor] = []
        self.enforce_eager = enforce_eager or device.type != "cuda"
        self.cuda_graphs = None  # set by initialize_kv_cache on CUDA

    # ------------------------------------------------------------------ KV cache
    def kv_cache_spec(self) -> KVCacheSpec:
        layers = self.model.attn_layers
        first = layers[0]
        return KVCacheSpec(num_layers=len(layers), num_kv_heads=first.num_kv_heads, head_size=first.head_size,
                           block_size=self.block_size, dtype=self.dtype)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        spec = self.kv_cache_spec()
        # One extra block past the scheduler's pool: the scratch block CUDA-graph padding rows write into.
        self.scratch_block = num_blocks
        self.kv_caches = allocate_kv_caches(spec, num_blocks + (0 if self.enforce_eager else 1), self.device)
        for layer, cache in zip(self.model.attn_layers, self.kv_caches):
            layer.kv_cache = cache
        self.num_blocks = num_blocks
        if not self.enforce_eager:
            from pagedllm.worker.cuda_graph import CudaGraphRunner

            self.cuda_graphs = CudaGraphRunner(self)
            self.cuda_graphs.capture()

    @torch.inference_mode()
    def profile_run(self) -> None:
        """A forward over max_num_batched_tokens dummy tokens (no KV cache) to find peak activation memory."""
        num_tokens = self.max_num_batched_tokens
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device) % self.max_model_len
        hidden = self.model(input_ids, positions)
        idx = torch.arange(min(self.max_num_seqs, num_tokens), device=self.device)
        self.model.compute_logits(hidden[idx])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ execute
    @torch.inference_mode()
    def execute_model(self, plan: BatchPlan) -> ModelOutput:
        batch = self.input_batch
        batch.update(plan)
        if plan.total_num_scheduled_tokens == 0:
            return ModelOutput()
        inp = batch.prepare(plan)
        dev = self.device
        metadata = AttentionMetadata(
            num_actual_tokens=len(inp.input_ids),
            num_reqs=len(inp.req_ids),
            max_query_len=inp.max_query_len,
            max_seq_len=int(inp.seq_lens.max()),
            query_start_loc=torch.from_numpy(inp.query_start_loc).to(dev, non_blocking=True),
            seq_lens=torch.from_numpy(inp.seq_lens).to(dev, non_blocking=True),
            block_table=torch.from_numpy(inp.block_table).to(dev, non_blocking=True),
            slot_mapping=torch.from_numpy(inp.slot_mapping).to(dev, non_blocking=True),
            query_start_loc_cpu=inp.query_start_loc.tolist(),
            seq_lens_cpu=inp.seq_lens.tolist(),
        )
        input_ids = torch.from_numpy(inp.input_ids).to(dev, non_blocking=True)
        positions = torch.from_numpy(inp.positions).to(dev, non_blocking=True)
        hidden = None
        if self.cuda_graphs is not None and inp.max_query_len == 1:
            hidden = self.cuda_graphs.run(input_ids, positions, metadata)
        if hidden is None:
            self.attn_backend.prepare(metadata)
            with set_forward_context(metadata, self.attn_backend):
                hidden = self.model(input_ids, positions)
        num_reqs = len(inp.req_ids)
        output = ModelOutput(req_ids=inp.req_ids, sampled_token_ids=[[] for _ in range(num_reqs)],
                             logprobs=[None] * num_reqs)
        sample_rows = inp.sample_rows
        if len(sample_rows) == 0:
            return output
        if len(sample_rows) == len(inp.input_ids):  # every token samples (pure decode)
            sample_hidden = hidden
        else:
            idx = torch.from_numpy(inp.query_start_loc[1:][sample_rows] - 1).to(dev, non_blocking=True)
            sample_hidden = hidden[idx.long()]
        logits = self.model.compute_logits(sample_hidden)
        sample_states = [inp.states[i] for i in sample_rows]
        meta = SamplingMetadata.build(
            params=[s.sampling_params for s in sample_states],
            prompt_token_ids=[s.prompt_token_ids for s in sample_states],
            output_token_ids=[s.output_token_ids for s in sample_states],
            eos_token_ids=[None if s.sampling_params.ignore_eos else self.eos_token_id for s in sample_states],
            vocab_size=logits.shape[-1],
            device=dev,
        )
        sampler_out = self.sampler(logits, meta)
        sampled = sampler_out.sampled_token_ids.tolist()  # the one host sync per step
        lp = sampler_out.logprobs
        if lp is not None:
            lp_ids, lp_vals, lp_ranks = (t.tolist() for t in lp)
        for j, row in enumerate(sample_rows.tolist()):
            token = sampled[j]
            batch.append_token(inp.states[row], token)
            output.sampled_token_ids[row] = [token]
            k = inp.states[row].sampling_params.logprobs
            if lp is not None and k is not None:
                output.logprobs[row] = [TokenLogprobs(token_ids=lp_ids[j][:k + 1], logprobs=lp_vals[j][:k + 1],
                                                      ranks=lp_ranks[j][:k + 1])]
        return output
