"""`--generation-config auto|vllm|DIR`: sampling defaults from a model's generation_config.json, as vLLM takes them.

`auto` (the default) reads the model directory's file, a DIR reads DIR/generation_config.json, `vllm` uses none.
Only the values the file sets are taken, and they apply only to fields a request leaves out: temperature, top_p,
top_k, min_p, repetition_penalty, and max_new_tokens (as max_tokens). Pure Python.

A GGUF carries no sampling values, so the GGUF converter (models/gguf.py) writes the ones a known model's authors
recommend (`recommended_sampling`, matched on the identity the GGUF states) into the converted directory's file,
with `SOURCE_KEY` saying where they come from; `auto` then reads them like any other model's.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

logger = logging.getLogger("pagedllm")

# generation_config.json key -> SamplingParams field
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


# Written next to the values by the GGUF converter: where recommended defaults come from (for the start log).
SOURCE_KEY = "pagedllm_sampling_defaults_source"


@dataclass(frozen=True)
class KnownModelDefaults:
    organization: str  # GGUF general.organization, compared case-insensitively
    basename: str  # GGUF general.basename, compared case-insensitively
    values: dict  # generation_config.json keys
    source: str  # where the authors say so


# Models whose authors recommend sampling values that their own generation_config.json does not carry. Only
# instruct-tuned files match (a base model has no chat recipe to follow).
KNOWN_MODEL_DEFAULTS = (
    # HuggingFaceTB/SmolLM2-{135M,360M,1.7B}-Instruct: the model cards' "How to use" generates with
    # `temperature=0.2, top_p=0.9, do_sample=True`; their generation_config.json holds only bos/eos/pad ids, so
    # without this the bundled default model samples at temperature 1.0 (and answers in a mix of languages).
    KnownModelDefaults("HuggingFaceTB", "SmolLM2", {"temperature": 0.2, "top_p": 0.9},
                       "the SmolLM2-Instruct model card (HuggingFaceTB)"),
)


def recommended_sampling(organization: Optional[str], basename: Optional[str], name: Optional[str] = None,
                         finetune: Optional[str] = None) -> Optional[KnownModelDefaults]:
    """The known recommendation for a model of this identity (GGUF general.* fields), or None. Instruct-tuned:
    a finetune named, or "instruct" in the name."""
    instruct = bool(finetune) or "instruct" in (name or "").lower()
    for known in KNOWN_MODEL_DEFAULTS:
        if (instruct and (organization or "").lower() == known.organization.lower()
                and (basename or "").lower() == known.basename.lower()):
            return known
    return None


def check_generation_override(override: Any) -> dict[str, Any]:
    """vLLM's --override-generation-config: generation_config.json keys this engine reads (FIELDS), each a number;
    ValueError names anything else (refused, not ignored)."""
    if not isinstance(override, dict):
        raise ValueError(f"override_generation_config must be a JSON object, got {override!r}.")
    unknown = sorted(set(override) - set(FIELDS))
    if unknown:
        raise ValueError(f"override_generation_config takes {', '.join(FIELDS)}; {unknown} is not supported.")
    for key, value in override.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"override_generation_config's {key} must be a number, got {value!r}.")
        if value is not None:  # a value no request could run with is refused at start, not on every request
            from pagedllm.sampling_params import SamplingParams

            try:
                SamplingParams(**{FIELDS[key]: value})
            except ValueError as e:
                raise ValueError(f"override_generation_config's {key}: {e}") from None
    return dict(override)


def load_sampling_defaults(mode: str, model_dir: str, override: Optional[dict] = None) -> dict[str, Any]:
    """The sampling defaults `mode` gives for the model in `model_dir` ({} when none), with `override` (vLLM's
    --override-generation-config, generation_config.json keys) on top; ValueError if `mode` names a directory
    without the file or the file is not valid JSON."""
    defaults = _file_defaults(mode, model_dir)
    for theirs, value in (override or {}).items():
        if value is None:
            defaults.pop(FIELDS[theirs], None)
        else:
            defaults[FIELDS[theirs]] = value
    return defaults


def _file_defaults(mode: str, model_dir: str) -> dict[str, Any]:
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


def sampling_defaults_source(mode: str, model_dir: str) -> Optional[str]:
    """Where the defaults of `auto` come from when the GGUF converter wrote a known model's recommendation."""
    if mode != "auto":
        return None
    try:
        with open(os.path.join(model_dir, "generation_config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None
    return raw.get(SOURCE_KEY) if isinstance(raw, dict) else None


def log_sampling_defaults(defaults: dict[str, Any], mode: str, model_dir: Optional[str] = None,
                          override: Optional[dict] = None) -> None:
    source = sampling_defaults_source(mode, model_dir) if model_dir else None
    if override:
        logger.info("Sampling defaults (used where a request does not set them) with --override-generation-config "
                    "%s: %s", override, defaults)
    elif defaults:
        logger.info("Sampling defaults from the model's generation config%s (used where a request does not set "
                    "them; --generation-config vllm turns them off): %s",
                    f", as recommended by {source}" if source else "", defaults)
    else:
        logger.info("No sampling defaults from a generation config (--generation-config %s).", mode)
