"""ModelRunner: BatchPlan -> input tensors + attention metadata -> forward -> sample -> ModelOutput.

The runner keeps its own per-request state (token ids, block table, sampling parameters), updated from the
plan's diffs; it never reads scheduler objects. One host sync per step: the sampled token ids.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

import numpy as np
import torch

from pagedllm import envs
from pagedllm.attention.backend import get_attention_backend
from pagedllm.compilation_config import GraphSettings
from pagedllm.core.batch_plan import BatchPlan, ModelOutput, TokenLogprobs
from pagedllm.core.kv_cache_groups import KVCacheGroups
from pagedllm.forward_context import AttentionMetadata, set_forward_context, with_kv_groups
from pagedllm.layers.attention import check_backend_features
from pagedllm.layers.sampler import (Sampler, SamplerOutput, SamplingMetadata, _to_device, draws_as_is,
                                     gather_logprobs, penalized_prompt, warm_up_device_sampling)
from pagedllm.worker.grammar_mask import greedy_token_ids, step_token_bitmask
from pagedllm.worker.host_stager import HostStager
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.kv_cache import (
    KVCacheSpec,
    allocate_kv_caches,
    attn_layer_index,
    model_kv_cache_groups,
    check_kv_cache_backend,
    copy_kv_blocks,
    kv_cache_backend,
)
from pagedllm.worker.sampling_batch import fast_metadata

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, *, hf_config, device: torch.device, dtype: torch.dtype,
                 block_size: int, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                 eos_token_id: Optional[int], vocab_size: int, attention_backend: Optional[str] = None,
                 enforce_eager: bool = True, kv_cache_dtype: Optional[torch.dtype] = None,
                 kv_groups: Optional[KVCacheGroups] = None, logprobs_mode: str = "raw_logprobs",
                 graph_settings: Optional[GraphSettings] = None, prompt_embeds: bool = False) -> None:
        """kv_groups: the model's KV-cache groups (core/kv_cache_groups.py; by default from the layers' windows).
        logprobs_mode: what sampled tokens' logprobs report (vLLM's; layers/sampler.py). graph_settings: which CUDA
        graphs to capture (vLLM's compilation_config; compilation_config.py). prompt_embeds: the engine takes
        prompt embeddings (enable_prompt_embeds): only then does a step look for them."""
        self.model = model
        self.prompt_embeds = prompt_embeds
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
        self.kv_cache_dtype = kv_cache_dtype or dtype
        self.attn_backend = get_attention_backend(kv_cache_backend(self.kv_cache_dtype, attention_backend, device),
                                                  device)
        check_kv_cache_backend(self.kv_cache_dtype, self.attn_backend)
        check_backend_features(model.attn_layers, self.attn_backend)
        self.sampler = Sampler()
        self.graph_settings = graph_settings or GraphSettings()
        self.logprobs_mode = logprobs_mode
        # A sequence classifier's head (models/llama.SequenceClassifier; a pipeline stage wraps the model as .inner):
        # its requests' pooled states become label logits here, on the device.
        self.classify = getattr(getattr(model, "inner", model), "classify", None)
        self.kv_groups = kv_groups or model_kv_cache_groups(model, max_model_len)
        # Each of this stage's layers: its KV tensor (an index into kv_caches) and its group.
        indices = [attn_layer_index(layer, i) for i, layer in enumerate(model.attn_layers)]
        self.kv_slots = self.kv_groups.slots_of(indices)
        self.layer_cache_index = [self.kv_slots.index(self.kv_groups.layer_slot[i]) for i in indices]
        self.layer_group = [self.kv_groups.layer_group[i] for i in indices]
        self.num_kv_groups = self.kv_groups.num_groups
        self.input_batch = InputBatch(max_num_seqs, max_model_len, self.max_blocks_per_req, block_size, vocab_size,
                                      num_kv_groups=self.num_kv_groups)
        # LongRoPE with both factor tables (layers/rotary_embedding.LongRopeEmbedding): the tokens of requests longer
        # than the original context read the long rows, `long_rope_offset` further: per-token offsets the model
        # adds to the positions it rotates with, from this buffer (static: CUDA graphs read it; the positions stay
        # true, for the slots the device-side speculation recomputes from them).
        self.rope_offsets, self.long_rope_offset, self.long_rope_original = long_rope_tables(
            model, max_num_batched_tokens, device)
        self.input_batch.long_rope_original = self.long_rope_original
        # Dynamic NTK with the engine's context past the model's (DynamicNTKRotaryEmbedding): the tokens of a prompt
        # longer than the model's context, but its last, read rows computed each step into the scratch rows.
        self.ntk_ropes, self.ntk_original = dynamic_ntk_tables(model, max_num_batched_tokens, device)
        if self.ntk_ropes:
            if self.long_rope_original is not None:  # (one offsets buffer, filled by one rule per step)
                raise ValueError(f"LongRoPE on some layers and dynamic NTK rope on others (rope_parameters per layer "
                                 f"type) are not supported with a context past the model's: lower --max-model-len "
                                 f"to {self.ntk_original}, or use one scaling for every layer type.")
            self.rope_offsets = self.ntk_ropes[0].offsets
        self.kv_caches: list[torch.Tensor] = []
        self.enforce_eager = enforce_eager or device.type != "cuda"
        self.cuda_graphs = None  # set by initialize_kv_cache on CUDA
        self.mixed_graphs = None  # likewise, for mixed prefill + decode steps (worker/mixed_graph.py)
        self._prev_sampled: Optional[torch.Tensor] = None  # [num_sampled] ids of the last launch
        # Per InputBatch row: where the row's token sits in _prev_sampled (-1: the last launch sampled none for it).
        self._prev_pos = np.full(max_num_seqs, -1, dtype=np.int64)
        # Overlapped speculation (spec_decode/device_ngram.py): the drafts each request of the last launch rejected
        # (aligned with _prev_sampled, its last emitted tokens), or None when that launch verified nothing.
        self._prev_rej: Optional[torch.Tensor] = None
        self.stager = HostStager(device)
        # The CPU stages a step's sampling parameters with its other inputs; CUDA copies them as
        # SamplingMetadata.build does (staging them too measured no faster there: docs/benchmarks.md).
        self.stage_sampling = device.type != "cuda"
        self.lora = None  # lora.manager.LoRAManager when enable_lora (set by the worker)
        self.spec = None  # spec_decode.spec_runner.SpecDecodeRunner when speculative decoding is configured
        self.kv_calibration_pending = False  # FP8 KV: the first step sets the k/v scales (_init_kv_scales)

    # ------------------------------------------------------------------ KV cache
    def kv_cache_spec(self) -> KVCacheSpec:
        first = self.model.attn_layers[0]
        # One tensor per slot this stage's layers use (per layer with a single KV-cache group).
        return KVCacheSpec(num_layers=len(self.kv_slots), num_kv_heads=first.num_kv_heads, head_size=first.head_size,
                           block_size=self.block_size, dtype=self.kv_cache_dtype)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._allocate_kv_cache()
        self._init_kv_scales()
        warmup = getattr(self.attn_backend, "warmup", None)
        if warmup is not None:
            first = self.model.attn_layers[0]
            warmup(first.num_heads, first.num_kv_heads, first.head_size, self.block_size, self.dtype, self.device,
                   self.max_num_batched_tokens, **({"cache_dtype": self.kv_cache_dtype}
                                                   if self.kv_cache_dtype != self.dtype else {}),
                   sliding_windows=tuple({layer.sliding_window for layer in self.model.attn_layers}),
                   soft_caps=tuple({layer.logits_soft_cap for layer in self.model.attn_layers}))
        self._warm_up_greedy()
        self._warm_up_gemv_mma()
        self._capture_graphs()
        if self.device.type == "cuda":
            # The profiling forward's activation blocks were released to size the KV cache: run it once more so
            # the caching allocator holds a full step's blocks again and the first large prefill does not pay for
            # cudaMalloc (measured in docs/benchmarks.md, GPU section). The KV budget already counts these blocks.
            self.profile_run()

    def _allocate_kv_cache(self) -> None:
        spec = self.kv_cache_spec()
        # One extra block past the scheduler's pool: the scratch block CUDA-graph padding rows write into.
        self.scratch_block = self.num_blocks
        self.kv_caches = allocate_kv_caches(spec, self.num_blocks + (0 if self.enforce_eager else 1), self.device,
                                            zeroed=self.attn_backend.needs_zeroed_cache)
        for layer, index, group in zip(self.model.attn_layers, self.layer_cache_index, self.layer_group):
            layer.kv_cache = self.kv_caches[index]
            layer.kv_group = group

    def _capture_graphs(self) -> None:
        if self.enforce_eager:
            return
        from pagedllm.worker.cuda_graph import CudaGraphRunner

        pool = None
        if self.graph_settings.decode_graphs:
            graphs = CudaGraphRunner(self)
            if graphs.sizes:  # (compilation_config's capture sizes may leave none up to max_num_seqs)
                self.cuda_graphs = graphs
                self.cuda_graphs.capture()
                pool = self.cuda_graphs.pool
        if self.attn_backend.supports_mixed_graphs and self.graph_settings.mixed_graphs:
            from pagedllm.worker.mixed_graph import MixedGraphRunner

            extra = self.spec.graph_token_sizes() if self.spec is not None else ()
            few = self.spec.config.num_speculative_tokens + 1 if self.spec is not None else None
            self.mixed_graphs = MixedGraphRunner(self, pool=pool, extra_sizes=extra, few_query_len=few)
            self.mixed_graphs.capture()

    # ------------------------------------------------------------------ sleep mode (worker/sleep.py: the weights)
    def sleep_kv_cache(self) -> None:
        """Free the KV cache and everything that recorded its (or the weights') addresses: the CUDA graphs and their
        static inputs, the last step's sampled ids. The engine sleeps only with no request in flight."""
        self.cuda_graphs = None
        self.mixed_graphs = None
        self._prev_sampled = None
        self._prev_rej = None
        self._prev_pos.fill(-1)
        for layer in self.model.attn_layers:
            layer.kv_cache = None
        self.kv_caches = []

    def wake_up_kv_cache(self) -> None:
        """A fresh (zeroed where the backend needs it) pool of the same size; the scheduler's prefix cache was reset
        when it slept, so no block's old content is expected."""
        self._allocate_kv_cache()

    def recapture_graphs(self) -> None:
        """Once weights and KV cache are both back: graphs recorded their addresses, so they are captured anew."""
        self._capture_graphs()

    def _init_kv_scales(self) -> None:
        """FP8 cache: the checkpoint's k/v scales where every layer has them, else
        calibrate on the first step (layers are marked "pending" now, so CUDA graphs capture the scaled path)."""
        self.kv_calibration_pending = False
        if self.kv_cache_dtype != torch.float8_e4m3fn:
            return
        from pagedllm.layers.kv_cache_scales import kv_scale_summary

        layers = self.model.attn_layers
        enabled = envs.PAGEDLLM_KV_SCALES
        if enabled and all(layer.kv_scale_source == "checkpoint" for layer in layers):
            logger.info("FP8 KV cache scales from the checkpoint: %s", kv_scale_summary(layers))
            return
        if any(layer.kv_scale_source == "checkpoint" for layer in layers) and not enabled:
            logger.info("The checkpoint's FP8 KV cache scales are not used (PAGEDLLM_KV_SCALES=0).")
        for layer in layers:  # none, or only some layers have checkpoint scales: one rule for the whole model
            layer.kv_scales.fill_(1.0)
            layer.kv_scale_source = "pending" if enabled else None
        self.kv_calibration_pending = enabled

    @torch.inference_mode()
    def _warm_up_greedy(self) -> None:
        """On CUDA, run the greedy LM-head path and the device sampler once so their kernels are compiled at start-up,
        not in the middle of serving (the split argmax is first used when a batch shrinks to a few rows)."""
        lm_head = getattr(self.model, "lm_head", None)
        if self.device.type != "cuda" or lm_head is None or not hasattr(self.model, "greedy_token_ids"):
            return
        self.model.greedy_token_ids(torch.zeros(1, lm_head.embedding_dim, dtype=self.dtype, device=self.device))
        warm_up_device_sampling(self.vocab_size, self.device, self.dtype)  # and the sampler's kernel
        torch.cuda.synchronize(self.device)

    def _warm_up_gemv_mma(self) -> None:
        """With the tensor-core few-row GEMV on (PAGEDLLM_GEMV_MMA_MAX_ROWS), compile its variants for every plain
        fp16 / bf16 linear layer and the LM head at start-up, in parallel, instead of one by one as graph capture
        or the first steps meet them."""
        if self.device.type != "cuda":
            return
        from pagedllm.layers.activation import triton_kernels

        gemv = triton_kernels("gemv")
        if gemv is None or gemv.mma_max_rows() < 2:
            return
        from pagedllm.kernels import gemv_mma
        from pagedllm.layers.linear import MergedColumnParallelLinear, UnquantizedLinearMethod
        from pagedllm.layers.vocab_embedding import ParallelLMHead

        if gemv_mma.kernel_available(self.device) is not None:
            return
        layers = []
        for module in self.model.modules():
            weight = getattr(module, "weight", None)
            has_bias = getattr(module, "bias", None) is not None
            if isinstance(module, ParallelLMHead) or type(getattr(module, "linear_method", None)) is \
                    UnquantizedLinearMethod:
                layers.append((weight, False, has_bias))
                if isinstance(module, MergedColumnParallelLinear) and len(module.output_partition_sizes) == 2:
                    layers.append((weight, True, has_bias))  # silu(gate) * up in the same kernel
        start = time.perf_counter()
        try:
            shapes = gemv_mma.warm_up([layer for layer in layers if isinstance(layer[0], torch.Tensor)])
        except Exception as e:  # noqa: BLE001 (an NVRTC / driver failure: the layers keep their other kernels)
            gemv.disable_mma(self.device)
            logger.warning("The tensor-core few-row GEMV (PAGEDLLM_GEMV_MMA_MAX_ROWS) failed to build on this GPU "
                           "(%s: %s); linear layers use the Triton GEMV and cuBLAS.", type(e).__name__, e)
            return
        logger.info("Compiled the tensor-core few-row GEMV for %d weight shapes in %.1f s.", shapes,
                    time.perf_counter() - start)

    @torch.inference_mode()
    def profile_run(self) -> None:
        """A forward over max_num_batched_tokens dummy tokens (no KV cache) to find peak activation memory."""
        num_tokens = self.max_num_batched_tokens
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device) % self.max_model_len
        hidden = self.model(input_ids, positions)
        if hidden is not None:  # None on pipeline stages before the last
            idx = torch.arange(min(self.max_num_seqs, num_tokens), device=self.device)
            self.model.compute_logits(hidden[idx])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ execute
    def execute_model(self, plan: BatchPlan) -> ModelOutput:
        return self.launch(plan).result()

    @torch.inference_mode()
    def launch(self, plan: BatchPlan, before_sampling: Optional[Callable[[], None]] = None) -> "PendingOutput":
        """Enqueue one step (inputs, forward, sampling) without waiting for the device.

        With async scheduling the plan may include tokens sampled by the previous step that the host has not
        seen yet: those input ids are taken on the device from the previous step's sampled ids.
        before_sampling (structured outputs under async scheduling) runs once the forward is enqueued and before
        sampling reads the plan's grammar bitmask: the engine applies the previous step's tokens and fills the
        bitmask there, while the device runs this step's forward.
        """
        batch = self.input_batch
        batch.update(plan)
        if plan.kv_block_copies:  # before the forward: copy-on-write of partial blocks (beam forks)
            copy_kv_blocks(self.kv_caches, plan.kv_block_copies, self.device)
        if self.spec is not None and plan.finished_request_ids:
            self.spec.drop(plan.finished_request_ids)
        if plan.total_num_scheduled_tokens == 0:
            return PendingOutput.empty()
        inp = batch.prepare(plan)
        dev = self.device
        fill_src, fill_dst = self._in_flight_rows(inp)
        sample_rows = inp.sample_rows
        all_sample = len(sample_rows) == len(inp.input_ids)  # pure decode: every token samples
        # (a decode step's token i is request i's: its logits rows are the sampling rows themselves)
        logits_idx = (sample_rows if inp.max_query_len == 1
                      else inp.query_start_loc[1:][sample_rows].astype(np.int64) - 1)
        verifying = bool(inp.spec_token_ids) and len(sample_rows) > 0
        verify_rows = self.spec.verify_rows(self, inp) if verifying else None  # known before the forward
        # The sampling rows' parameters from the batch's persistent arrays (None: a row needs the full builder); a
        # verify step's rows repeat their request's parameters (1 + drafts rows each). All plain greedy: none needed.
        if not verifying:
            step_sampling = batch.sampling.gather(inp.rows[sample_rows]) if not inp.spec_token_ids else None
        else:
            step_sampling = None if verify_rows.greedy else batch.sampling.gather(
                np.repeat(inp.rows[sample_rows], verify_rows.counts))
        int64_arrays = [inp.input_ids, inp.positions, inp.slot_mapping, fill_src, fill_dst, logits_idx]
        stage_sampling = step_sampling is not None and self.stage_sampling
        if stage_sampling and step_sampling.top_k is not None:
            int64_arrays.append(step_sampling.top_k)
        # One async host-to-device copy per dtype from pinned memory (pageable copies would wait for the
        # device to finish the step in flight, defeating async scheduling).
        device_ngram = self.spec.device_ngram if self.spec is not None else None
        dev_step = None
        if device_ngram is not None:  # drafts kept on the device: this step's share of that work
            from pagedllm.spec_decode.device_ngram import DeviceStep

            dev_step = DeviceStep(device_ngram, self, plan, inp, fill_src, verify_rows)
        spec_arrays = verify_rows.device_arrays() if verifying and dev_step is None else []
        num64 = len(int64_arrays)
        group_slots = inp.group_slot_mappings or []
        dev_arrays = dev_step.arrays if dev_step is not None else []
        # Every step (rows of an earlier step's requests are reset too); staged with the rest, as a second stage()
        # of one step would overwrite the pinned buffer under the first one's copy.
        rope_arrays = self._rope_arrays(inp) if self.rope_offsets is not None else []
        staged64 = self.stager.stage(int64_arrays + spec_arrays + group_slots + rope_arrays + dev_arrays, np.int64)
        input_ids, positions, slot_mapping, fill_src_t, fill_dst_t, logits_idx_t = staged64[:6]
        top_k_t = staged64[6] if num64 > 6 else None
        spec_staged = staged64[num64:num64 + len(spec_arrays)]
        first = num64 + len(spec_arrays)
        group_slots_t = staged64[first:first + len(group_slots)]
        if rope_arrays:
            rope_t = staged64[first + len(group_slots):first + len(group_slots) + len(rope_arrays)]
            self.rope_offsets[:len(rope_arrays[0])].copy_(rope_t[0])
            if len(rope_t) == 3:  # dynamic NTK: the scratch rows those offsets point to
                for rope in self.ntk_ropes:
                    rope.write_rows(rope_t[1], rope_t[2])
        if dev_step is not None:
            dev_step.staged = staged64[len(staged64) - len(dev_arrays):]
        floats_t = None
        if stage_sampling and step_sampling.floats is not None:
            floats_t = self.stager.stage([step_sampling.floats], np.float32)[0]
        elif step_sampling is not None:  # the builder's copies (pinned, non-blocking): the path verified on GPUs
            floats_t, top_k_t = (None if a is None else _to_device(torch.from_numpy(a), dev)
                                 for a in (step_sampling.floats, step_sampling.top_k))
        int32_arrays = [inp.query_start_loc, inp.seq_lens, inp.block_table]
        want_order = inp.max_query_len == 1 and self.attn_backend.wants_decode_order
        if want_order:
            int32_arrays.append(np.argsort(-inp.seq_lens, kind="stable").astype(np.int32))
        num_plain = len(int32_arrays)
        lora_arrays = self._lora_arrays(inp)
        group_tables = inp.group_block_tables or []
        staged = self.stager.stage(int32_arrays + group_tables + lora_arrays[:3], np.int32)
        query_start_loc, seq_lens, block_table, *decode_order = staged[:num_plain]
        group_tables_t = staged[num_plain:num_plain + len(group_tables)]
        num_plain += len(group_tables)
        self.stager.next_step()
        if lora_arrays:  # the step's token -> adapter slot map, into the wrappers' persistent buffers
            self.lora.state.load(*staged[num_plain:], active=lora_arrays[3])
        metadata = AttentionMetadata(
            num_actual_tokens=len(inp.input_ids),
            num_reqs=len(inp.req_ids),
            max_query_len=inp.max_query_len,
            max_seq_len=inp.max_seq_len,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=block_table,
            slot_mapping=slot_mapping,
            decode_order=decode_order[0] if want_order else None,
            query_start_loc_cpu=inp.query_start_loc.tolist(),
            seq_lens_cpu=inp.seq_lens.tolist(),
        )
        with_kv_groups(metadata, group_tables_t, group_slots_t)
        if len(fill_src) and self._prev_sampled is None:
            raise RuntimeError("A step needs tokens of a previous step that sampled nothing; this is a bug.")
        if dev_step is None and len(fill_src):
            input_ids.index_copy_(0, fill_dst_t, self._prev_sampled.index_select(0, fill_src_t))
        corrected = dev_step is not None and dev_step.before_forward(
            self, input_ids, positions, slot_mapping, seq_lens, block_table, query_start_loc, group_slots_t,
            group_tables_t)
        if corrected:
            # The host's lengths were upper bounds (the step in flight's drafts all accepted): the CUDA kernels take
            # bounds (graph buckets, split counts); the CPU's and the torch reference's need the exact ones.
            if dev.type != "cuda" or not self.attn_backend.host_lens_may_be_bounds:
                lens = seq_lens.tolist()
                for group in metadata.kv_groups or (metadata,):  # (groups 1.. hold copies of these fields)
                    group.seq_lens_cpu, group.max_seq_len = lens, max(lens)
        hidden = None
        calibrate = self.kv_calibration_pending  # the first step sets FP8 k/v scales from real K/V: eager
        embeds = self._prompt_embeds(inp)
        # Steps carrying prompt embeddings run eagerly: the graphs were captured with the embedding lookup only.
        graphs_ok = not calibrate and embeds is None
        if self.cuda_graphs is not None and inp.max_query_len == 1 and graphs_ok:
            hidden = self.cuda_graphs.run(input_ids, positions, metadata)
        if hidden is None and self.mixed_graphs is not None and graphs_ok:
            hidden = self.mixed_graphs.run(input_ids, positions, metadata)
        if hidden is None:
            self.attn_backend.prepare(metadata)
            with set_forward_context(metadata, self.attn_backend, calibrate_kv=calibrate, input_embeds=embeds):
                hidden = self.model(input_ids, positions)
            if calibrate:
                self.kv_calibration_pending = False
                from pagedllm.layers.kv_cache_scales import kv_scale_summary
                logger.info("FP8 KV cache scales from the first step's K/V: %s",
                            kv_scale_summary(self.model.attn_layers))
        if hidden is None:  # a pipeline stage before the last: the last stage samples
            self._prev_sampled = None
            self._prev_rej = None
            return PendingOutput(self, inp, None, None, None)
        prompt_logprobs = self._prompt_logprobs(inp, hidden)
        if self.input_batch.sampling.num_prompt_logprobs:  # (rows reading their prompt: logprobs or pooling)
            self._pool(inp, hidden)
        self._prev_sampled = None
        self._prev_rej = None
        if before_sampling is not None:
            before_sampling()
        if verifying:
            meta = None if step_sampling is None else fast_metadata(
                step_sampling, len(verify_rows.draft_ids), self.vocab_size, floats_t, top_k_t)
            mask = step_token_bitmask(plan, inp.req_ids, sample_rows, dev, verify_rows.counts)
            return self.spec.verify(self, inp, hidden, prompt_logprobs, spec_staged, verify_rows, dev_step, input_ids,
                                    meta, mask)
        if len(sample_rows) == 0:
            return PendingOutput(self, inp, None, None, None, prompt_logprobs)
        sample_hidden = hidden if all_sample else hidden.index_select(0, logits_idx_t)
        if step_sampling is not None:
            meta = fast_metadata(step_sampling, len(sample_rows), self.vocab_size, floats_t, top_k_t)
        else:
            meta = self._sampling_metadata(inp, sample_rows)
        meta.token_bitmask = step_token_bitmask(plan, inp.req_ids, sample_rows, dev)
        meta.logprobs_mode = self.logprobs_mode
        ids = None
        if meta.argmax_only:
            # Only the argmax is needed: the LM head finds it without fp32 logits (on CPU from an exact bf16
            # screen; None where no shortcut applies), within the grammar's allowed tokens if there is a mask.
            ids = self.greedy_ids(sample_hidden, meta.token_bitmask)
        elif step_sampling is not None and self.cuda_graphs is not None:  # the decode graph's sampled tail
            ids = self.cuda_graphs.sample(sample_hidden, meta, floats_t, step_sampling.names)
        if ids is not None:
            sampler_out = SamplerOutput(sampled_token_ids=ids, logprobs=None)
        else:
            logits = None
            if dev.type == "cuda" and draws_as_is(meta):  # the device sampler reads the LM head's dtype
                as_is = getattr(self.model, "sample_logits", None)
                logits = None if as_is is None else as_is(sample_hidden)
            sampler_out = self.sampler(self.model.compute_logits(sample_hidden) if logits is None else logits, meta)
        sampled = sampler_out.sampled_token_ids
        # Remember where each request's newest token lives on the device for the next launch (a row the sampler
        # marked NO_ALLOWED_TOKEN fails when its output is read; until then its next input must be a valid id).
        self._prev_sampled = sampled if meta.no_token_rows is None else sampled.clamp(min=0)
        self._prev_pos.fill(-1)
        self._prev_pos[inp.rows[sample_rows]] = np.arange(len(sample_rows))
        num_drafts = None
        if dev_step is not None:  # the histories follow every step; the draft counts matter in overlapped steps
            stats = dev_step.after_step(sampled)
            if inp.spec_overlap:
                num_drafts = stats[4]
        event = None
        if dev.type == "cuda":
            slot = None
            if dev_step is not None:  # one copy: a plain step's ids are its stats' last emitted tokens (row 1)
                flat, stats_at, row_len = dev_step.packed
                slot = self.spec._host_slot(self, flat.shape[0])  # (a pinned buffer and event reused)
                host_flat = slot[0][0, :flat.shape[0]]
                host_flat.copy_(flat, non_blocking=True)
                rows_host = host_flat[stats_at:].view(5, row_len)[:, :len(sample_rows)]
                host = rows_host[1]
                num_drafts = None if num_drafts is None else rows_host[4]
                event = slot[1]
            else:
                host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
                host.copy_(sampled, non_blocking=True)
                event = torch.cuda.Event()
            lp = sampler_out.logprobs
            lp_host = None if lp is None else tuple(t.to("cpu", non_blocking=True) for t in lp)
            event.record()
            if slot is not None:
                return PendingOutput(self, inp, host, lp_host, event, prompt_logprobs, num_drafts,
                                     release=lambda: self.spec._free_slots.append(slot))
        else:
            host, lp_host = sampled, sampler_out.logprobs
        return PendingOutput(self, inp, host, lp_host, event, prompt_logprobs, num_drafts)

    def greedy_ids(self, hidden: torch.Tensor, token_bitmask: Optional[torch.Tensor] = None
                   ) -> Optional[torch.Tensor]:
        """The argmax token ids of the LM head over `hidden` (None: the model has no shortcut, use the logits).
        Where `hidden` is the output of this step's decode or mixed graph and that graph has a greedy tail
        (worker/greedy_tail.py), the tail's replay; otherwise the model's eager shortcut."""
        if token_bitmask is None:
            for graphs in (self.cuda_graphs, self.mixed_graphs):
                ids = None if graphs is None else graphs.greedy(hidden)
                if ids is not None:
                    return ids
        return greedy_token_ids(self.model, hidden, token_bitmask)

    def _prompt_embeds(self, inp) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """This step's tokens whose embeddings a prompt gave (enable_prompt_embeds): (flat token indices, rows) on the
        device, or None when there are none (without enable_prompt_embeds: no walk over the step's requests)."""
        if not self.prompt_embeds:
            return None
        index, rows = [], []
        for i, state in enumerate(inp.states):
            embeds = state.prompt_embeds
            if embeds is None:
                continue
            lo, hi = int(inp.query_start_loc[i]), int(inp.query_start_loc[i + 1])
            start = int(inp.positions[lo])  # the first scheduled token's place in the sequence
            end = min(start + hi - lo, embeds.shape[0])  # (the prompt's part: generated tokens are looked up)
            if end > start:
                index.append(torch.arange(lo, lo + end - start, dtype=torch.int64))
                rows.append(embeds[start:end])
        if not index:
            return None
        return torch.cat(index).to(self.device), torch.cat(rows).to(self.device, self.dtype)

    def _sampling_metadata(self, inp, sample_rows: np.ndarray) -> SamplingMetadata:
        """The general builder, for steps with a row whose sampling depends on its outputs (penalties, seeds,
        min_tokens, token constraints)."""
        sample_states = [inp.states[i] for i in sample_rows]
        return SamplingMetadata.build(
            params=[s.sampling_params for s in sample_states],
            prompt_token_ids=[penalized_prompt(s) for s in sample_states],
            output_token_ids=[s.output_token_ids for s in sample_states],
            # min_tokens forbids EOS also under ignore_eos (vLLM: the model's EOS is always in all_stop_token_ids)
            eos_token_ids=[self.eos_token_id] * len(sample_states),
            vocab_size=self.vocab_size,
            device=self.device,
        )

    def _lora_arrays(self, inp) -> list:
        """[token_slots, sorted_token_ids, slot_starts, any adapter] of the step (loading adapters into device slots
        as needed), or [] without enable_lora."""
        if self.lora is None:
            return []
        from pagedllm.core.errors import RequestStepError
        from pagedllm.lora.manager import AdapterReloadError

        num_scheduled = np.diff(inp.query_start_loc).astype(np.int64)
        try:
            return list(self.lora.step_arrays([s.lora_id for s in inp.states], num_scheduled))
        except AdapterReloadError as e:
            # fail the adapter's requests alone: as any other exception it left the engine failed for good
            raise RequestStepError([s.req_id for s in inp.states if s.lora_id == e.lora_int_id], str(e)) from e

    def _prompt_logprobs(self, inp, hidden: torch.Tensor) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        """Score the prompt tokens this step's chunks cover, for requests that asked for prompt_logprobs.

        Hidden row of position p predicts prompt token p + 1; position 0 is never scored (vLLM gives None).
        Rare and prefill-only, so this syncs with the device; logits are made in slices to bound memory.
        """
        sampling = self.input_batch.sampling
        if not sampling.num_prompt_logprobs or not sampling.prompt_logprobs[inp.rows].any():  # usual: nobody asked
            return {}
        qsl = inp.query_start_loc
        rows: list[int] = []
        targets: list[int] = []
        spans: list[tuple[str, int, int, int]] = []  # (request id, first position, count, k)
        for i, state in enumerate(inp.states):
            k = state.sampling_params.prompt_logprobs
            if k is None or state.sampling_params.pooling is not None:
                continue
            start = int(inp.positions[qsl[i]])
            end = start + int(qsl[i + 1] - qsl[i])
            last = min(end, len(state.prompt_token_ids) - 1)
            if last <= start:
                continue
            rows.extend(range(int(qsl[i]), int(qsl[i]) + last - start))
            targets.extend(state.prompt_token_ids[start + 1:last + 1])
            spans.append((state.req_id, start + 1, last - start, k))
        if not spans:
            return {}
        max_k = max(k for *_, k in spans)
        ids_all, lps_all, ranks_all = [], [], []
        for lo in range(0, len(rows), 512):
            idx = torch.tensor(rows[lo:lo + 512], dtype=torch.long).to(self.device)
            tgt = torch.tensor(targets[lo:lo + 512], dtype=torch.long).to(self.device)
            logprobs = torch.log_softmax(self.model.compute_logits(hidden.index_select(0, idx)), dim=-1)
            ids, lps, ranks = gather_logprobs(logprobs, tgt, max_k)  # the prompt token first, then the top-k
            ids_all += ids.tolist()
            lps_all += lps.tolist()
            ranks_all += ranks.tolist()
        result, offset = {}, 0
        for req_id, first, count, k in spans:
            entries = [TokenLogprobs(token_ids=ids_all[j][:k + 1], logprobs=lps_all[j][:k + 1],
                                     ranks=ranks_all[j][:k + 1]) for j in range(offset, offset + count)]
            result[req_id] = (first, entries)
            offset += count
        return result

    def _pool(self, inp, hidden: torch.Tensor) -> None:
        """Pooling requests (pooling/): pool the hidden rows of this step's prompt chunks; a request whose prompt
        this step completes gets its vector in inp.pooled (a classifier's: its label logits), an "all" request every
        token's row (through the model's head, if it has one) laid end to end. A chunk from position 0 starts the
        pooling afresh (a preempted request recomputes its prompt); mean, cls and all requests take no prefix-cache
        hits (the scheduler), so every prompt position passes through here. Rare and prefill-only: this syncs with the
        device."""
        qsl = inp.query_start_loc
        pooled: dict[str, list[float]] = {}
        for i, state in enumerate(inp.states):
            kind = state.sampling_params.pooling
            if kind is None:
                continue
            lo, hi = int(qsl[i]), int(qsl[i + 1])
            start = int(inp.positions[lo])
            num_prompt = len(state.prompt_token_ids)
            end = min(start + hi - lo, num_prompt)
            if end <= start:  # past its prompt (the step after the last chunk): nothing left to pool
                continue
            if start == 0:
                state.pool_acc = None
            if kind == "all":
                rows = hidden[lo:lo + end - start]
                # The head per chunk: [n, labels] kept rather than [n, hidden]. Either way a copy (a graph's output
                # buffer is rewritten next step).
                part = self.classify(rows) if self.classify is not None else rows.to(torch.float32, copy=True)
                state.pool_acc = [part] if state.pool_acc is None else state.pool_acc + [part]
            elif kind == "mean":
                part = hidden[lo:lo + end - start].float().sum(dim=0)
                state.pool_acc = part if state.pool_acc is None else state.pool_acc + part
            elif kind == "cls" and start == 0:
                state.pool_acc = hidden[lo].float().clone()  # (a graph's output buffer is rewritten next step)
            if end < num_prompt:
                continue
            if kind == "all":
                pooled[state.req_id] = torch.cat(state.pool_acc).flatten().cpu().tolist()
                state.pool_acc = None
                continue
            if kind == "last":
                vector = hidden[lo + end - start - 1].float()
            elif kind == "mean":
                vector = state.pool_acc / num_prompt
            else:
                vector = state.pool_acc
            state.pool_acc = None
            if self.classify is not None:
                vector = self.classify(vector.unsqueeze(0))[0]
            pooled[state.req_id] = vector.cpu().tolist()
        if pooled:
            inp.pooled = pooled

    def _rope_arrays(self, inp) -> list[np.ndarray]:
        """[per token of the step, what the rotary adds to its position], and for dynamic NTK the positions and
        sequence lengths of the scratch rows the offsets point to. LongRoPE: a long request's tokens read the long
        rows. Dynamic NTK: a prompt longer than the model's context rotates its tokens (but the last, whose row is
        its own position's) with the base for its length, as transformers' prompt forward does."""
        counts = np.diff(inp.query_start_loc)
        if self.long_rope_offset is not None:
            flags = np.fromiter((s.rope_long for s in inp.states), dtype=np.int64, count=len(inp.states))
            return [self.long_rope_offset * np.repeat(flags, counts)]
        prompt_lens = np.repeat(np.fromiter((len(s.prompt_token_ids) for s in inp.states), dtype=np.int64,
                                            count=len(inp.states)), counts)
        positions = inp.positions[:len(prompt_lens)]
        need = np.flatnonzero((prompt_lens > self.ntk_original) & (positions < prompt_lens - 1))
        offsets = np.zeros(len(prompt_lens), dtype=np.int64)
        if len(need) == 0:
            return [offsets]
        offsets[need] = self.ntk_ropes[0].scratch_start + np.arange(len(need)) - positions[need]
        return [offsets, positions[need], prompt_lens[need]]

    def _in_flight_rows(self, inp) -> tuple[np.ndarray, np.ndarray]:
        """Input positions past what the host knows hold tokens sampled by the step still in flight:
        (index into the previous step's sampled ids, index into this step's input ids)."""
        rows = inp.in_flight_rows
        if len(rows) == 0:
            return _EMPTY, _EMPTY
        # A row in flight was sampled by the previous launch and still holds its request (a freed row is only
        # reused by a new request, whose tokens are all known). Its token is its first input here (drafts, if
        # any, follow it).
        src = self._prev_pos[inp.rows[rows]]
        if (src < 0).any():
            raise RuntimeError("A step needs a token the previous step did not sample; this is a bug.")
        return src, rows if inp.max_query_len == 1 else inp.query_start_loc[:-1].astype(np.int64)[rows]

    def _finish_step(self, inp, sampled: list[int], lp, num_drafts: Optional[list[int]] = None) -> ModelOutput:
        """Host side of a finished step: append sampled tokens to the runner's state, build ModelOutput."""
        batch = self.input_batch
        num_reqs = len(inp.req_ids)
        states, requests = inp.states, batch.requests
        sample_rows = inp.sample_rows.tolist()
        if len(sample_rows) == num_reqs:  # every request sampled (decode steps)
            sampled_ids = [[t] for t in sampled]
            sampled_states = states
        else:
            sampled_ids = [[] for _ in range(num_reqs)]
            for j, row in enumerate(sample_rows):
                sampled_ids[row] = [sampled[j]]
            sampled_states = [states[r] for r in sample_rows]
        output = ModelOutput(req_ids=inp.req_ids, sampled_token_ids=sampled_ids, logprobs=[None] * num_reqs)
        # Not dropped (finished / preempted) since the launch: their rows take the token.
        if batch.num_dropped == inp.dropped_epoch:  # none was (the usual step): every row is live
            batch.append_sampled(sampled_states, sampled,
                                 inp.rows if len(sample_rows) == num_reqs else inp.rows[inp.sample_rows])
        else:
            live = [(s, t) for s, t in zip(sampled_states, sampled) if requests.get(s.req_id) is s]
            if len(live) == len(sampled_states):
                batch.append_sampled(sampled_states, sampled)
            elif live:
                batch.append_sampled(*map(list, zip(*live)))
        if lp is not None:
            lp_ids, lp_vals, lp_ranks = (t.tolist() for t in lp)
            for j, row in enumerate(sample_rows):
                k = states[row].sampling_params.logprobs
                if k is not None:
                    output.logprobs[row] = [TokenLogprobs(token_ids=lp_ids[j][:k + 1],
                                                          logprobs=lp_vals[j][:k + 1], ranks=lp_ranks[j][:k + 1])]
        if self.spec is not None and inp.propose_drafts:
            output.spec_token_ids = self.spec.proposals(self, inp, num_drafts)
        return output


_EMPTY = np.zeros(0, dtype=np.int64)


class PendingOutput:
    """A launched step; `result()` waits for its sampled ids (the one host sync per step)."""

    def __init__(self, runner: ModelRunner, inp, sampled_host, logprobs_host, event,
                 prompt_logprobs: Optional[dict] = None, num_drafts_host: Optional[torch.Tensor] = None,
                 release: Optional[Callable[[], None]] = None) -> None:
        self.runner, self.inp, self.sampled_host, self.logprobs_host, self.event = (
            runner, inp, sampled_host, logprobs_host, event)
        self.release = release  # hands the pinned host buffer back once the result is read
        self.num_drafts_host = num_drafts_host  # overlapped speculation: the device's draft count per sampling row
        self.prompt_logprobs = prompt_logprobs or {}
        self._output: Optional[ModelOutput] = None

    @classmethod
    def empty(cls) -> "PendingOutput":
        pending = cls(None, None, None, None, None)
        pending._output = ModelOutput()
        return pending

    def result(self) -> ModelOutput:
        if self._output is None:
            if self.sampled_host is None:  # nothing sampled (mid-prefill only)
                n = len(self.inp.req_ids)
                self._output = ModelOutput(req_ids=self.inp.req_ids, sampled_token_ids=[[] for _ in range(n)],
                                           logprobs=[None] * n)
            else:
                if self.event is not None:
                    self.event.synchronize()
                num_drafts = None if self.num_drafts_host is None else self.num_drafts_host.tolist()
                sampled = self.sampled_host.tolist()
                if self.release is not None:
                    self.release()
                self._output = self.runner._finish_step(self.inp, sampled, self.logprobs_host, num_drafts)
            self._output.prompt_logprobs = self.prompt_logprobs
            self._output.pooled = self.inp.pooled
        return self._output


def dynamic_ntk_tables(model: torch.nn.Module, max_tokens: int, device: torch.device
                       ) -> tuple[list[Any], Optional[int]]:
    """(the dynamic NTK embeddings whose context passes the model's, that context) or ([], None); they read their
    per-token offsets from one buffer, which the runner fills each step, and have scratch rows for a step's
    tokens."""
    from pagedllm.layers.rotary_embedding import DynamicNTKRotaryEmbedding

    ropes = [m for m in model.modules() if isinstance(m, DynamicNTKRotaryEmbedding) and m.scratch_start is not None]
    if not ropes:
        return [], None
    offsets = torch.zeros(max_tokens + 64, dtype=torch.int64, device=device)  # (+64: a verify step's padding)
    for rope in ropes:
        rope.offsets = offsets
        rope.reserve_scratch(max_tokens + 64)
    return ropes, ropes[0].original_max_position


def long_rope_tables(model: torch.nn.Module, max_tokens: int, device: torch.device
                     ) -> tuple[Optional[torch.Tensor], Optional[int], Optional[int]]:
    """(per-token offsets buffer, offset of the long rows, original context) of a LongRoPE model holding both
    factor tables, else Nones; its embeddings then read their offsets from the buffer, which the runner fills each
    step."""
    from pagedllm.layers.rotary_embedding import LongRopeEmbedding

    ropes = [m for m in model.modules() if isinstance(m, LongRopeEmbedding) and m.long_offset is not None]
    if not ropes:
        return None, None, None
    originals = sorted({rope.original_max_position for rope in ropes})
    if len(originals) > 1:  # a request is rotated with the long or the short factors on every layer
        raise ValueError(f"LongRoPE with different original contexts on different layers ({originals}, rope_parameters "
                         f"per layer type) is not supported with a context past two of them: lower --max-model-len to "
                         f"{originals[1]}, or give every layer type the same original_max_position_embeddings.")
    offsets = torch.zeros(max_tokens + 64, dtype=torch.int64, device=device)  # (+64: a verify step's padding)
    for rope in ropes:
        rope.offsets = offsets
    return offsets, ropes[0].long_offset, ropes[0].original_max_position
