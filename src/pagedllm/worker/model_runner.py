"""ModelRunner: BatchPlan -> input tensors + attention metadata -> forward -> sample -> ModelOutput.

The runner keeps its own per-request state (token ids, block table, sampling parameters), updated from the
plan's diffs; it never reads scheduler objects. One host sync per step: the sampled token ids.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from pagedllm.attention.backend import get_attention_backend
from pagedllm.core.batch_plan import BatchPlan, ModelOutput, NewRequestData, TokenLogprobs
from pagedllm.forward_context import AttentionMetadata, set_forward_context
from pagedllm.layers.sampler import Sampler, SamplingMetadata
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.kv_cache import KVCacheSpec, allocate_kv_caches

logger = logging.getLogger(__name__)


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt + every output token known to the runner
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    lora_id: Optional[int] = None
    prompt_tensor: Optional[torch.Tensor] = field(default=None, repr=False)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


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
        self.requests: dict[str, CachedRequestState] = {}
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

    # ------------------------------------------------------------------ state updates
    def _update_states(self, plan: BatchPlan) -> None:
        for req_id in plan.finished_request_ids:
            self.requests.pop(req_id, None)
        for new in plan.new_requests:
            self.requests[new.request_id] = self._new_state(new)
        for cached in plan.cached_requests:
            state = self.requests[cached.request_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    @staticmethod
    def _new_state(new: NewRequestData) -> CachedRequestState:
        return CachedRequestState(req_id=new.request_id, token_ids=list(new.token_ids),
                                  num_prompt_tokens=new.num_prompt_tokens, sampling_params=new.sampling_params,
                                  block_ids=list(new.block_ids), num_computed_tokens=new.num_computed_tokens,
                                  lora_id=new.lora_id)

    # ------------------------------------------------------------------ inputs
    def _prepare_inputs(self, plan: BatchPlan):
        req_ids = list(plan.num_scheduled_tokens)
        num_reqs = len(req_ids)
        bs = self.block_size
        num_tokens = plan.total_num_scheduled_tokens
        input_ids = np.empty(num_tokens, dtype=np.int64)
        positions = np.empty(num_tokens, dtype=np.int64)
        slot_mapping = np.empty(num_tokens, dtype=np.int64)
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
        seq_lens = np.empty(num_reqs, dtype=np.int32)
        max_blocks = 1
        states = []
        sample_rows = []  # indices (in req order) of requests that sample this step
        offset = 0
        for i, req_id in enumerate(req_ids):
            state = self.requests[req_id]
            states.append(state)
            n = plan.num_scheduled_tokens[req_id]
            start = state.num_computed_tokens
            end = start + n
            input_ids[offset:offset + n] = state.token_ids[start:end]
            pos = np.arange(start, end)
            positions[offset:offset + n] = pos
            block_ids = np.asarray(state.block_ids, dtype=np.int64)
            slot_mapping[offset:offset + n] = block_ids[pos // bs] * bs + pos % bs
            offset += n
            query_start_loc[i + 1] = offset
            seq_lens[i] = end
            max_blocks = max(max_blocks, len(state.block_ids))
            if end >= len(state.token_ids):
                sample_rows.append(i)
        block_table = np.zeros((num_reqs, max_blocks), dtype=np.int32)
        for i, state in enumerate(states):
            block_table[i, :len(state.block_ids)] = state.block_ids
        return req_ids, states, sample_rows, input_ids, positions, slot_mapping, query_start_loc, seq_lens, \
            block_table

    # ------------------------------------------------------------------ execute
    @torch.inference_mode()
    def execute_model(self, plan: BatchPlan) -> ModelOutput:
        self._update_states(plan)
        if plan.total_num_scheduled_tokens == 0:
            return ModelOutput()
        (req_ids, states, sample_rows, input_ids, positions, slot_mapping, query_start_loc, seq_lens,
         block_table) = self._prepare_inputs(plan)
        num_tokens = len(input_ids)
        dev = self.device
        max_query_len = int(np.max(np.diff(query_start_loc)))
        metadata = AttentionMetadata(
            num_actual_tokens=num_tokens,
            num_reqs=len(req_ids),
            max_query_len=max_query_len,
            max_seq_len=int(seq_lens.max()),
            query_start_loc=torch.from_numpy(query_start_loc).to(dev, non_blocking=True),
            seq_lens=torch.from_numpy(seq_lens).to(dev, non_blocking=True),
            block_table=torch.from_numpy(block_table).to(dev, non_blocking=True),
            slot_mapping=torch.from_numpy(slot_mapping).to(dev, non_blocking=True),
            query_start_loc_cpu=query_start_loc.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        input_ids_t = torch.from_numpy(input_ids).to(dev, non_blocking=True)
        positions_t = torch.from_numpy(positions).to(dev, non_blocking=True)
        hidden = None
        if self.cuda_graphs is not None and max_query_len == 1:
            hidden = self.cuda_graphs.run(input_ids_t, positions_t, metadata)
        if hidden is None:
            self.attn_backend.prepare(metadata)
            with set_forward_context(metadata, self.attn_backend):
                hidden = self.model(input_ids_t, positions_t)
        output = ModelOutput(req_ids=req_ids, sampled_token_ids=[[] for _ in req_ids],
                             logprobs=[None for _ in req_ids])
        if not sample_rows:
            return output
        logits_idx = torch.from_numpy(query_start_loc[1:][sample_rows] - 1).to(dev, non_blocking=True).long()
        logits = self.model.compute_logits(hidden[logits_idx])
        sample_states = [states[i] for i in sample_rows]
        meta = SamplingMetadata.build(
            params=[s.sampling_params for s in sample_states],
            prompt_token_ids=[s.token_ids[:s.num_prompt_tokens] for s in sample_states],
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
        for j, row in enumerate(sample_rows):
            token = sampled[j]
            states[row].token_ids.append(token)
            output.sampled_token_ids[row] = [token]
            k = states[row].sampling_params.logprobs
            if lp is not None and k is not None:
                output.logprobs[row] = [TokenLogprobs(token_ids=lp_ids[j][:k + 1], logprobs=lp_vals[j][:k + 1],
                                                      ranks=lp_ranks[j][:k + 1])]
        return output
