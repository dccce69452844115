"""vLLM's compilation_config (`LLM(compilation_config=...)`, `--compilation-config` / `-O`) -> what it means here.

pagedllm runs no torch.compile: its speed comes from its own kernels and, on CUDA, from whole-forward CUDA graphs
of decode steps (worker/cuda_graph.py, in batch-size buckets) and of mixed prefill + decode steps
(worker/mixed_graph.py, in token buckets). So of vLLM's config only what chooses those graphs applies:

  level / mode (an int, or -O N)   0: no compilation, which in vLLM also means no CUDA graphs (vLLM's -O0); graphs
                                   off. 1-3: pagedllm's default (graphs on). vLLM's names of the modes work too.
  cudagraph_mode                   NONE (off), FULL_DECODE_ONLY (decode graphs only), FULL and FULL_AND_PIECEWISE
                                   (both kinds: pagedllm's default; its mixed-step graphs are whole, never
                                   piecewise). PIECEWISE alone is refused: pagedllm has no piecewise graphs.
  use_cudagraph, full_cuda_graph   vLLM's older switches: use_cudagraph false = NONE; full_cuda_graph either way is
                                   the default (pagedllm's graphs are full).
  cudagraph_capture_sizes          the sizes captured: decode batch sizes up to max_num_seqs and mixed-step token
                                   counts (from 2), as vLLM captures its sizes in tokens; larger steps run eagerly.
  max_cudagraph_capture_size       (max_capture_size: its older name) pagedllm's sizes up to this one.

Any other key (torch.compile's backend, passes, custom ops, inductor settings, ...) is refused, naming it: it
would tune a compiler pagedllm does not run. Pure Python: config.py validates with it, the runner reads it.
"""
from __future__ import annotations

import json
import numbers
from dataclasses import dataclass
from typing import Any, Optional

CUDAGRAPH_MODES = ("NONE", "FULL_DECODE_ONLY", "FULL", "FULL_AND_PIECEWISE")
# vLLM's CompilationMode names (and CompilationLevel's older ones) -> the level
_MODE_NAMES = {"NONE": 0, "NO_COMPILATION": 0, "STOCK_TORCH_COMPILE": 1, "DYNAMO_AS_IS": 1,
               "DYNAMO_TRACE_ONCE": 2, "DYNAMO_ONCE": 2, "VLLM_COMPILE": 3, "PIECEWISE": 3}
KEYS = ("level", "mode", "cudagraph_mode", "use_cudagraph", "full_cuda_graph", "cudagraph_capture_sizes",
        "max_cudagraph_capture_size", "max_capture_size")


@dataclass(frozen=True)
class GraphSettings:
    """Which CUDA graphs the runner captures (everything on by default)."""

    decode_graphs: bool = True
    mixed_graphs: bool = True
    capture_sizes: Optional[tuple[int, ...]] = None  # the sizes themselves (decode: requests, mixed: tokens)
    max_capture_size: Optional[int] = None  # pagedllm's own sizes, up to this one

    @property
    def any_graphs(self) -> bool:
        return self.decode_graphs or self.mixed_graphs

    def limit(self, most: int) -> int:
        """The largest size to capture when pagedllm's default sizes run up to `most`."""
        return most if self.max_capture_size is None else min(most, self.max_capture_size)

    def chosen_sizes(self, most: int, smallest: int = 1) -> Optional[list[int]]:
        """The user's sizes within [smallest, most], or None: pagedllm's own (up to limit(most))."""
        if self.capture_sizes is None:
            return None
        return sorted(s for s in set(self.capture_sizes) if smallest <= s <= most)


def parse_compilation_config(value: Any) -> GraphSettings:
    """GraphSettings for vLLM's compilation_config: None, an int level, a dict, or either as JSON text.
    ValueError naming the argument and what pagedllm takes."""
    if value is None:
        return GraphSettings()
    if isinstance(value, str):
        text = value.strip()
        try:
            value = json.loads(text)
        except ValueError:
            raise ValueError(f"compilation_config must be an optimization level (0-3) or a JSON object, got "
                             f"{text!r}.") from None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = {"level": int(value)}
    if not isinstance(value, dict):
        raise ValueError(f"compilation_config must be an optimization level (0-3) or a dict, got "
                         f"{type(value).__name__}.")
    unknown = sorted(str(k) for k in value if k not in KEYS)
    if unknown:
        raise ValueError(f"compilation_config key(s) {', '.join(map(repr, unknown))} are not supported by pagedllm: "
                         f"it runs no torch.compile, and its CUDA graphs take only {', '.join(KEYS)}.")
    decode = mixed = True
    for key in ("level", "mode"):
        if key in value and _level(key, value[key]) == 0:  # vLLM without compilation captures no graphs either
            decode = mixed = False
    if "use_cudagraph" in value:
        decode = mixed = _bool("use_cudagraph", value["use_cudagraph"]) and decode
    if "full_cuda_graph" in value:
        _bool("full_cuda_graph", value["full_cuda_graph"])
    if value.get("cudagraph_mode") is not None:  # an explicit mode wins over the level, as in vLLM
        mode = value["cudagraph_mode"]
        name = mode.strip().upper() if isinstance(mode, str) else mode
        if name == "PIECEWISE":
            raise ValueError("compilation_config cudagraph_mode 'PIECEWISE' is not supported by pagedllm: it captures "
                             "whole-forward CUDA graphs only; use FULL_AND_PIECEWISE or FULL (the default: decode and "
                             "mixed steps), FULL_DECODE_ONLY or NONE.")
        if name not in CUDAGRAPH_MODES:
            raise ValueError(f"compilation_config cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}, got "
                             f"{mode!r}.")
        decode, mixed = name != "NONE", name in ("FULL", "FULL_AND_PIECEWISE")
    sizes = value.get("cudagraph_capture_sizes")
    if sizes is not None:
        if not isinstance(sizes, (list, tuple)) or not all(_positive(s) for s in sizes):
            raise ValueError(f"compilation_config cudagraph_capture_sizes must be a list of positive integers, got "
                             f"{sizes!r}.")
        sizes = tuple(int(s) for s in sizes)
    most = _max_size(value)
    if most is not None and sizes and most != max(sizes):
        raise ValueError(f"compilation_config max_cudagraph_capture_size ({most}) must be the largest of "
                         f"cudagraph_capture_sizes ({max(sizes)}) when both are given.")
    return GraphSettings(decode_graphs=decode, mixed_graphs=mixed, capture_sizes=sizes, max_capture_size=most)


def _level(key: str, v: Any) -> int:
    if isinstance(v, str) and v.strip().upper() in _MODE_NAMES:
        return _MODE_NAMES[v.strip().upper()]
    if isinstance(v, numbers.Integral) and not isinstance(v, bool) and 0 <= v <= 3:
        return int(v)
    raise ValueError(f"compilation_config {key} must be 0-3 (or one of {', '.join(_MODE_NAMES)}), got {v!r}.")


def _bool(key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"compilation_config {key} must be true or false, got {v!r}.")
    return v


def _positive(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 1


def _max_size(value: dict) -> Optional[int]:
    given = [(k, value[k]) for k in ("max_cudagraph_capture_size", "max_capture_size") if value.get(k) is not None]
    if not given:
        return None
    for key, v in given:
        if not _positive(v):
            raise ValueError(f"compilation_config {key} must be a positive integer, got {v!r}.")
    if len({int(v) for _, v in given}) > 1:
        raise ValueError("compilation_config max_cudagraph_capture_size and max_capture_size (its older name) differ; "
                         "give one.")
    return int(given[0][1])
