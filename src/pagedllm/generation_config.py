"""`--generation-config auto|vllm|DIR`: sampling defaults from a model's generation_config.json, as vLLM takes them.

`auto` (the default) reads the model directory's file, a DIR reads DIR/generation_config.json, `vllm` uses none.
Only the values the file sets are taken, and they apply only to fields a request leaves out: temperature, top_p,
top_k, min_p, repetition_penalty, and max_new_tokens (as max_tokens). Pure Python.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger("pagedllm")

# generation_config.json key -> SamplingParams field
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def load_sampling_defaults(mode: str, model_dir: str) -> dict[str, Any]:
    """The sampling defaults `mode` gives for the model in `model_dir` ({} when none); ValueError if `mode` names
    a directory without the file or the file is not valid JSON."""
    if mode == "vllm":
        return {}
    folder = model_dir if mode == "auto" else os.path.expanduser(mode)
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        if mode == "auto":
            return {}
        raise ValueError(f"--generation-config {mode}: no generation_config.json there; give auto, vllm or a "
                         "directory holding generation_config.json.")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}).") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object.")
    return {ours: raw[theirs] for theirs, ours in FIELDS.items() if raw.get(theirs) is not None}


def log_sampling_defaults(defaults: dict[str, Any], mode: str) -> None:
    if defaults:
        logger.info("Sampling defaults from the model's generation config (used where a request does not set "
                    "them; --generation-config vllm turns them off): %s", defaults)
    else:
        logger.info("No sampling defaults from a generation config (--generation-config %s).", mode)
