"""Loading the tokenizer (a fast, Rust-backed one, unless tokenizer_mode="slow" asks for transformers' Python one).

The model's end-of-sequence ids are read by `worker.read_eos_token_ids` (config + generation_config.json), with the
tokenizer's EOS put first by `core.engine_core.with_tokenizer_eos`, as vLLM takes it.

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


_GGUF_RECORD = "pagedllm_gguf_source.json"  # written into a conversion by models/gguf.py


def _gguf_without_tokenizer(source: str) -> Optional[str]:
    """The .gguf behind `source` (the file, a folder holding only it, or pagedllm's conversion of it) when it has no
    tokenizer metadata, else None. transformers' error then lists files and packages that are not the cause."""
    gguf = _gguf_source(source)
    if gguf is None:
        record = os.path.join(source, _GGUF_RECORD)
        if not os.path.isfile(record):
            return None
        # The converter writes the tokenizer files whenever the file has tokenizer metadata: none here means none.
        import json
        try:
            with open(record) as f:
                return str(json.load(f).get("gguf_path") or source)
        except (OSError, ValueError):
            return None
    path = os.path.join(*gguf)
    try:
        from gguf import GGUFReader
        has_tokenizer = "tokenizer.ggml.model" in GGUFReader(path).fields
    except Exception:  # noqa: BLE001 - not a readable GGUF: transformers' own error says more
        return None
    return None if has_tokenizer else path


# vLLM's tokenizer_mode values. "auto" and "hf" both load the model's Hugging Face tokenizer (vLLM's "auto" picks
# mistral_common only for Mistral's own tokenizer files, which pagedllm does not read); "slow" asks transformers for
# its Python tokenizer (use_fast=False: what it gives where a model has none, as in vLLM).
TOKENIZER_MODES = ("auto", "hf", "slow", "mistral", "custom")


def check_tokenizer_mode(mode: str) -> None:
    """ValueError naming tokenizer_mode when pagedllm cannot load the tokenizer that way."""
    if mode in ("auto", "hf"):
        return
    if mode == "slow":
        version = _transformers_version()
        if int(version.split(".")[0]) >= 5:  # transformers 5 drops use_fast=False: only Rust-backed tokenizers
            raise ValueError(f"tokenizer_mode='slow' needs transformers < 5: transformers {version} has no slow "
                             "(Python) tokenizers and would load the fast one anyway; use tokenizer_mode='auto'.")
        return
    if mode == "mistral":
        raise ValueError("tokenizer_mode='mistral' (mistral_common's tokenizer) is not supported by pagedllm; use "
                         "tokenizer_mode='auto', which loads the model's Hugging Face tokenizer (tokenizer.json).")
    if mode == "custom":
        raise ValueError("tokenizer_mode='custom' (a tokenizer registered with vLLM's TokenizerRegistry) is not "
                         "supported by pagedllm; use tokenizer_mode='auto'.")
    raise ValueError(f"tokenizer_mode must be auto, hf or slow, got {mode!r}.")


def _transformers_version() -> str:
    from importlib.metadata import version

    return version("transformers")


def engine_tokenizer_options(args: Any) -> dict:
    """get_tokenizer's options as the engine arguments (EngineArgs, or the server's namespace) set them; hf_token
    reaches transformers as `token` (a --tokenizer that is a hub repo id is downloaded with it)."""
    options = dict(trust_remote_code=bool(getattr(args, "trust_remote_code", False)),
                   tokenizer_mode=getattr(args, "tokenizer_mode", "auto") or "auto")
    if getattr(args, "hf_token", None) is not None:
        options["token"] = args.hf_token
    # vLLM's tokenizer_revision falls back to revision; transformers ignores it for a local directory.
    revision = getattr(args, "tokenizer_revision", None) or getattr(args, "revision", None)
    if revision is not None:
        options["revision"] = revision
    return options


def engine_tokenizer_source(args: Any, model_dir: str) -> str:
    """Where the engine's tokenizer loads from: --tokenizer, else the model's files (model_dir). A hub model id whose
    tokenizer_revision is not its revision loads its tokenizer from the hub at that revision, as vLLM's tokenizer
    (which defaults to the model id) does: model_dir holds the files of the model's revision."""
    from pagedllm.models.model_resolution import local_path, looks_like_repo_id

    tokenizer, model = getattr(args, "tokenizer", None), getattr(args, "model", None)
    if tokenizer:
        return tokenizer
    wanted = getattr(args, "tokenizer_revision", None)
    if (wanted and wanted != getattr(args, "revision", None) and isinstance(model, str) and local_path(model) is None
            and looks_like_repo_id(model)):
        return model
    return model_dir


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


def get_tokenizer(model_dir_or_name: str, trust_remote_code: bool = False, tokenizer_mode: str = "auto",
                  **kwargs: Any):
    """A transformers fast tokenizer for the model (tokenizer_mode="slow": the Python one where the model has it);
    ValueError saying what to change if there is none."""
    from transformers import AutoTokenizer

    check_tokenizer_mode(tokenizer_mode)
    check_tokenizer_path(model_dir_or_name)
    slow = tokenizer_mode == "slow"
    source = os.path.expanduser(str(model_dir_or_name))
    gguf = _gguf_source(source)
    try:
        if gguf is not None:
            tokenizer = AutoTokenizer.from_pretrained(gguf[0], gguf_file=gguf[1], trust_remote_code=trust_remote_code,
                                                      **(dict(use_fast=False) if slow else {}), **kwargs)
        else:
            tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code,
                                                      use_fast=not slow, **kwargs)
    except (OSError, ValueError, KeyError) as e:  # (KeyError: transformers' GGUF reader, a key it needs missing)
        bare = _gguf_without_tokenizer(source)
        if bare is not None:
            raise ValueError(
                f"Could not load a tokenizer from {model_dir_or_name!r}: the GGUF {bare} holds no tokenizer "
                "(no tokenizer.ggml.* metadata). Pass --tokenizer with the model's tokenizer (a Hugging Face "
                "directory or repo id, or a .gguf that has one), or start with skip_tokenizer_init=True and "
                "prompt with token ids.") from e
        raise ValueError(
            f"Could not load a tokenizer from {model_dir_or_name!r}: {e}. Give a model directory with "
            "tokenizer.json / tokenizer_config.json, a .gguf file, or pass --tokenizer explicitly."
        ) from e
    if not getattr(tokenizer, "is_fast", False) and not slow:  # (the detokenizer reads slow ones too, when asked)
        raise ValueError(
            f"The tokenizer of {model_dir_or_name!r} ({type(tokenizer).__name__}) is not a fast tokenizer; "
            "pagedllm needs one (a tokenizer.json). Convert it with transformers "
            "(AutoTokenizer.from_pretrained(..., from_slow=True).save_pretrained(dir)) and pass --tokenizer dir, or "
            "start with tokenizer_mode='slow' to use it as it is."
        )
    return tokenizer
