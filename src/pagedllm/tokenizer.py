"""Loading the tokenizer (always a fast, Rust-backed one) and reading the model's end-of-sequence ids.

Accepted sources: an HF model directory, a `.gguf` file (the tokenizer is read from its metadata),
a directory holding only a `.gguf` file, or a hub name already in the local cache.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional


def _gguf_source(path: str) -> Optional[tuple[str, str]]:
    """(folder, gguf file name) when path is a GGUF file or a folder with one GGUF and no tokenizer files."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        return os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    if os.path.isdir(path):
        names = os.listdir(path)
        if any(n in names for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            return None
        ggufs = sorted(n for n in names if n.endswith(".gguf"))
        if len(ggufs) == 1:
            return path, ggufs[0]
    return None


def get_tokenizer(model_dir_or_name: str, trust_remote_code: bool = False, **kwargs: Any):
    """A transformers fast tokenizer for the model; ValueError saying what to change if there is none."""
    from transformers import AutoTokenizer

    source = os.path.expanduser(str(model_dir_or_name))
    gguf = _gguf_source(source)
    try:
        if gguf is not None:
            tokenizer = AutoTokenizer.from_pretrained(gguf[0], gguf_file=gguf[1],
                                                      trust_remote_code=trust_remote_code, **kwargs)
        else:
            tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code,
                                                      use_fast=True, **kwargs)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"Could not load a tokenizer from {model_dir_or_name!r}: {e}. Give a model directory with "
            "tokenizer.json / tokenizer_config.json, a .gguf file, or pass --tokenizer explicitly."
        ) from e
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"The tokenizer of {model_dir_or_name!r} ({type(tokenizer).__name__}) is not a fast tokenizer; "
            "pagedllm needs one (a tokenizer.json). Convert it with transformers "
            "(AutoTokenizer.from_pretrained(..., from_slow=True).save_pretrained(dir)) and pass --tokenizer dir."
        )
    return tokenizer


def _generation_config_path(model_dir: Optional[str]) -> Optional[str]:
    if not model_dir:
        return None
    model_dir = os.path.expanduser(str(model_dir))
    if os.path.isfile(model_dir):
        model_dir = os.path.dirname(os.path.abspath(model_dir))
    if os.path.isdir(model_dir):
        path = os.path.join(model_dir, "generation_config.json")
        return path if os.path.isfile(path) else None
    try:  # a hub name: only look in the local cache, never go to the network
        from huggingface_hub import try_to_load_from_cache

        path = try_to_load_from_cache(model_dir, "generation_config.json")
        return path if isinstance(path, str) else None
    except Exception:
        return None


def eos_token_ids(tokenizer: Any, model_dir: Optional[str] = None) -> list[int]:
    """The tokenizer's EOS id, then generation_config.json's eos_token_id (int or list); no duplicates."""
    ids: list[int] = []

    def add(value: Any) -> None:
        if value is None:
            return
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and v >= 0 and v not in ids:
                ids.append(v)

    if tokenizer is not None:
        add(getattr(tokenizer, "eos_token_id", None))
    path = _generation_config_path(model_dir)
    if path is not None:
        try:
            with open(path) as f:
                add(json.load(f).get("eos_token_id"))
        except (OSError, ValueError):
            pass
    return ids
