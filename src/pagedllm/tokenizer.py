"""Loading the tokenizer (always a fast, Rust-backed one).

The model's end-of-sequence ids are read by `worker.read_eos_token_ids` (config + generation_config.json).

Accepted sources: an HF model directory, a `.gguf` file (the tokenizer is read from its metadata),
a directory holding only a `.gguf` file, or a hub name already in the local cache.
"""
from __future__ import annotations

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


def check_tokenizer_path(name: str) -> None:
    """ValueError when `name` (--tokenizer) is a path that cannot hold a tokenizer: checked at start, before the
    engine loads the model. A missing path that is no hub repo id either would otherwise reach transformers, which
    says "Repo id must be in the form ..." about what is a typo'd path."""
    source = os.path.expanduser(str(name))
    if not os.path.exists(source) and (os.path.isabs(source) or source.startswith(".") or source.count("/") > 1):
        raise ValueError(f"Could not load a tokenizer: the path {name!r} does not exist; pass a model directory "
                         "with tokenizer.json / tokenizer_config.json, a .gguf file, or a Hugging Face repo id.")
    if os.path.isfile(source) and not source.endswith(".gguf"):
        raise ValueError(f"Could not load a tokenizer: the path {name!r} is a file but not a .gguf file; pass the "
                         "model directory that holds tokenizer.json / tokenizer_config.json, or a .gguf file.")


def get_tokenizer(model_dir_or_name: str, trust_remote_code: bool = False, **kwargs: Any):
    """A transformers fast tokenizer for the model; ValueError saying what to change if there is none."""
    from transformers import AutoTokenizer

    check_tokenizer_path(model_dir_or_name)
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
