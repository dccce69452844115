"""Weight-file plumbing shared by all models: find and iterate checkpoint tensors, dummy initialization, and
the generic HF-name -> fused-parameter loading loop. (Parameter-level helpers: layers/weight_utils.py.)
"""
from __future__ import annotations

import glob
import json
import logging
import os
import re
from typing import Any, Callable, Collection, Iterable, Iterator, Optional, Sequence

import torch
from torch import nn

from pagedllm import envs
from pagedllm.layers.kv_cache_scales import checkpoint_kv_scale, load_checkpoint_kv_scale
from pagedllm.layers.weight_utils import default_weight_loader

logger = logging.getLogger(__name__)

# (fused param name, checkpoint name, shard id): how HF's separate projections map onto our fused ones.
StackedParamsMapping = Sequence[tuple[str, str, Any]]

# Multi-token-prediction heads (Qwen3-Next's `mtp.`, MiMo's `model.mtp_layers.`, GGUF's `blk.N.nextn.`): only a
# speculative-decoding drafter reads them, the served model never does.
_MTP_TENSOR = re.compile(r"(?:^|\.)(?:mtp|mtp_layers|nextn)\.")
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


# ----------------------------------------------------------------------------------------- weight files

def find_weight_files(model_dir: str) -> list[str]:
    """The checkpoint's safetensors files: the index's shards, else `model.safetensors`, else `*.safetensors`."""
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index_path} is not a valid safetensors index ({e}).") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index_path} is not a valid safetensors index: its weight_map must map tensor names "
                             f"to shard file names.")
        files = [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"{index_path} lists shard(s) that do not exist: "
                                    f"{', '.join(os.path.basename(m) for m in missing)}.")
        return files
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"No *.safetensors weights found in {model_dir}; pass a directory saved with "
                                f"save_pretrained(safe_serialization=True), a .gguf file, or load_format='dummy'.")
    return files


def checkpoint_tensor_names(files: Sequence[str]) -> list[str]:
    """Every tensor name of the safetensors files (from their headers; no tensor is read)."""
    from safetensors import SafetensorError, safe_open

    names: list[str] = []
    for path in files:
        try:
            with safe_open(path, framework="pt", device="cpu") as handle:
                names.extend(handle.keys())
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ValueError(f"Could not read weights file {path}: it is not a valid safetensors file ({e}).") from None
    return names


def safetensors_weights_iterator(files: Sequence[str], show_progress: bool = True
                                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, CPU tensor) for every tensor of every file, with one progress bar over all tensors."""
    from safetensors import SafetensorError, safe_open

    handles = []
    for path in files:
        try:
            handles.append(safe_open(path, framework="pt", device="cpu"))
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ValueError(f"Could not read weights file {path}: it is not a valid safetensors file "
                             f"({e}).") from None
    _check_no_duplicate_names(files, handles)
    pbar = _maybe_bar(sum(len(h.keys()) for h in handles), show_progress)
    try:
        for path, handle in zip(files, handles):
            for name in handle.keys():
                try:
                    tensor = handle.get_tensor(name)
                except (SafetensorError, OSError, ValueError, RuntimeError) as e:
                    raise ValueError(f"Could not read tensor {name!r} from {path}: the file is corrupt "
                                     f"({e}).") from None
                yield name, tensor
                if pbar is not None:
                    pbar.update(1)
    finally:
        if pbar is not None:
            pbar.close()


def _check_no_duplicate_names(files: Sequence[str], handles: Sequence[Any]) -> None:
    """A tensor stored in two shards would be loaded twice, the later file silently winning: which copy the
    checkpoint means is unknowable (transformers trusts the index, which maps a name to one file), so refuse it,
    even when the copies are equal (the checkpoint is malformed either way)."""
    owner: dict[str, str] = {}
    for path, handle in zip(files, handles):
        for name in handle.keys():
            first = owner.setdefault(name, path)
            if first != path:
                raise ValueError(f"Tensor {name!r} is stored in two checkpoint files, {first} and {path}; a "
                                 f"tensor name must appear in one shard only (re-save the checkpoint).")


def _maybe_bar(total: int, show: bool, desc: str = "Loading weights") -> Any:
    if not show or envs.PAGEDLLM_DISABLE_PROGRESS_BARS:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit="tensor", leave=False)


# ----------------------------------------------------------------------------------------- loading loop

def num_mtp_layers(config: Any) -> int:
    """Multi-token-prediction layers a checkpoint stores after its decoder layers (DeepSeek-V3 / GLM-4.5's
    `num_nextn_predict_layers`, MiMo's `num_nextn_predict_layers`, Qwen3-Next's `mtp_num_hidden_layers`)."""
    counts = (getattr(config, key, None) for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers"))
    return max([c for c in counts if isinstance(c, int)], default=0)


def is_harmless_extra(name: str, tensor: Optional[torch.Tensor], config: Any = None) -> bool:
    """Whether a checkpoint tensor that matches no parameter is known to change nothing the model computes, so a
    loader skips it quietly instead of warning: rope's saved inv_freq buffer (recomputed from the config), a
    multi-token-prediction head, and an all-zero bias (GPTQ exporters write one for every layer, bias or not)."""
    if "rotary_emb.inv_freq" in name or _MTP_TENSOR.search(name):
        return True
    layers = getattr(config, "num_hidden_layers", None)
    match = _LAYER_INDEX.search(name)
    if match is not None and isinstance(layers, int) and layers <= int(match.group(1)) < layers + num_mtp_layers(
            config):
        return True  # DeepSeek-style MTP layers numbered after the decoder's
    return (name.endswith(".bias") and tensor is not None and getattr(tensor, "gguf_type", None) is None
            and not bool(tensor.any()))


def report_unused_tensors(unused: Sequence[str], harmless: Sequence[str], source: str = "checkpoint") -> None:
    """One warning for the tensors nothing reads (a checkpoint of another model or variant, a fine-tune's extra
    head: transformers says "Some weights of the model checkpoint were not used"), a debug line for known extras."""
    if harmless:
        logger.debug("Skipping %d %s tensor(s) the model does not use (rope buffers, MTP heads, zero biases), "
                     "e.g. %s.", len(harmless), source, ", ".join(harmless[:5]))
    if unused:
        shown = ", ".join(unused[:5]) + (f" (and {len(unused) - 5} more)" if len(unused) > 5 else "")
        logger.warning("Ignoring %d %s tensor(s) with no matching parameter (a checkpoint of another model or "
                       "variant?): %s.", len(unused), source, shown)


def report_unused_gguf_tensors(names: Sequence[str], config: Any = None) -> None:
    """`report_unused_tensors` for the tensors of a .gguf file that have no Hugging Face name."""
    harmless = [n for n in names if is_harmless_extra(n, None, config)]
    report_unused_tensors([n for n in names if n not in harmless], harmless, source="GGUF")


def load_weights_into(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                      stacked_params_mapping: StackedParamsMapping,
                      skip: Callable[[str], bool] = lambda name: False,
                      loaded_elsewhere: Collection[str] = ()) -> set[str]:
    """Load HF-named tensors into `model`'s (possibly fused, possibly sharded) parameters.

    Returns the set of parameter names loaded. Raises ValueError naming what is missing if any parameter
    (or any shard of a fused one) was not in `weights`, except those in `loaded_elsewhere` (a caller that loads
    and checks them itself: the MoE models' stacked experts). Checkpoint tensors that match no parameter are
    ignored: known-harmless ones quietly (`is_harmless_extra`), the others with one warning naming them.
    """
    params = dict(model.named_parameters())
    # fused param -> every shard id it needs (e.g. qkv_proj -> {q, k, v})
    needed_shards: dict[str, set] = {}
    for fused, _, shard_id in stacked_params_mapping:
        needed_shards.setdefault(fused, set()).add(shard_id)
    got_shards: dict[str, set] = {}
    loaded: set[str] = set()
    unexpected: list[str] = []
    harmless: list[str] = []
    config = getattr(model, "config", None)
    modules: Optional[dict[str, nn.Module]] = None
    for name, tensor in weights:
        if skip(name):
            continue
        if name.endswith("_scale") and checkpoint_kv_scale(name) is not None:  # an FP8 KV cache's k/v scale
            modules = modules if modules is not None else dict(model.named_modules())
            load_checkpoint_kv_scale(modules, name, tensor)
            continue
        target, shard_id = name, None
        for fused, ckpt, sid in stacked_params_mapping:
            if f".{ckpt}." in name:
                target, shard_id = name.replace(f".{ckpt}.", f".{fused}."), sid
                break
        param = params.get(target)
        if param is None:
            (harmless if is_harmless_extra(name, tensor, config) else unexpected).append(name)
            continue
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, tensor, shard_id) if shard_id is not None else loader(param, tensor)
        except ValueError as e:
            raise ValueError(f"Cannot load checkpoint weight {name!r}: {e}.") from None
        if shard_id is None:
            loaded.add(target)
        else:
            got_shards.setdefault(target, set()).add(shard_id)
    for target, shards in got_shards.items():
        fused = next((f for f in needed_shards if f".{f}." in target), None)
        if fused is not None and shards >= needed_shards[fused]:
            loaded.add(target)
    report_unused_tensors(unexpected, harmless)
    missing = sorted(n for n in set(params) - loaded - set(loaded_elsewhere)
                     if not getattr(params[n], "optional_weight", False))
    if missing:
        shown = ", ".join(missing[:8]) + (f" (and {len(missing) - 8} more)" if len(missing) > 8 else "")
        raise ValueError(f"The checkpoint is missing {len(missing)} weight(s) the model needs: {shown}.")
    return loaded


def initialize_dummy_weights(model: nn.Module, low: float = -1e-3, high: float = 1e-3,
                             seed: Optional[int] = None) -> None:
    """Random weights for benchmarking/profiling without a checkpoint: U(low, high), norm weights one.

    Seeded on the parameter's device so every rank and every run gets the same values.
    """
    seed = envs.PAGEDLLM_DUMMY_WEIGHT_SEED if seed is None else seed
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        module_name = name.rsplit(".", 2)[-2] if "." in name else ""
        if "norm" in module_name:  # RMSNorm scales: random ones would only shrink activations
            param.data.fill_(1.0)
            continue
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        if torch.is_floating_point(param):
            # Draw in fp32 (uniform_ is not implemented for every low-precision dtype/device) then cast.
            values = torch.empty(param.shape, dtype=torch.float32, device=param.device)
            values.uniform_(low, high, generator=gen)
            param.data.copy_(values)
        elif param.dtype in (torch.int32, torch.int8, torch.uint8):  # packed quantized weights: random bits
            dummy = getattr(param, "dummy_init", None)  # e.g. g_idx must stay a valid group map
            if dummy is not None:
                dummy(param)
                continue
            info = torch.iinfo(param.dtype)
            param.data.copy_(torch.randint(info.min, info.max, param.shape, dtype=torch.int64, device=param.device,
                                           generator=gen).to(param.dtype))
