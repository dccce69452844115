"""A LoRA adapter's lora_path -> its local directory, as vLLM's get_adapter_absolute_path: an existing path (or one
that is plainly a path: absolute, "./", "~") as is, user-expanded; otherwise a Hugging Face hub repo id, fetched
with huggingface_hub's snapshot_download (adapter files only) into the hub cache. HF_HUB_OFFLINE (or
TRANSFORMERS_OFFLINE) uses the cache only; HF_TOKEN reaches private repos; where the cache is (HF_HUB_CACHE /
HF_HOME) huggingface_hub reads itself. Each repo id is resolved once per process (load_inplace asks again), so the
engine, which may read the adapter again after evicting it, only ever sees a local directory.

Errors are LoRAError (a ValueError): LoRANotFoundError when the repo (or revision) is not found or, offline, not
cached; the server answers them 404 / 400.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Optional

from pagedllm import envs
from pagedllm.lora.peft import LoRAError

logger = logging.getLogger(__name__)

# What the engine reads of an adapter (lora/peft.py); a repo's README, checkpoints or tokenizer are not fetched.
ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"]

_resolved: dict[tuple[str, Optional[str]], str] = {}
_locks: dict[tuple[str, Optional[str]], threading.Lock] = {}
_guard = threading.Lock()


class LoRANotFoundError(LoRAError):
    """The adapter is neither a local directory nor a repo (or revision) the hub or the offline cache has."""


def _is_local(path: str) -> bool:
    from pagedllm.models.model_resolution import looks_like_repo_id

    if os.path.exists(path) or os.path.isabs(path) or path.startswith((".", "~")):
        return True
    # "org/name" or "name": a hub id; more segments (or odd characters) are a local path that does not exist
    return not looks_like_repo_id(path) or path.count("/") > 1


def resolve_lora_path(path: str, revision: Optional[str] = None, refresh: bool = False) -> str:
    """The local directory of adapter `path` (a directory, or a hub repo id downloaded when allowed).
    refresh: ask the hub again (load_inplace: new weights may have been pushed)."""
    if not isinstance(path, str) or not path:
        return path
    expanded = os.path.expanduser(path)
    if _is_local(expanded):
        return expanded  # a missing or broken one is refused by read_adapter_config with the reason
    key = (path, revision)
    with _guard:
        lock = _locks.setdefault(key, threading.Lock())
    with lock:  # two loads of one repo at once download it once
        if not refresh and key in _resolved:
            return _resolved[key]
        local = _download(path, revision)
        _resolved[key] = local
        return local


def _download(repo_id: str, revision: Optional[str]) -> str:
    from huggingface_hub import constants, errors, snapshot_download
    from huggingface_hub.utils import disable_progress_bars

    at = f" at revision {revision!r}" if revision else ""
    where = constants.HF_HUB_CACHE
    kwargs = dict(repo_id=repo_id, revision=revision, allow_patterns=ADAPTER_FILES, token=envs.HF_TOKEN)
    if envs.HF_HUB_OFFLINE:
        try:
            local = snapshot_download(local_files_only=True, **kwargs)
        except (errors.LocalEntryNotFoundError, OSError, ValueError):
            raise LoRANotFoundError(
                f"LoRA adapter {repo_id!r}{at} is not a local directory nor in the local Hugging Face cache "
                f"({where}), and HF_HUB_OFFLINE is set: download it first (unset HF_HUB_OFFLINE), or give a local "
                "path.") from None
    else:
        if envs.PAGEDLLM_DISABLE_PROGRESS_BARS:
            disable_progress_bars()
        logger.info("Resolving LoRA adapter %s%s on the Hugging Face Hub (cache: %s).", repo_id, at, where)
        try:
            local = snapshot_download(**kwargs)
        except errors.GatedRepoError:
            raise LoRAError(f"LoRA adapter {repo_id!r} is gated on the Hugging Face Hub: accept its terms on its "
                            "page and set HF_TOKEN to a token of that account.") from None
        except errors.RepositoryNotFoundError:
            raise LoRANotFoundError(f"LoRA adapter {repo_id!r} is not a local directory nor a repo on the Hugging "
                                    "Face Hub; if it is private, set HF_TOKEN.") from None
        except errors.RevisionNotFoundError:
            raise LoRANotFoundError(f"LoRA adapter {repo_id!r} has no revision {revision!r} on the Hugging Face "
                                    "Hub.") from None
        except (errors.LocalEntryNotFoundError, OSError) as e:  # HfHubHTTPError is an OSError too
            from pagedllm.models.model_resolution import first_line

            raise LoRANotFoundError(
                f"Could not download LoRA adapter {repo_id!r}{at} from the Hugging Face Hub, and it is not in the "
                f"local cache ({where}): {type(e).__name__}: {first_line(e)}; check the network and HF_ENDPOINT, or give a "
                "local path.") from None
        except ValueError as e:  # an invalid repo id or revision (HFValidationError)
            raise LoRANotFoundError(f"LoRA adapter path {repo_id!r} is not a local directory nor a valid Hugging "
                                    f"Face repo id: {e}") from None
    if not os.path.isfile(os.path.join(local, "adapter_config.json")):
        raise LoRAError(f"Hugging Face repo {repo_id!r}{at} has no adapter_config.json: it is not a PEFT LoRA "
                        "adapter.")
    return local


def with_local_path(lora_request):
    """`lora_request` with lora_path resolved to its local directory (the same object when it already is one)."""
    path = getattr(lora_request, "lora_path", None)
    if not isinstance(path, str) or not path:
        return lora_request
    local = resolve_lora_path(path, refresh=bool(getattr(lora_request, "load_inplace", False)))
    if local == path:
        return lora_request
    if dataclasses.is_dataclass(lora_request):
        return dataclasses.replace(lora_request, lora_path=local)
    lora_request.lora_path = local  # a duck-typed request (vLLM's own class): set in place
    return lora_request
