"""The only module of pagedllm that reads or writes environment variables.

Every variable is read lazily on attribute access (`envs.PAGEDLLM_CACHE_DIR`), so tests can set them with
`monkeypatch.setenv` after import. Add a new variable by adding one entry to `_ENV_READERS`. Besides pagedllm's
own (PAGEDLLM_*, the vLLM names it honours), the entries read what other programs set and pagedllm must follow:
Hugging Face's offline switches and token, torchrun's rendezvous, CUDA_VISIBLE_DEVICES (data-parallel replicas
split it), TRITON_INTERPRET (Triton's interpreter cannot run inline PTX), PATH (the C++ kernels' build runs
ninja from it) and the user's OpenMP choice (OMP_WAIT_POLICY / GOMP_SPINCOUNT).

pagedllm never leaves a variable of its own in the user's os.environ, so the programs a user starts get their
environment as the user made it. The variables pagedllm's own runtime wants (`own_runtime_env`: OpenMP threads
that spin briefly, then sleep, between parallel regions) go explicitly to the processes it starts (`child_env`,
`child_vars`), and to the OpenMP runtime of this process while it loads (pagedllm/openmp.py). `environ_set` sets variables for one
block and restores them, for a library that takes the environment only from os.environ at one moment
(multiprocessing's spawn at start(), libgomp when loaded, torch's extension build).

Libraries read their own variables themselves: huggingface_hub HF_HOME, HF_HUB_CACHE and HF_ENDPOINT (at its
import, through `huggingface_hub.constants`), torch CUDA_VISIBLE_DEVICES and the OMP_* thread settings, libgomp
OMP_WAIT_POLICY.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator, Mapping, Optional


def _cache_dir() -> str:
    default = os.path.join(os.path.expanduser("~"), ".cache", "pagedllm")
    return os.path.abspath(os.path.expanduser(os.environ.get("PAGEDLLM_CACHE_DIR", default)))


def _optional_str(name: str) -> Callable[[], Optional[str]]:
    return lambda: os.environ.get(name) or None


def _truthy(value: Optional[str]) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _int(name: str, default: int) -> Callable[[], int]:
    def read() -> int:
        text = os.environ.get(name)
        if text is None or not text.strip():
            return default
        try:
            return int(text)
        except ValueError:  # (int()'s own message does not say which variable held the text)
            raise ValueError(f"{name}={text!r}: expected an integer.") from None
    return read


def _seconds(name: str, default: float) -> Callable[[], float]:
    def read() -> float:
        text = os.environ.get(name)
        if text is None or not text.strip():
            return default
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not value > 0:  # (nan and <= 0 too: a timeout that fires at once or never)
            raise ValueError(f"{name}={text!r}: expected a positive number of seconds.")
        return value
    return read


def _own_or_vllm(suffix: str) -> tuple[str, Optional[str]]:
    """(the variable that sets it, its value): PAGEDLLM_<suffix> where set (non-empty), else vLLM's VLLM_<suffix>."""
    for name in (f"PAGEDLLM_{suffix}", f"VLLM_{suffix}"):
        if os.environ.get(name):
            return name, os.environ[name]
    return f"VLLM_{suffix}", None


def _logging_level() -> str:
    name, text = _own_or_vllm("LOGGING_LEVEL")
    level = (text or "INFO").strip().upper()
    if level not in ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG"):
        raise ValueError(f"{name}={level!r} is not a logging level; use one of CRITICAL, ERROR, WARNING, INFO, DEBUG.")
    return level


def _keep_alive_s() -> float:
    name, text = _own_or_vllm("HTTP_TIMEOUT_KEEP_ALIVE")
    text = text or "5"
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{name}={text!r}: expected a positive number of seconds.")
    return value


def _choice(name: str, default: str, choices: tuple) -> str:
    value = os.environ.get(name, default).strip().lower()
    if value not in choices:
        raise ValueError(f"{name}={os.environ.get(name)!r}: expected one of {', '.join(choices)}.")
    return value


_ENV_READERS: dict[str, Callable[[], Any]] = {
    # Where converted GGUF models (and other derived artifacts) are cached.
    "PAGEDLLM_CACHE_DIR": _cache_dir,
    # Root logging level for the `pagedllm` logger (DEBUG, INFO, WARNING, ...; vLLM's VLLM_LOGGING_LEVEL too): the
    # offline LLM's level and the server's --log-level default.
    "PAGEDLLM_LOGGING_LEVEL": lambda: _logging_level(),
    # Where LLM.start_profile() / stop_profile() write torch profiler traces (vLLM's VLLM_TORCH_PROFILER_DIR too);
    # unset: profiling is off and start_profile() says so.
    "PAGEDLLM_TORCH_PROFILER_DIR": lambda: _own_or_vllm("TORCH_PROFILER_DIR")[1],
    # Seed for dummy (random) weights: `load_format="dummy"`.
    "PAGEDLLM_DUMMY_WEIGHT_SEED": _int("PAGEDLLM_DUMMY_WEIGHT_SEED", 1234),
    # Set to 1 to hide tqdm progress bars (weight loading, GGUF conversion).
    "PAGEDLLM_DISABLE_PROGRESS_BARS": lambda: os.environ.get("PAGEDLLM_DISABLE_PROGRESS_BARS", "0") == "1",
    # Set to 0 to run the layers' plain-torch paths on CUDA instead of the Triton kernels (debugging).
    "PAGEDLLM_USE_TRITON_KERNELS": lambda: os.environ.get("PAGEDLLM_USE_TRITON_KERNELS", "1") != "0",
    # Where the C++ CPU kernels are built (default: $PAGEDLLM_CACHE_DIR/cpu_kernels).
    "PAGEDLLM_KERNEL_CACHE_DIR": lambda: os.path.abspath(os.path.expanduser(
        os.environ.get("PAGEDLLM_KERNEL_CACHE_DIR") or os.path.join(_cache_dir(), "cpu_kernels"))),
    # "0": never build or use the C++ CPU kernels (kernels/csrc/cpu_ops.cpp); the plain-torch CPU path runs.
    "PAGEDLLM_CPU_KERNELS": lambda: os.environ.get("PAGEDLLM_CPU_KERNELS", "1") != "0",
    # "0": CPU decode steps of GGUF-packed models run layer by layer from Python instead of one C++ call
    # (models/cpu_decode.py; A/B benchmarks, debugging).
    "PAGEDLLM_CPU_FUSED_DECODE": lambda: os.environ.get("PAGEDLLM_CPU_FUSED_DECODE", "1") != "0",
    # "0": GGUF weights kept packed stay in the file's row layout instead of the layout this CPU's kernels read
    # fastest (16-row tiles on AVX-512 VNNI; on AVX2 the row layout of Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K;
    # kernels/csrc/gguf_ops.cpp; A/B benchmarks).
    "PAGEDLLM_GGUF_TILED": lambda: os.environ.get("PAGEDLLM_GGUF_TILED", "1") != "0",
    # "0": keep GGUF Q5_0 linear layers as Q5_0 on AVX2 machines without VNNI (A/B benchmarks; default: widened
    # to Q8_0 at load, kernels/gguf_ops.py widen_packed).
    "PAGEDLLM_GGUF_WIDEN_Q5_0": lambda: os.environ.get("PAGEDLLM_GGUF_WIDEN_Q5_0", "1") != "0",
    # "0": with async scheduling, n-gram verify steps wait for the previous step (the host proposes the drafts)
    # instead of overlapping it with device-side drafts (spec_decode/device_ngram.py; A/B benchmarks, debugging).
    "PAGEDLLM_SPEC_OVERLAP": lambda: os.environ.get("PAGEDLLM_SPEC_OVERLAP", "1") != "0",
    # "0": host-to-device step inputs from pageable memory (only for A/B benchmarks of the pinned path).
    "PAGEDLLM_PINNED_STAGING": lambda: os.environ.get("PAGEDLLM_PINNED_STAGING", "1") != "0",
    # "0": eager Triton kernels launch through Triton's own per-call binding instead of their compiled launcher
    # (kernels/triton_launch.py; the A/B of its host time, and a way around a Triton whose launcher differs).
    "PAGEDLLM_TRITON_DIRECT_LAUNCH": lambda: os.environ.get("PAGEDLLM_TRITON_DIRECT_LAUNCH", "1") != "0",
    # "0": greedy decode steps of few rows run the LM head and the argmax eagerly after the decode graph instead of
    # replaying them as a graph (worker/cuda_graph.py, "greedy tails"; the A/B of the host time they save).
    "PAGEDLLM_GRAPH_GREEDY": lambda: os.environ.get("PAGEDLLM_GRAPH_GREEDY", "1") != "0",
    # "0": sampled decode steps of few rows run the LM head and the device sampler eagerly instead of replaying them
    # as a graph after the decode graph (worker/greedy_tail.py, SampleTails; the A/B of the host time they save).
    "PAGEDLLM_GRAPH_SAMPLE": lambda: os.environ.get("PAGEDLLM_GRAPH_SAMPLE", "1") != "0",
    # Most split-KV partitions per (request, kv head) in the CUDA decode kernel (tuning; a power of two).
    "PAGEDLLM_DECODE_MAX_SPLITS": _int("PAGEDLLM_DECODE_MAX_SPLITS", 64),
    # "0": on CUDA, run q/k norm, rotary and the KV-cache write as separate kernels instead of the fused one
    # (A/B benchmarks, debugging).
    "PAGEDLLM_FUSED_QKV": lambda: os.environ.get("PAGEDLLM_FUSED_QKV", "1") != "0",
    # Whether decode steps on CUDA (16-bit caches) let the decode attention kernel do qkv_prep's work itself (q / k
    # norm, rope, the KV write: kernels/paged_attention.DecodePrep) rather than launch qkv_prep first: "auto" for
    # steps of up to DECODE_PREP_MAX_REQS requests (where one launch less pays), "1" for every decode step (tests,
    # A/Bs), "0" never.
    "PAGEDLLM_DECODE_PREP": lambda: _choice("PAGEDLLM_DECODE_PREP", "auto", ("auto", "1", "0")),
    # Mixed prefill + decode steps of up to this many tokens replay CUDA graphs (worker/mixed_graph.py); 0: eager.
    "PAGEDLLM_MIXED_GRAPH_MAX_TOKENS": _int("PAGEDLLM_MIXED_GRAPH_MAX_TOKENS", 4096),
    # Mixed-step graphs with this one query tile (rows per attention program) instead of the per-step choice.
    "PAGEDLLM_MIXED_GRAPH_TILE": _int("PAGEDLLM_MIXED_GRAPH_TILE", 0),
    # "0": steps whose requests have few query tokens each (speculative verify rows) run the prefill attention kernel
    # instead of the split-KV few-query kernel (kernels/paged_attention.paged_few_query_attention; A/B).
    "PAGEDLLM_FEW_QUERY_ATTENTION": lambda: os.environ.get("PAGEDLLM_FEW_QUERY_ATTENTION", "1") != "0",
    # "0": the CUDA decode kernel takes requests in batch order instead of longest context first (A/B).
    "PAGEDLLM_DECODE_LPT": lambda: os.environ.get("PAGEDLLM_DECODE_LPT", "1") != "0",
    # "0": launch the Triton kernels without programmatic dependent launch (kernels/pdl.py; A/B, debugging).
    "PAGEDLLM_PDL": lambda: os.environ.get("PAGEDLLM_PDL", "1") != "0",
    # "0": PDL kernels do not let the next kernel launch before they finish (A/B of the early trigger, pdl.py).
    "PAGEDLLM_PDL_TRIGGER": lambda: os.environ.get("PAGEDLLM_PDL_TRIGGER", "1") != "0",
    # Most rows (tokens) for which CUDA fp16/bf16 linear layers use the Triton GEMV (kernels/gemv.py) instead of
    # cuBLAS; 0 turns it off.
    "PAGEDLLM_GEMV_MAX_ROWS": _int("PAGEDLLM_GEMV_MAX_ROWS", 4),
    # "0": on CUDA, an RMSNorm that feeds one unquantized linear layer alone runs its own kernel at one-row decode
    # steps instead of inside that layer's Triton GEMV (kernels/gemv.GemvNorm: one launch less per norm; A/B).
    "PAGEDLLM_NORM_GEMV": lambda: os.environ.get("PAGEDLLM_NORM_GEMV", "1") != "0",
    # Steps of 2 up to this many rows (at most 32) run CUDA fp16/bf16 linear layers on the tensor-core GEMV
    # (kernels/gemv_mma.py) instead of the Triton GEMV / cuBLAS; 0: off. 16: past it (four row tiles) cuBLAS wins
    # on 8B shapes (docs/benchmarks.md, "The tensor-core few-row GEMV").
    "PAGEDLLM_GEMV_MMA_MAX_ROWS": _int("PAGEDLLM_GEMV_MMA_MAX_ROWS", 16),
    # "0": on GPUs a request that continues a finished one's last partial block (beam forks, core/partial_blocks.py)
    # recomputes it instead of copying it (A/B benchmarks). CPU engines always copy.
    "PAGEDLLM_PARTIAL_BLOCK_COPIES": lambda: os.environ.get("PAGEDLLM_PARTIAL_BLOCK_COPIES", "1") != "0",
    # "0": CUDA FP8 activations are quantized by the torch ops instead of kernels/quant_act.py's one kernel (A/B).
    "PAGEDLLM_FUSED_ACT_QUANT": lambda: os.environ.get("PAGEDLLM_FUSED_ACT_QUANT", "1") != "0",
    # Model hubs (models/model_resolution.py): repo ids go through ModelScope instead of Hugging Face when either
    # is true; Hugging Face's offline switches (the local cache only) and token.
    "PAGEDLLM_USE_MODELSCOPE": lambda: _truthy(os.environ.get("PAGEDLLM_USE_MODELSCOPE")),
    "VLLM_USE_MODELSCOPE": lambda: _truthy(os.environ.get("VLLM_USE_MODELSCOPE")),
    "HF_HUB_OFFLINE": lambda: _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(
        os.environ.get("TRANSFORMERS_OFFLINE")),
    "HF_TOKEN": _optional_str("HF_TOKEN"),
    # Not pagedllm's: the GPUs this process may use (data-parallel replicas each get a slice of it).
    "CUDA_VISIBLE_DEVICES": _optional_str("CUDA_VISIBLE_DEVICES"),
    # Not pagedllm's: "1" runs Triton kernels in its interpreter (no inline PTX there).
    "TRITON_INTERPRET": lambda: os.environ.get("TRITON_INTERPRET", "0") == "1",
    # Not pagedllm's: where executables are found (the C++ kernels' build runs ninja).
    "PATH": lambda: os.environ.get("PATH", ""),
    # Not pagedllm's: set when the user chose an OpenMP wait policy, which pagedllm then leaves alone.
    "OMP_WAIT_POLICY": _optional_str("OMP_WAIT_POLICY"),
    "GOMP_SPINCOUNT": _optional_str("GOMP_SPINCOUNT"),
    # Not pagedllm's: the key `pagedllm bench serve` sends without --api-key (as vLLM's bench serve and the openai
    # client take it).
    "OPENAI_API_KEY": _optional_str("OPENAI_API_KEY"),
    # Seconds an idle HTTP keep-alive connection stays open (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE too; default 5).
    "PAGEDLLM_HTTP_TIMEOUT_KEEP_ALIVE": lambda: _keep_alive_s(),
    # Default of `pagedllm serve --api-key` (so a key can come from a secret instead of the command line); vLLM's
    # VLLM_API_KEY too: a deployment moved from vLLM must not come up without its key.
    "PAGEDLLM_API_KEY": lambda: _own_or_vllm("API_KEY")[1],
    # Seconds a collective may wait before the ranks give up (a peer died or hangs): the engine then stops.
    "PAGEDLLM_DIST_TIMEOUT_S": _seconds("PAGEDLLM_DIST_TIMEOUT_S", 300.0),
    # Seconds the head waits at start for every rank (of every node) to join.
    "PAGEDLLM_NODE_JOIN_TIMEOUT_S": _seconds("PAGEDLLM_NODE_JOIN_TIMEOUT_S", 300.0),
    # "1"/"true": a max_model_len past the model's context (worker.model_max_len) is allowed (with a warning) instead of
    # refused, as vLLM's variable allows it; outputs past the trained context may be wrong.
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN": lambda: _truthy(os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN"))
    or _truthy(os.environ.get("PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN")),
    # "1"/"true": POST /v1/load_lora_adapter and /v1/unload_lora_adapter are served (vLLM's variable works too).
    "PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING": lambda: _truthy(os.environ.get("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING"))
    or _truthy(os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")),
    # "1"/"true": the development routes are served: POST /sleep, /wake_up, /reset_prefix_cache, GET /is_sleeping
    # (vLLM's VLLM_SERVER_DEV_MODE works too); otherwise they answer 404.
    "PAGEDLLM_SERVER_DEV_MODE": lambda: _truthy(os.environ.get("PAGEDLLM_SERVER_DEV_MODE"))
    or _truthy(os.environ.get("VLLM_SERVER_DEV_MODE")),
    # torch.distributed rendezvous, as torchrun sets them (read by distributed/parallel_state.py).
    "MASTER_ADDR": _optional_str("MASTER_ADDR"),
    "MASTER_PORT": _optional_str("MASTER_PORT"),
    "LOCAL_RANK": _int("LOCAL_RANK", 0),
    # 4/8-bit weight-only layers on CUDA are repacked at load into the mma layout (kernels/qgemv_mma.py) or the tiled
    # one (kernels/qgemv.py, qgemm.py) (quantization/tiled.py); "0" keeps the general dequant kernel
    # (kernels/dequant_gemm.py) over the load-time layout for every layer (A/B benchmarks).
    "PAGEDLLM_QUANT_TILED": lambda: os.environ.get("PAGEDLLM_QUANT_TILED", "1") != "0",
    # Most rows for which tiled 4/8-bit layers use the CUDA-core GEMV (kernels/qgemv.py, at most 8); more rows
    # take the tensor-core kernel (kernels/qgemm.py).
    "PAGEDLLM_QUANT_GEMV_MAX_ROWS": _int("PAGEDLLM_QUANT_GEMV_MAX_ROWS", 2),
    # FP8 KV cache: per-layer k/v scales (layers/kv_cache_scales.py), the checkpoint's or, without them,
    # calibrated on the first step; "0": scales 1.0 (A/B).
    "PAGEDLLM_KV_SCALES": lambda: os.environ.get("PAGEDLLM_KV_SCALES", "1") != "0",
}


# libgomp's spin iterations before a waiting OpenMP thread sleeps (~0.25 ms here): long enough to bridge the gaps
# between a decode step's parallel regions, short enough that a thread whose sibling was preempted yields soon.
OWN_SPIN_COUNT = "10000"


def own_runtime_env() -> dict[str, str]:
    """What pagedllm's own runtime wants in its environment: GOMP_SPINCOUNT=OWN_SPIN_COUNT unless the user chose a
    policy (OMP_WAIT_POLICY or GOMP_SPINCOUNT set). libgomp's default spin (300,000 iterations) burns the time
    slice a preempted sibling needs, so every parallel region stalls on a busy machine; sleeping at once
    (PASSIVE) pays a wake-up per region on an idle one (docs/benchmarks.md, "The OpenMP wait policy"). Other
    programs, llama.cpp for one, have their own defaults, so it never goes into os.environ."""
    if _ENV_READERS["OMP_WAIT_POLICY"]() is not None or _ENV_READERS["GOMP_SPINCOUNT"]() is not None:
        return {}
    return {"GOMP_SPINCOUNT": OWN_SPIN_COUNT}


def child_vars(**defaults: str) -> dict[str, str]:
    """The variables a process that pagedllm starts gets on top of this one's environment: own_runtime_env()
    and `defaults`, each where this environment does not set it already."""
    return {k: v for k, v in {**own_runtime_env(), **defaults}.items() if k not in os.environ}


def child_env(**defaults: str) -> dict[str, str]:
    """The whole environment (an `env=` argument) of a process that pagedllm starts: this process's plus
    child_vars(**defaults)."""
    return {**os.environ, **child_vars(**defaults)}


@contextlib.contextmanager
def environ_set(values: Mapping[str, Optional[str]]) -> Iterator[None]:
    """os.environ with `values` (None: unset) for the block, then as it was. Only for a library that takes its
    environment from os.environ at one moment instead of an `env` argument; keep the block to that moment, as
    another thread starting a process meanwhile would see the values too."""
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            _put(k, v)
        yield
    finally:
        for k, v in old.items():
            _put(k, v)


def _put(name: str, value: Optional[str]) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def __getattr__(name: str) -> Any:
    if name in _ENV_READERS:
        return _ENV_READERS[name]()
    raise AttributeError(f"module 'pagedllm.envs' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(_ENV_READERS)
