"""Engine configuration: EngineArgs, the user-facing options under vLLM's names.

`LLM(...)` kwargs, CLI flags and `--config FILE.yaml` fill one EngineArgs. `validate()` checks what needs no
model (ranges, choices, features not built yet) and raises ValueError with a sentence that says what to change;
the Worker then resolves the model (models/loader.py), reads its HF config, picks device and dtype
(dtypes.py) and checks the rest against the model (max_model_len, KV pool size).
"""
from __future__ import annotations

import dataclasses
import numbers
import os
import secrets
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from pagedllm.dtypes import DTYPE_CHOICES

# the name the default model is served and labelled under when no --model / --served-model-name says one
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# vLLM's logprobs_mode: what a sampled token's logprobs report (layers/sampler.py): log-softmax or logits, of the
# raw logits or of those the token is drawn from (after penalties, temperature, min_p, top-k / top-p).
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
CPU_OFFLOAD_ON_CPU = ("--cpu-offload-gb is meaningless on the CPU: the weights already live in host memory; drop "
                      "the flag.")

# Annotation -> (the type a value must have, None allowed): the options EngineArgs._check_types checks.
_PLAIN_TYPES = {name: (kind, optional) for kind in ("int", "float", "bool", "str") for optional, name in
                ((False, kind), (True, f"Optional[{kind}]"))}

_NOT_SUPPORTED_YET: dict[str, Any] = {
    # arg name -> the default value that means "off"; anything else fails at start (never silently ignored).
}


# profiler_config's switches, named as vLLM's -> the torch.profiler.profile argument each sets
PROFILER_FLAGS = {"torch_profiler_record_shapes": "record_shapes", "torch_profiler_with_stack": "with_stack",
                  "torch_profiler_with_memory": "profile_memory", "torch_profiler_with_flops": "with_flops"}


@dataclass
class EngineArgs:
    model: Optional[str] = None  # HF directory, .gguf file, or None for the default SmolLM2 model
    tokenizer: Optional[str] = None
    tokenizer_mode: str = "auto"  # vLLM's: "auto" | "hf" (the same here) | "slow" (tokenizer.check_tokenizer_mode)
    served_model_name: Optional[str] = None
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False
    dtype: str = "auto"
    seed: int = 0
    load_format: str = "auto"  # "auto" | "safetensors" | "gguf" | "dummy"
    max_model_len: Optional[int] = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: Optional[int] = None  # CPU (and override on GPU): bytes for the KV pool
    num_gpu_blocks_override: Optional[int] = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"  # "fcfs" | "priority" (each request's priority, lower first; vLLM's rule)
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    device: str = "auto"  # "auto" | "cuda" | "cpu"
    enforce_eager: bool = False
    # vLLM's: an optimization level (0-3) or a dict (JSON on the command line); only its CUDA-graph choices apply
    # here (compilation_config.py: pagedllm runs no torch.compile), other keys are refused
    compilation_config: Optional[Any] = None
    attention_backend: Optional[str] = None
    async_scheduling: Optional[bool] = None  # None: on for CUDA, off for CPU
    quantization: Optional[str] = None
    cpu_offload_gb: float = 0
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    speculative_config: Optional[dict] = None
    disable_log_stats: bool = True
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"  # one of LOGPROBS_MODES (prompt_logprobs are always raw log-softmax)
    max_cpu_loras: Optional[int] = None  # adapters kept in host memory (LRU); None: max_loras
    # vLLM's: adapters are kept in the model's dtype ("auto", vLLM's default; other values are refused), and
    # fully_sharded_loras (vLLM also shards A across ranks) changes only how tensor-parallel ranks split the adapter
    # math, not its result: accepted as what pagedllm does (column-parallel layers keep A whole).
    lora_dtype: str = "auto"
    fully_sharded_loras: bool = False
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype) | "fp8" (= "fp8_e4m3")
    # Parallelism (executor/, distributed/): worker processes per rank, engine-core replicas, several nodes.
    data_parallel_size: int = 1
    distributed_executor_backend: Optional[str] = None  # None: in-process for one rank, else "mp"; or "ray"
    nnodes: int = 1
    node_rank: int = 0
    master_addr: Optional[str] = None  # default: $MASTER_ADDR, else 127.0.0.1
    master_port: Optional[int] = None  # default: $MASTER_PORT, else 29500 (a free port on one node)
    generation_config: str = "auto"  # "auto" (the model's generation_config.json) | "vllm" (none) | a directory
    override_generation_config: Optional[dict] = None  # generation_config.json keys over those (vLLM's)
    revision: Optional[str] = None  # hub repo ids: branch, tag or commit
    # vLLM's: the tokenizer's hub revision (None: revision's), for a hub tokenizer id (--tokenizer, or the model id
    # itself); a local path is used as it is. code_revision: the revision of a hub model's own code
    # (trust_remote_code); pagedllm reads that code from the files at revision, so another one is refused.
    tokenizer_revision: Optional[str] = None
    code_revision: Optional[str] = None
    download_dir: Optional[str] = None  # hub repo ids: the cache to use instead of the hub's default
    # hub repo ids (model, tokenizer, draft model): vLLM's hf_token, a token or True (the one `hf auth login`
    # stored); None: HF_TOKEN. Out of repr: an EngineArgs printed in a log or traceback must not show it.
    hf_token: Union[bool, str, None] = field(default=None, repr=False)
    # Structured outputs: {"backend": "auto" | "xgrammar" | "guidance", "disable_any_whitespace": bool, ...}
    structured_outputs_config: Optional[dict] = None
    # vLLM's profiler_config for LLM.start_profile() / stop_profile(): {"profiler": "torch", "torch_profiler_dir": DIR,
    # "torch_profiler_record_shapes" / "_with_stack" / "_with_memory" / "_with_flops": bool}; None: the
    # VLLM_TORCH_PROFILER_DIR environment variable says where traces go (unset: profiling off).
    profiler_config: Optional[dict] = None
    # Embeddings (pooling/), vLLM's names: runner "pooling" serves embeddings only ("auto": generation too, except
    # for a model without its head); convert "embed" and the older task "embed" mean the same; convert "classify"
    # (task "classify" / "score") serves a *ForSequenceClassification / *ForTokenClassification model (which never
    # generates); convert / task "reward" every token's output (a causal LM's hidden states). pooler_config:
    # {"pooling_type": "LAST" | "MEAN" | "CLS" | "ALL" | "STEP", "normalize": bool, "step_tag_id": int,
    # "returned_token_ids": [int]} over the model's own defaults (STEP: pooling.step_pooling).
    runner: str = "auto"
    convert: str = "auto"
    # config.json fields set over the file's, e.g. {"max_position_embeddings": 65536} (vLLM's hf_overrides)
    hf_overrides: Optional[dict] = None
    # vLLM's: a directory (or hub repo id) whose config.json describes the model instead of the model's own (a GGUF's
    # metadata-derived one included); the weights, tokenizer and generation_config.json stay the model's
    hf_config_path: Optional[str] = None
    # Chunked prefill: the most tokens one request's prefill chunk may take per step (vLLM's; 0 or None: the budget)
    long_prefill_token_threshold: Optional[int] = None
    task: Optional[str] = None
    pooler_config: Optional[dict] = None
    # LLM.sleep / wake_up (vLLM's sleep mode): the weights and KV cache may be given back while the engine idles.
    enable_sleep_mode: bool = False
    # vLLM's CPU swap space in GiB, accepted for its scripts and configs; it does nothing, here as in vLLM's V1
    # engine, which allocates no CPU blocks (vllm-project/vllm#27984; the argument was removed in #36216): a
    # preempted request is recomputed, its KV blocks are never swapped out. Any value >= 0 is the same engine.
    swap_space: float = 4
    # vLLM's, accepted as what pagedllm always does: tensor-parallel sums go through torch.distributed (NCCL), no
    # custom all-reduce kernel; attention has no cascade path; a rank reads its checkpoint files one after another.
    disable_custom_all_reduce: bool = False
    disable_cascade_attn: bool = False
    max_parallel_loading_workers: Optional[int] = None
    # vLLM's: every layer attends to the whole context, max_model_len capped at the model's sliding window (the
    # smallest of its layers'); a model without one is unchanged.
    disable_sliding_window: bool = False
    # vLLM's: prompts may be given as embeddings ({"prompt_embeds": tensor[num_tokens, hidden]}), which replace the
    # token embedding lookup at their positions; off, such prompts are refused.
    enable_prompt_embeds: bool = False

    @property
    def embeddings_only(self) -> bool:
        """runner="pooling" (or convert / task "embed" / "classify" / "reward"): the engine pools, it does not
        generate."""
        return (self.runner == "pooling" or self.convert in ("embed", "classify", "reward")
                or self.task in ("embed", "classify", "score", "reward"))

    def _check_pooling(self) -> None:
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner must be auto, generate or pooling, got {self.runner!r}.")
        if self.convert not in ("auto", "none", "embed", "classify", "reward"):
            raise ValueError(f"convert must be auto, none, embed, classify or reward (other conversions are not "
                             f"built), got {self.convert!r}.")
        if self.task not in (None, "auto", "generate", "embed", "classify", "score", "reward"):
            raise ValueError(f"task must be generate, embed, classify, score or reward (other tasks are not built), "
                             f"got {self.task!r}.")
        by_convert = {"embed": "embed", "classify": "classify", "reward": "reward"}.get(self.convert)
        by_task = {"embed": "embed", "classify": "classify", "score": "classify", "reward": "reward"}.get(self.task)
        if by_convert and by_task and by_convert != by_task:
            raise ValueError("convert and task ask for different poolings (embed / classify / reward); give one.")
        wants_generation = self.runner == "generate" or self.task == "generate"
        if wants_generation and self.embeddings_only:
            raise ValueError("runner / task 'generate' and 'pooling' / 'embed' contradict each other; give one.")
        if self.embeddings_only and self.speculative_config:
            raise ValueError("speculative_config with a pooling runner (runner / convert / task embed, classify, "
                             "reward): a pooling model generates no tokens to speculate on; drop one of them.")
        if self.pooler_config is not None:
            from pagedllm.pooling import check_pooler_config

            self.pooler_config = check_pooler_config(self.pooler_config)

    def _check_profiler(self) -> None:
        """profiler_config as vLLM's (a dict, or its dataclass): the torch profiler and its options; what pagedllm
        cannot honour (another profiler, other keys) is refused rather than ignored."""
        pc = self.profiler_config
        if pc is None:
            return
        if dataclasses.is_dataclass(pc) and not isinstance(pc, type):
            pc = dataclasses.asdict(pc)
        if not isinstance(pc, dict):
            raise ValueError(f"profiler_config must be a dict, got {type(pc).__name__}.")
        unknown = sorted(set(pc) - {"profiler", "torch_profiler_dir", *PROFILER_FLAGS})
        if unknown:
            raise ValueError(f"profiler_config keys {unknown} are not supported by pagedllm; it takes profiler, "
                             f"torch_profiler_dir and {', '.join(PROFILER_FLAGS)}.")
        if pc.get("profiler") not in (None, "torch"):
            raise ValueError(f"profiler_config profiler {pc['profiler']!r} is not supported by pagedllm; use 'torch'.")
        directory = pc.get("torch_profiler_dir")
        if directory is not None and not isinstance(directory, (str, os.PathLike)):
            raise ValueError(f"profiler_config torch_profiler_dir must be a path, got {directory!r}.")
        if (pc.get("profiler") == "torch") != bool(directory):
            raise ValueError("profiler_config needs both profiler 'torch' and torch_profiler_dir (the directory the "
                             "traces go to), or neither.")
        for key in PROFILER_FLAGS:
            if not isinstance(pc.get(key, False), bool):
                raise ValueError(f"profiler_config {key} must be true or false, got {pc[key]!r}.")
        self.profiler_config = dict(pc, torch_profiler_dir=os.fspath(directory)) if directory else None

    def _check_code_revision(self) -> None:
        """A hub model's code comes from its files at revision; a different code_revision would need a second
        download that pagedllm does not make. A local model has no revisions: vLLM (transformers) ignores it."""
        from pagedllm.models.model_resolution import local_path, looks_like_repo_id

        code, model = self.code_revision, self.model
        if code is None or code == self.revision or not isinstance(model, str) or local_path(model) is not None:
            return
        if looks_like_repo_id(model):
            raise ValueError(f"code_revision={code!r} is not supported by pagedllm: the model's code is read from "
                             f"its files at revision={self.revision!r}; pass --revision {code} (revision=) to use "
                             "that revision's files and code.")

    def _check_hf_config_path(self) -> None:
        """A local hf_config_path must be a directory holding config.json; it is made absolute so that every
        process (worker ranks started elsewhere) reads the same file. A hub repo id is resolved at load."""
        from pagedllm.models.model_resolution import local_path, looks_like_repo_id

        path = self.hf_config_path
        if path is None:
            return
        if not path.strip():
            raise ValueError("hf_config_path is empty; give a directory holding config.json, or a Hugging Face repo "
                             "id.")
        local = local_path(path)
        if local is None:
            if looks_like_repo_id(path):
                return
            raise ValueError(f"hf_config_path {path!r} does not exist; give a directory holding config.json, or a "
                             f"Hugging Face repo id.")
        if not os.path.isdir(local):
            raise ValueError(f"hf_config_path {path!r} is a file; give the directory that holds the config.json.")
        if not os.path.isfile(os.path.join(local, "config.json")):
            raise ValueError(f"hf_config_path {path!r} has no config.json; give the directory (or Hugging Face "
                             f"repo id) whose config.json describes the model.")
        self.hf_config_path = os.path.abspath(local)

    def hf_config_dir(self) -> Optional[str]:
        """The directory whose config.json describes the model (hf_config_path's; a hub repo id fetched, configs
        only), or None: the model's own. Every reader of the model's config goes through this."""
        if self.hf_config_path is None:
            return None
        from pagedllm.models.model_resolution import resolve_config_dir

        return resolve_config_dir(self.hf_config_path, self.revision, self.download_dir, self.hf_token)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineArgs":
        unknown = set(kwargs) - cls.field_names()
        if unknown:
            hint = ""
            if "max_seq_len_to_capture" in unknown:  # vLLM removed it (#25543, 0.11): its graphs have their own cap
                hint = (" max_seq_len_to_capture was removed from vLLM (0.11); the CUDA-graph size cap is "
                        "compilation_config's max_cudagraph_capture_size.")
            raise TypeError(f"Unknown engine argument(s): {', '.join(sorted(unknown))}.{hint}")
        return cls(**kwargs)

    def _check_types(self) -> None:
        """Each option of a plain type has a value of that type (a string "false" is truthy; "512" or 512.5 would
        fail deep inside the engine); seed=None (vLLM's "no fixed seed") draws one; dtype may be a torch.dtype."""
        if self.seed is None:
            self.seed = secrets.randbelow(2 ** 31)
        if type(self.dtype).__module__ == "torch" and type(self.dtype).__name__ == "dtype":
            # vLLM's LLM(dtype=torch.float16): by its name (torch.float16 -> "float16"), checked against the choices
            self.dtype = str(self.dtype).removeprefix("torch.")
        for f in dataclasses.fields(self):
            want = _PLAIN_TYPES.get(str(f.type))
            if want is None:
                continue
            kind, optional = want
            v = getattr(self, f.name)
            if v is None and optional:
                continue
            if kind == "str" and isinstance(v, os.PathLike):  # (paths: the model, a directory)
                v = os.fspath(v)
                setattr(self, f.name, v)
            ok = {"int": isinstance(v, numbers.Integral) and not isinstance(v, bool),
                  "float": isinstance(v, numbers.Real) and not isinstance(v, bool),
                  "bool": isinstance(v, bool), "str": isinstance(v, str)}[kind]
            if not ok:
                raise ValueError(f"{f.name} must be {'an ' if kind == 'int' else 'a '}{kind}"
                                 f"{' or None' if optional else ''}, got {v!r}.")

    def validate(self) -> None:
        self._check_types()
        for name, off in _NOT_SUPPORTED_YET.items():
            if getattr(self, name) != off:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag}={getattr(self, name)!r} is not supported yet by pagedllm.")
        if not 0 <= self.seed < 2 ** 64:  # torch.manual_seed's range (beyond it: "Overflow when unpacking long long");
            # negative seeds are refused as in vLLM, whose numpy seeding refuses them
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}.")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}.")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_CHOICES)}, got {self.dtype!r}.")
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ValueError(f"load_format must be auto, safetensors, gguf or dummy, got {self.load_format!r}.")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}.")
        self._check_pooling()
        if self.hf_overrides is not None and (not isinstance(self.hf_overrides, dict)
                                              or not all(isinstance(k, str) for k in self.hf_overrides)):
            raise ValueError(f"hf_overrides must be a JSON object of config fields, got {self.hf_overrides!r}.")
        if self.long_prefill_token_threshold == 0:  # vLLM's "off"
            self.long_prefill_token_threshold = None
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 1:
            raise ValueError(f"long_prefill_token_threshold must be >= 1 (0: off), got "
                             f"{self.long_prefill_token_threshold}.")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}.")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}.")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}.")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}.")
        if self.quantization is not None and not isinstance(self.quantization, str):
            raise ValueError(f"quantization must be a method name, got {self.quantization!r}.")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                             f"{self.kv_cache_dtype!r}.")
        self.validate_parallel()
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device must be auto, cuda or cpu, got {self.device!r}.")
        from pagedllm.tokenizer import check_tokenizer_mode, check_tokenizer_path

        check_tokenizer_mode(self.tokenizer_mode)
        if self.tokenizer is not None and not self.skip_tokenizer_init:
            check_tokenizer_path(self.tokenizer)  # a typo'd path fails now, not after the model has loaded
        if self.generation_config not in ("auto", "vllm"):
            from pagedllm.generation_config import load_sampling_defaults

            load_sampling_defaults(self.generation_config, "")  # a DIR must hold a readable generation_config.json
        if self.override_generation_config is not None:
            from pagedllm.generation_config import check_generation_override

            self.override_generation_config = check_generation_override(self.override_generation_config)
        if not self.cpu_offload_gb >= 0:  # (written so nan fails too: it passes every comparison)
            raise ValueError(f"cpu_offload_gb must be >= 0 (0 turns offloading off), got {self.cpu_offload_gb}.")
        if self.cpu_offload_gb > 0 and self.device == "cpu":
            raise ValueError(CPU_OFFLOAD_ON_CPU)
        if self.hf_token is not None and not (isinstance(self.hf_token, bool) or (isinstance(self.hf_token, str)
                                                                                  and self.hf_token.strip())):
            raise ValueError("hf_token must be a Hugging Face token, True (the token `hf auth login` stored) or "
                             f"None (HF_TOKEN), got a {type(self.hf_token).__name__}.")
        if not self.swap_space >= 0:  # (nan too)
            raise ValueError(f"swap_space must be >= 0 (GiB), got {self.swap_space}.")
        self._check_code_revision()
        self._check_hf_config_path()
        self._check_profiler()
        if self.enable_prompt_embeds and self.speculative_config:
            raise ValueError("enable_prompt_embeds with speculative decoding is not supported yet by pagedllm: a "
                             "draft would see placeholder tokens where the prompt's embeddings are.")
        if self.max_parallel_loading_workers is not None and self.max_parallel_loading_workers < 1:
            raise ValueError(f"max_parallel_loading_workers must be >= 1, got {self.max_parallel_loading_workers}.")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= 0 (or -1: no limit), got {self.max_logprobs}.")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}.")
        self._validate_lora()
        self.speculative()  # raises on a bad speculative_config
        self.graph_settings()  # raises on a bad compilation_config
        self._validate_sleep_mode()

    def _validate_sleep_mode(self) -> None:
        # These keep their own views of the weights (LoRA wrappers' slots, offloaded layers' host copies, a draft
        # model's runner) that sleep would have to move in step with the model's: refused until that is built.
        if not self.enable_sleep_mode:
            return
        for name, on in (("enable_lora", self.enable_lora), ("cpu_offload_gb", self.cpu_offload_gb > 0),
                         ("speculative_config", self.speculative_config is not None)):
            if on:
                raise ValueError(f"--enable-sleep-mode with --{name.replace('_', '-')} is not supported yet by "
                                 "pagedllm.")

    def validate_parallel(self) -> None:
        for name in ("pipeline_parallel_size", "data_parallel_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.distributed_executor_backend not in (None, "mp", "ray", "uni"):
            raise ValueError("distributed_executor_backend must be mp, ray or uni, got "
                             f"{self.distributed_executor_backend!r}.")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}.")
        if self.master_port is not None and not 0 < self.master_port < 65535:
            raise ValueError(f"master_port must be a TCP port, got {self.master_port}.")
        if self.nnodes > 1 and self.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 with nnodes > 1 is not supported yet: run one "
                             "data-parallel server per node group behind a load balancer instead.")
        self._validate_parallel_combinations()

    def _validate_parallel_combinations(self) -> None:
        # Speculative decoding runs in the in-process worker only: the executor's worker ranks do not build the
        # draft model or propose yet, so refuse rather than run without it.
        multi_rank = self.tensor_parallel_size * self.pipeline_parallel_size > 1 or self.nnodes > 1
        if not multi_rank and self.distributed_executor_backend in (None, "uni"):
            return
        what = (f"tensor_parallel_size={self.tensor_parallel_size}, pipeline_parallel_size="
                f"{self.pipeline_parallel_size}, nnodes={self.nnodes}, distributed_executor_backend="
                f"{self.distributed_executor_backend}")
        if self.speculative_config is not None:
            raise ValueError(f"--speculative-config with worker processes ({what}) is not supported yet by "
                             "pagedllm; run speculative decoding with one in-process rank.")

    def _validate_lora(self) -> None:
        if not self.enable_lora:
            return
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}.")
        if not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"max_lora_rank must be in [1, 512], got {self.max_lora_rank}.")
        if self.lora_dtype != "auto":
            raise ValueError(f"lora_dtype={self.lora_dtype!r} is not supported by pagedllm: adapters are kept in the "
                             "model's dtype (lora_dtype='auto').")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}).")
        if self.cpu_offload_gb > 0:
            raise ValueError("--enable-lora with --cpu-offload-gb is not supported yet by pagedllm.")

    def graph_settings(self) -> Any:
        """compilation_config as the CUDA graphs the runner captures (compilation_config.GraphSettings)."""
        from pagedllm.compilation_config import parse_compilation_config

        return parse_compilation_config(self.compilation_config)

    def speculative(self) -> Any:
        """The validated spec_decode.config.SpeculativeConfig, or None without speculative decoding."""
        return _speculative(self.speculative_config)


def _speculative(value: Any) -> Any:
    """speculative_config (a dict, a JSON string or None) -> spec_decode.config.SpeculativeConfig or None."""
    from pagedllm.spec_decode.config import SpeculativeConfig

    return SpeculativeConfig.from_user(value)
