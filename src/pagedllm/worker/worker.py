"""Worker: one device's model + KV cache + runner. Resolves the model, picks device/dtype, sizes the pool."""
from __future__ import annotations

import gc
import json
import logging
import os
import sys
import time

import torch

from pagedllm import envs
from pagedllm.config import CPU_OFFLOAD_ON_CPU, EngineArgs
from pagedllm.core.batch_plan import BatchPlan, ModelOutput
from pagedllm.core.kv_cache_groups import blocks_needed
from pagedllm.dtypes import DTYPE_ALIASES, torch_dtype
from pagedllm.worker.kv_cache import (
    available_cpu_memory,
    cpu_kv_budget,
    model_kv_cache_groups,
    resolve_kv_cache_dtype,
)
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger("pagedllm")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but no CUDA GPU is visible; use device='cpu'.")
    return torch.device(name)


def resolve_dtype(name: str, hf_config, device: torch.device) -> torch.dtype:
    if name != "auto":
        dtype = torch_dtype(name)
        if device.type == "cpu" and dtype == torch.float16:
            logger.warning("float16 on CPU is slow and imprecise; consider --dtype float32.")
        return dtype
    if device.type == "cpu":
        return torch.float32
    config_dtype = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = torch_dtype(config_dtype) if config_dtype in DTYPE_ALIASES else None
    return torch.float16 if config_dtype == torch.float16 else torch.bfloat16


def read_eos_token_ids(hf_config, model_dir: str) -> list[int]:
    """The model's end-of-sequence ids: config's eos first, then generation_config.json's extras (an int or a
    list each), without duplicates. Negative ids (some configs write -1 for "none") are dropped: they are no
    token, and as an index they would name the last one."""
    ids: list[int] = []

    def add(value) -> None:
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0 and v not in ids:
                ids.append(v)

    add(getattr(hf_config, "eos_token_id", None))
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        try:
            with open(path) as f:
                add(json.load(f).get("eos_token_id"))
        except (OSError, ValueError):
            pass
    return ids


def model_max_len(hf_config) -> int:
    """The model's context as vLLM derives it: max_position_embeddings, times the factor of a linear, dynamic or
    yarn rope scaling (yarn: of its original context), the positions those scalings are made to reach (Qwen2.5's
    yarn x4 over 32768: 131072). Llama 3's and LongRoPE scalings already count in max_position_embeddings, as
    does Gemma 3's (vLLM leaves it unscaled)."""
    from pagedllm.layers.rotary_embedding import get_rope_parameters

    max_pos = getattr(hf_config, "max_position_embeddings", None) or 2048
    if "gemma3" in (getattr(hf_config, "model_type", None) or ""):
        return max_pos
    rope = get_rope_parameters(hf_config)
    if rope["rope_type"] not in ("linear", "dynamic", "yarn") or not rope.get("factor"):
        return max_pos
    if rope["rope_type"] == "yarn" and rope.get("original_max_position_embeddings"):
        max_pos = rope["original_max_position_embeddings"]
    return int(max_pos * rope["factor"])


# Default token budget of one step: 16384 on GPUs with >= 70 GiB (fewer, larger prefill chunks raise offline
# throughput there; docs/benchmarks.md, GPU section), 8192 elsewhere (smaller GPUs keep more memory for KV; a CPU
# gains nothing from larger chunks).
LARGE_GPU_BYTES = 70 * 1024 ** 3


def check_unchunked_budget(args: EngineArgs, budget: int, max_model_len: int) -> int:
    """Without chunked prefill a whole prompt runs in one step, so a step must hold max_model_len tokens:
    the default budget grows to it, a smaller explicit one is refused."""
    if args.max_num_batched_tokens is None:
        return max(budget, max_model_len)
    if budget < max_model_len:
        raise ValueError(f"max_num_batched_tokens ({budget}) is smaller than max_model_len ({max_model_len}); "
                         "without chunked prefill every prompt must fit in one step: raise "
                         "--max-num-batched-tokens, lower --max-model-len, or enable chunked prefill.")
    return budget


def default_batched_tokens(device: torch.device) -> int:
    if device.type == "cpu":
        # Smaller steps keep a small model's activations under glibc's 32 MiB mmap ceiling, so they are reused
        # from the heap instead of page-faulted in at every product (docs/benchmarks.md, CPU GGUF batch).
        return 2048
    if device.type == "cuda" and torch.cuda.get_device_properties(device).total_memory >= LARGE_GPU_BYTES:
        return 16384
    return 8192


class Worker:
    """One rank's model shard, KV cache and runner. In-process for one device (the executor/uniproc path);
    one per worker process with tensor / pipeline parallelism (executor/multiproc.py), where the process has
    joined torch.distributed and its model-parallel groups before this is built."""

    def __init__(self, args: EngineArgs, local_rank: int = 0) -> None:
        try:
            self._start(args, local_rank)
        except BaseException:
            # A failed start (no room for the KV cache, a bad checkpoint) frees what it loaded: the traceback the
            # caller keeps (a notebook's last error) would hold this half-built worker and its weights.
            self.shutdown()
            raise

    def _start(self, args: EngineArgs, local_rank: int) -> None:
        from pagedllm.distributed.parallel_state import get_pp_group, get_world_group
        from pagedllm.models.loader import (disable_sliding_window, engine_hf_config, get_model, prepare_model_dir,
                                            refuse_checkpoint_quantization, resolve_model_path)

        self.args = args
        self.device = resolve_device(args.device)
        world = get_world_group()
        if self.device.type == "cuda" and world.world_size > 1:
            self.device = torch.device("cuda", local_rank)
        pipelined = get_pp_group().world_size > 1
        # What this process already holds on the GPU before this engine loads anything (another engine of the same
        # process, e.g. a benchmark's peer): not this engine's, so memory sizing must not count it as its own.
        self._cuda_baseline = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        if args.cpu_offload_gb > 0 and self.device.type != "cuda":
            raise ValueError(CPU_OFFLOAD_ON_CPU)
        model_path = resolve_model_path(args.model, args.revision, args.download_dir, args.hf_token)
        self.model_dir = prepare_model_dir(model_path, args.load_format)
        self.hf_config = engine_hf_config(args, self.model_dir)
        cfg = self.hf_config
        self.dtype = resolve_dtype(args.dtype, cfg, self.device)
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = read_eos_token_ids(cfg, self.model_dir)
        max_pos = model_max_len(cfg)
        limit = f"{max_pos} positions"
        window = disable_sliding_window(cfg) if args.disable_sliding_window else None
        if window is not None and window < max_pos:  # vLLM's cap: the context stays within the removed window
            max_pos, limit = window, f"its sliding window, {window} tokens, as --disable-sliding-window caps it"
            logger.info("disable_sliding_window: every layer attends to the whole context; max_model_len is capped "
                        "at the sliding window (%d).", window)
        if args.max_model_len is not None and args.max_model_len > max_pos:
            if not envs.VLLM_ALLOW_LONG_MAX_MODEL_LEN:
                raise ValueError(f"max_model_len={args.max_model_len} is larger than the model's maximum "
                                 f"({limit}); lower --max-model-len, or set "
                                 "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 to allow it (outputs past the model's context "
                                 "may be wrong).")
            logger.warning("max_model_len=%d is larger than the model's maximum (%d positions), allowed by "
                           "VLLM_ALLOW_LONG_MAX_MODEL_LEN: outputs past the model's context may be wrong.",
                           args.max_model_len, max_pos)
        self.max_model_len = args.max_model_len or max_pos
        self.max_num_seqs = args.max_num_seqs
        # Overlap host work with device work: on by default on CUDA (no gain on a CPU, which does both).
        self.async_scheduling = (args.async_scheduling if args.async_scheduling is not None
                                 else self.device.type == "cuda")
        if pipelined:  # the pipeline overlaps steps itself: micro-batches of different requests in flight
            self.async_scheduling = False
        self.max_num_batched_tokens = args.max_num_batched_tokens or max(default_batched_tokens(self.device),
                                                                         self.max_num_seqs)
        if not args.enable_chunked_prefill:
            self.max_num_batched_tokens = check_unchunked_budget(args, self.max_num_batched_tokens,
                                                                 self.max_model_len)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}).")
        offload = args.cpu_offload_gb > 0
        torch.manual_seed(args.seed)
        if self.device.type == "cpu":
            torch.set_num_threads(max(1, torch.get_num_threads()))
        from pagedllm.quantization import weight_memory_summary
        from pagedllm.quantization.gguf import engine_quant_config

        refuse_checkpoint_quantization(cfg, self.model_dir, args.model)
        # A .gguf on CPU keeps its quantized blocks (quantization/gguf.py); otherwise the seam's resolution.
        self.quant_config = engine_quant_config(args, cfg, model_path, self.model_dir, self.device, self.dtype)
        if offload and self.quant_config is not None:
            raise ValueError("--cpu-offload-gb with a quantized model is not supported yet by pagedllm.")
        start = time.perf_counter()
        # With offloading the model is built in host memory first: it may not fit the GPU whole.
        self.model = get_model(cfg, self.model_dir, dtype=self.dtype,
                               device=torch.device("cpu") if offload else self.device, load_format=args.load_format,
                               quant_config=self.quant_config, max_model_len=self.max_model_len)
        graphs = args.graph_settings()
        enforce_eager = args.enforce_eager or not graphs.any_graphs
        if offload:
            from pagedllm.worker.cpu_offload import CpuOffloader

            self.offloader = CpuOffloader(self.model, args.cpu_offload_gb * 2**30, self.device)
            if not enforce_eager:
                logger.info("CUDA graphs are off: --cpu-offload-gb copies weights from Python hooks at run time.")
            enforce_eager = True
        logger.info("Loaded %s (%s) from %s in %.1f s on %s as %s%s.", cfg.architectures[0] if cfg.architectures
                    else type(self.model).__name__, _count_params(self.model), self.model_dir,
                    time.perf_counter() - start, self.device, str(self.dtype).replace("torch.", ""),
                    f", quantization {self.quant_config.name}" if self.quant_config else "")
        logger.info("Model memory: %s.", weight_memory_summary(self.model))
        if self.device.type == "cpu" and self.dtype == torch.float32:
            # oneDNN-prepacked copies of the weights (faster CPU matmuls) cost a second copy in RAM: only
            # when that copy fits comfortably.
            weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
            if weight_bytes < 0.25 * available_cpu_memory():
                from pagedllm.layers.linear import pack_cpu_weights

                pack_cpu_weights(self.model)
                self._cpu_packed = True  # sleep level 2 packs the reloaded weights again
            else:
                logger.info("Not prepacking CPU weights (%.1f GiB): not enough free RAM for a second copy.",
                            weight_bytes / 2**30)
        self.lora_manager = None
        if args.enable_lora:
            from pagedllm.lora.manager import LoRAManager

            self.lora_manager = LoRAManager(self.model, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                                            max_cpu_loras=args.max_cpu_loras,
                                            max_num_tokens=self.max_num_batched_tokens, device=self.device)
        # Which layers share a block table (sliding windows): the scheduler keeps one block list per group.
        self.kv_groups = model_kv_cache_groups(self.model, self.max_model_len)
        self.kv_group_windows = self.kv_groups.windows
        if pipelined:
            from pagedllm.distributed.pipeline import PipelineStage

            self.model = PipelineStage(self.model)
        # Every rank draws the same random numbers from here on (unseeded sampling), whatever loading used.
        torch.manual_seed(args.seed)
        self.runner = ModelRunner(
            self.model, hf_config=cfg, device=self.device, dtype=self.dtype, block_size=args.block_size,
            max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            eos_token_id=self.eos_token_ids[0] if self.eos_token_ids else None, vocab_size=self.vocab_size,
            attention_backend=args.attention_backend, enforce_eager=enforce_eager or pipelined,
            kv_cache_dtype=resolve_kv_cache_dtype(args.kv_cache_dtype, self.dtype, self.device),
            kv_groups=self.kv_groups, logprobs_mode=args.logprobs_mode, graph_settings=graphs,
            prompt_embeds=args.enable_prompt_embeds)
        self.runner.lora = self.lora_manager
        self.long_rope_original = self.runner.long_rope_original  # the scheduler's LongRoPE boundary (or None)
        self.ntk_original = self.runner.ntk_original  # dynamic NTK's (long prompts' prefix-cache roots), or None
        if self.lora_manager is not None:
            self.lora_manager.warm_up(self.max_num_batched_tokens)
        self.speculative = args.speculative()
        self.num_speculative_tokens = self.speculative.num_speculative_tokens if self.speculative else 0
        self.spec_disable_batch_size = self.speculative.disable_by_batch_size if self.speculative else None
        if self.speculative is not None:
            from pagedllm.spec_decode.spec_runner import SpecDecodeRunner, build_proposer

            self.runner.spec = SpecDecodeRunner(self.speculative, build_proposer(self.speculative, worker=self),
                                                self.max_model_len)
        # Verify steps overlapped like plain ones (drafts proposed on the device): n-gram with async scheduling.
        self.spec_overlap = (self.speculative is not None and self.speculative.method == "ngram"
                             and self.async_scheduling and envs.PAGEDLLM_SPEC_OVERLAP)
        if self.spec_overlap:
            self.spec_overlap = self.runner.spec.enable_device_ngram(self.runner)
        # Every rank must hold the same pool: the smallest budget wins.
        self.num_blocks = world.all_reduce_min_int(self._determine_num_blocks())
        if self.speculative is not None and args.num_gpu_blocks_override is None:
            self.num_blocks = self.runner.spec.share_blocks(self.num_blocks, self.runner.kv_cache_spec())
        if self.runner.kv_cache_dtype != self.dtype:
            logger.info("KV cache in %s: %d bytes per token.", str(self.runner.kv_cache_dtype).replace("torch.", ""),
                        self.runner.kv_cache_spec().bytes_per_token)
        self.runner.initialize_kv_cache(self.num_blocks)
        if self.speculative is not None:
            self.runner.spec.initialize(self.num_blocks)
        self.sleeping_tags: set[str] = set()
        self._sleeper = None  # worker/sleep.WeightSleeper, built on the first sleep

    def _determine_num_blocks(self) -> int:
        args = self.args
        spec = self.runner.kv_cache_spec()
        if args.num_gpu_blocks_override is not None:
            # Refused as a too-small pool from memory is: a sequence that cannot fit would be cut short silently.
            num_blocks, need = args.num_gpu_blocks_override, self._blocks_per_sequence(spec.block_size)
            if num_blocks < need:
                raise ValueError(
                    f"num_gpu_blocks_override={num_blocks} KV blocks of {spec.block_size} tokens hold "
                    f"{num_blocks * spec.block_size} tokens, but max_model_len is {self.max_model_len} (one sequence "
                    f"needs {need} blocks); lower --max-model-len or raise --num-gpu-blocks-override to at least "
                    f"{need}.")
            return num_blocks
        if self.device.type == "cuda":
            return self._cuda_num_blocks(spec)
        budget = cpu_kv_budget(args.kv_cache_memory_bytes)
        # Never take more than the whole batch could use at full length.
        one_sequence = self._blocks_per_sequence(spec.block_size)
        most = self.max_num_seqs * one_sequence + 1
        num_blocks = min(budget // spec.bytes_per_block, most)
        if num_blocks < one_sequence and num_blocks < most:
            raise ValueError(
                f"The KV cache budget ({budget / 2**30:.2f} GiB, {spec.bytes_per_token} bytes per token) holds "
                f"only {num_blocks} blocks of {spec.block_size} tokens, less than one sequence of max_model_len="
                f"{self.max_model_len} needs ({one_sequence}); raise kv_cache_memory_bytes or lower "
                f"--max-model-len.")
        return max(1, int(num_blocks))

    def _cuda_num_blocks(self, spec) -> int:
        args = self.args
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        free_before, total = torch.cuda.mem_get_info(self.device)
        self.runner.profile_run()
        peak = torch.cuda.max_memory_allocated(self.device) - self._cuda_baseline
        torch.cuda.empty_cache()
        free_after, _ = torch.cuda.mem_get_info(self.device)
        # Device memory outside this process's caching allocator: other processes', this process's CUDA context,
        # and kernel code, less what earlier engines of this process loaded after sizing their pool (not
        # another process's: without this a second engine in a process would get a smaller pool than the first).
        self._non_torch_at_sizing = total - free_after - torch.cuda.memory_reserved(self.device)
        self._non_torch_known = _LEFT_BY_ENGINES.get(self._device_index(), 0)
        used_by_others = self._non_torch_at_sizing - self._non_torch_known
        # gpu_memory_utilization is this engine's share; what another engine of this process holds is not counted
        # against it, but the KV cache can only take memory that is free once this engine's activations are back.
        activations = peak - (torch.cuda.memory_allocated(self.device) - self._cuda_baseline)
        budget = min(args.gpu_memory_utilization * total - peak - max(0, used_by_others),
                     free_after - activations) - (256 << 20)
        if args.kv_cache_memory_bytes is not None:
            budget = args.kv_cache_memory_bytes
        num_blocks = int(budget // spec.bytes_per_block)
        need_blocks = self._blocks_per_sequence(spec.block_size)
        if num_blocks < need_blocks:
            gib = 2**30
            short = (need_blocks - max(num_blocks, 0)) * spec.bytes_per_block / gib
            if args.kv_cache_memory_bytes is not None:
                raise ValueError(
                    f"--kv-cache-memory-bytes {args.kv_cache_memory_bytes} ({budget / gib:.2f} GiB) holds {num_blocks} "
                    f"KV blocks of {spec.block_size} tokens, less than one sequence of max_model_len="
                    f"{self.max_model_len} needs ({need_blocks}: {short:.2f} GiB more). Raise it, or leave it out "
                    f"to size the pool from --gpu-memory-utilization.")
            raise ValueError(
                f"Not enough GPU memory for the KV cache of one sequence of max_model_len={self.max_model_len}: "
                f"weights + peak activations take {peak / gib:.2f} GiB, other processes {max(0, used_by_others) / gib:.2f} "
                f"GiB of {total / gib:.1f} GiB, leaving {max(budget, 0) / gib:.2f} GiB at gpu_memory_utilization="
                f"{args.gpu_memory_utilization}; {short:.2f} GiB more is needed. Raise --gpu-memory-utilization, "
                f"lower --max-model-len, lower --max-num-batched-tokens / --max-num-seqs, or free GPU memory "
                f"held by other processes.")
        logger.info("GPU memory: total %.1f GiB, weights+activations peak %.2f GiB, KV budget %.2f GiB.",
                    total / 2**30, peak / 2**30, budget / 2**30)
        return num_blocks

    def _blocks_per_sequence(self, block_size: int) -> int:
        """Block ids one max_model_len sequence holds (in every KV-cache group; sliding ones only their window)."""
        return blocks_needed(self.kv_group_windows, self.max_model_len, self.max_num_batched_tokens, block_size)

    def execute_model(self, plan: BatchPlan) -> ModelOutput:
        return self.runner.execute_model(plan)

    def apply_sampled_tokens(self, tokens: list[tuple[str, int]]) -> None:
        """Pipeline stages before the last: append the tokens the last stage sampled (sent with the next
        plan), so this stage's per-request state knows them before it runs those requests again."""
        batch = self.runner.input_batch
        for req_id, token in tokens:
            state = batch.requests.get(req_id)
            if state is not None:
                batch.append_token(state, token)

    # launch() takes before_sampling (see ModelRunner.launch): the engine may overlap mask filling with the forward.
    launch_hook = True

    def launch(self, plan: BatchPlan, before_sampling=None):
        return self.runner.launch(plan, before_sampling)

    @staticmethod
    def empty_output() -> ModelOutput:
        return ModelOutput()

    # ---- sleep mode (EngineCore.sleep / wake_up; worker/sleep.py). Every rank runs these (executor/multiproc.py).
    def _weight_sleeper(self):
        if self._sleeper is None:
            from pagedllm.worker.sleep import WeightSleeper

            self._sleeper = WeightSleeper(self.model, self.device, self._load_fresh_model, self._after_reload)
        return self._sleeper

    def _load_fresh_model(self) -> torch.nn.Module:
        from pagedllm.models.loader import get_model

        return get_model(self.hf_config, self.model_dir, dtype=self.dtype, device=self.device,
                         load_format=self.args.load_format, quant_config=self.quant_config,
                         max_model_len=self.max_model_len)

    def _after_reload(self, model: torch.nn.Module) -> None:
        if self.__dict__.get("_cpu_packed"):
            from pagedllm.layers.linear import pack_cpu_weights

            pack_cpu_weights(model)

    def sleep(self, level: int = 1) -> None:
        if self.sleeping_tags:
            return
        self.runner.sleep_kv_cache()
        self._weight_sleeper().sleep(level)
        self.sleeping_tags = {"weights", "kv_cache"}
        # Graphs and their runners hold reference cycles; a server process froze them at start (gc.freeze), where
        # the collector never looks: unfrozen for this one collection, the survivors frozen again.
        frozen = gc.get_freeze_count()
        if frozen:
            gc.unfreeze()
        gc.collect()
        if frozen:
            gc.freeze()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            release_cuda_memory(self.device)

    def wake_up(self, tags=("weights", "kv_cache")) -> None:
        tags = [t for t in tags if t in self.sleeping_tags]
        if "weights" in tags:
            self._weight_sleeper().wake_up()
        if "kv_cache" in tags:
            self.runner.wake_up_kv_cache()
        self.sleeping_tags -= set(tags)
        if tags and not self.sleeping_tags:
            self.runner.recapture_graphs()  # they recorded the old weights' and KV cache's addresses

    def reload_weights(self) -> None:
        """Read the weights again from the model's files (vLLM's collective_rpc("reload_weights"))."""
        if "weights" in self.sleeping_tags:
            raise ValueError("The weights are asleep: wake_up(tags=['weights']) first (after sleep level 2 that "
                             "reloads them already).")
        sleeper = self._weight_sleeper()
        self.runner.cuda_graphs = self.runner.mixed_graphs = None  # they read the tensors being replaced
        sleeper.sleep(2)
        sleeper.wake_up()
        if not self.sleeping_tags:
            self.runner.recapture_graphs()

    def shutdown(self) -> None:
        """Free what this worker holds: the KV cache, CUDA graphs and their memory pool, the weights (and a draft
        model, LoRA slots, offloaded layers). Idempotent; the worker runs no steps afterwards."""
        if self.__dict__.get("_shut_down"):
            return
        self._shut_down = True
        device = self.__dict__.get("device")
        cuda = device is not None and device.type == "cuda"
        if cuda:
            try:
                torch.cuda.synchronize(device)  # nothing still running reads what is freed below
            except RuntimeError:  # a failed device: free what can be freed
                pass
        # (_sleeper: sleep mode's host copies of the weights)
        for name in ("runner", "model", "lora_manager", "offloader", "quant_config", "_sleeper"):
            self.__dict__[name] = None
        gc.collect()  # the runner, its graphs and the model hold reference cycles
        if cuda:
            try:
                release_cuda_memory(device)
                if "_non_torch_at_sizing" in self.__dict__:
                    self._record_non_torch_left()
            except RuntimeError as e:  # a failed device
                logger.warning("Could not give cached GPU memory back at shutdown: %s", e)
        gguf_packed = sys.modules.get("pagedllm.models.gguf_packed")
        if gguf_packed is not None:  # a .gguf was read: its cached map (which packed CPU weights view) goes too
            gguf_packed.clear_index_cache()

    def _device_index(self) -> int:
        return self.device.index if self.device.index is not None else torch.cuda.current_device()

    def _record_non_torch_left(self) -> None:
        """What non-torch device memory grew by since this engine sized its pool (kernels it loaded later, CUDA's
        local-memory reservation) stays in the process after it: the next engine must not count it as another
        process's. The largest such growth any engine saw (engines living side by side see the same kernels)."""
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = total - free - torch.cuda.memory_reserved(self.device)
        grown = non_torch - self._non_torch_at_sizing + self._non_torch_known
        index = self._device_index()
        _LEFT_BY_ENGINES[index] = max(_LEFT_BY_ENGINES.get(index, 0), grown, 0)


# Per CUDA device index: non-torch device memory that engines of this process loaded after sizing their KV
# cache and that outlives them (see Worker._record_non_torch_left). Another process's memory changing meanwhile
# shows here too; the KV budget stays capped by the memory actually free.
_LEFT_BY_ENGINES: dict[int, int] = {}


def release_cuda_memory(device: torch.device) -> None:
    """Hand what torch caches for this process back to the device and the host: cuBLAS's per-stream
    workspaces (allocated by the first product on each stream, kept for the process), the caching allocator's
    free blocks, and pinned host blocks (staging buffers, offloaded layers)."""
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    with torch.cuda.device(device):
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()
    host_empty_cache = getattr(torch._C, "_host_emptyCache", None)
    if host_empty_cache is not None:
        host_empty_cache()


def _count_params(model: torch.nn.Module) -> str:
    n = sum(p.numel() for p in model.parameters())
    n += sum(m.__dict__.get("gguf_numel", 0) for m in model.modules())  # weights kept in GGUF blocks
    return f"{n / 1e9:.2f}B params" if n >= 1e9 else f"{n / 1e6:.0f}M params"
