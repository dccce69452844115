"""`--model` -> a local path, as vLLM resolves it: an existing path (directory or .gguf) as is; otherwise a
repo id on a model hub.

Hugging Face (huggingface_hub 0.30 to 2.x, through its public API only): with HF_HUB_OFFLINE (or
TRANSFORMERS_OFFLINE) only the local cache is used; otherwise the snapshot is downloaded, with a progress bar,
into the cache (or --download-dir), at --revision, with hf_token / --hf-token (a token, or True: the one `hf auth
login` stored), else HF_TOKEN, for private and gated repos, and an unreachable
hub falls back to the cache. Where the cache is (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub)
and which hub is asked (HF_ENDPOINT) huggingface_hub reads itself, from `huggingface_hub.constants`, which is
imported here by name: huggingface_hub 2.x does not load that submodule lazily, and nothing else may have
imported it yet in an engine process. Only what the engine reads is fetched (configs, tokenizer files,
safetensors, the model's own code). With VLLM_USE_MODELSCOPE / PAGEDLLM_USE_MODELSCOPE the `modelscope` library
does the same against ModelScope.
"""
from __future__ import annotations

import functools
import logging
import os
import re
from typing import Optional, Union

from pagedllm import envs

logger = logging.getLogger(__name__)

ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.py", "*.tiktoken", "*.jinja"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def looks_like_repo_id(model: str) -> bool:
    return bool(_REPO_ID.match(model)) and not model.endswith(".gguf") and ".." not in model


def resolve_repo_id(model: str, revision: Optional[str] = None, download_dir: Optional[str] = None,
                    token: Union[bool, str, None] = None, allow_patterns: Optional[list[str]] = None) -> str:
    """The local directory of hub repo `model` (downloading it when allowed); ValueError saying what to do.
    token: vLLM's hf_token (a token, or True for the stored one); None: HF_TOKEN, else huggingface_hub's default.
    allow_patterns: the files fetched (default ALLOW_PATTERNS; --hf-config-path needs only the configs)."""
    patterns = allow_patterns or ALLOW_PATTERNS
    if envs.VLLM_USE_MODELSCOPE or envs.PAGEDLLM_USE_MODELSCOPE:
        return _from_modelscope(model, revision, download_dir, patterns)
    return _from_hugging_face(model, revision, download_dir, token, patterns)


def _from_hugging_face(model: str, revision: Optional[str], download_dir: Optional[str],
                       token: Union[bool, str, None] = None, allow_patterns: Optional[list[str]] = None) -> str:
    from huggingface_hub import constants, errors, get_token, snapshot_download
    from huggingface_hub.utils import disable_progress_bars

    if token is True and get_token() is None:  # (the hub's own error would read as a failed download below)
        raise ValueError("hf_token=True uses the Hugging Face token stored by `hf auth login` (or HF_TOKEN), but "
                         "there is none: log in, or pass the token itself.")
    kwargs = dict(repo_id=model, revision=revision, cache_dir=download_dir,
                  allow_patterns=allow_patterns or ALLOW_PATTERNS,
                  token=envs.HF_TOKEN if token is None else token)
    where = download_dir or constants.HF_HUB_CACHE
    at = f" at revision {revision!r}" if revision else ""
    if envs.HF_HUB_OFFLINE:
        try:
            return snapshot_download(local_files_only=True, **kwargs)
        except (errors.LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
            raise ValueError(f"Model {model!r}{at} is not in the local Hugging Face cache ({where}) and "
                             "HF_HUB_OFFLINE is set: download it first (unset HF_HUB_OFFLINE), or pass a local "
                             "path.") from None
    if envs.PAGEDLLM_DISABLE_PROGRESS_BARS:
        disable_progress_bars()
    logger.info("Resolving %s%s on the Hugging Face Hub (cache: %s).", model, at, where)
    try:
        return snapshot_download(**kwargs)
    except errors.GatedRepoError:
        raise ValueError(f"Model {model!r} is gated on the Hugging Face Hub: accept its terms on its page and "
                         "set HF_TOKEN to a token of that account.") from None
    except errors.RepositoryNotFoundError:
        raise ValueError(f"Model {model!r} was not found on the Hugging Face Hub (nor as a local path); if it is "
                         "private, set HF_TOKEN.") from None
    except errors.RevisionNotFoundError:
        raise ValueError(f"Model {model!r} has no revision {revision!r} on the Hugging Face Hub.") from None
    except (errors.LocalEntryNotFoundError, OSError) as e:  # HfHubHTTPError is an OSError too
        raise ValueError(f"Could not download {model!r}{at} from the Hugging Face Hub, and it is not in the local "
                         f"cache ({where}): {type(e).__name__}: {first_line(e)}; check the network and HF_ENDPOINT, "
                         "or pass a local path.") from None


@functools.lru_cache(maxsize=8)
def resolve_config_dir(path: str, revision: Optional[str] = None, download_dir: Optional[str] = None,
                       token: Union[bool, str, None] = None) -> str:
    """--hf-config-path's local directory: a local path as is (absolute), a hub repo id's snapshot of its configs
    and code only (no weights). Cached: the engine and its pooling defaults each ask, one hub check is enough."""
    local = local_path(path)
    if local is not None:
        return os.path.abspath(local)
    try:
        return resolve_repo_id(path, revision, download_dir, token, allow_patterns=["*.json", "*.py"])
    except ValueError as e:
        raise ValueError(f"hf_config_path {path!r}: {e}") from None


def first_line(e: BaseException) -> str:
    """An error's first non-blank line (a hub error carries its HTTP details on the lines after)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else ""


def _from_modelscope(model: str, revision: Optional[str], download_dir: Optional[str],
                     allow_patterns: Optional[list[str]] = None) -> str:
    try:
        from modelscope import snapshot_download
    except ImportError:
        raise ValueError("VLLM_USE_MODELSCOPE / PAGEDLLM_USE_MODELSCOPE is set, but the `modelscope` package is "
                         "not installed: `pip install modelscope`, or unset the variable to use Hugging Face."
                         ) from None
    logger.info("Resolving %s on ModelScope.", model)
    try:
        return snapshot_download(model, revision=revision, cache_dir=download_dir,
                                 allow_patterns=allow_patterns or ALLOW_PATTERNS)
    except Exception as e:  # noqa: BLE001 - modelscope raises many kinds; one sentence for the user
        raise ValueError(f"Could not get {model!r} from ModelScope ({type(e).__name__}: {e}).") from None


def local_path(model: str) -> Optional[str]:
    """`model` as an existing local path (user-expanded), else None."""
    path = os.path.expanduser(model)
    return path if os.path.exists(path) else None
