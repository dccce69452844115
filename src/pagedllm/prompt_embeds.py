"""Prompt embeddings (vLLM's EmbedsPrompt, enable_prompt_embeds): the checks a prompt's [num_tokens, hidden] tensor
passes before the engine keeps it, and its prefix-cache key. Outside core/ (pure Python) as it handles tensors."""
from __future__ import annotations

from typing import Any

PROMPT_EMBEDS_PLACEHOLDER = 0
PROMPT_EMBEDS_OFF = "You must set `--enable-prompt-embeds` to input `prompt_embeds`."  # vLLM's words


def check_prompt_embeds(embeds: Any, hidden_size: int) -> Any:
    """A prompt's embeddings as the engine keeps them: a 2-D floating tensor [num_tokens >= 1, hidden_size] (a
    leading batch dimension of 1 is dropped, as vLLM does), on the CPU, contiguous. ValueError saying what is wrong."""
    import torch

    if not isinstance(embeds, torch.Tensor):
        raise ValueError(f"prompt_embeds must be a torch.Tensor [num_tokens, {hidden_size}], got "
                         f"{type(embeds).__name__}.")
    if embeds.dim() == 3 and embeds.shape[0] == 1:
        embeds = embeds[0]
    if embeds.dim() != 2 or embeds.shape[0] < 1 or embeds.shape[1] != hidden_size:
        raise ValueError(f"prompt_embeds must have shape [num_tokens, {hidden_size}] (the model's hidden size), "
                         f"got {list(embeds.shape)}.")
    if not embeds.is_floating_point():
        raise ValueError(f"prompt_embeds must be a floating-point tensor, got {embeds.dtype}.")
    embeds = embeds.detach().to("cpu").contiguous()
    if not bool(torch.isfinite(embeds).all()):
        raise ValueError("prompt_embeds must be finite (no NaN or inf).")
    return embeds


def prompt_embeds_key(embeds: Any) -> bytes:
    """What identifies a prompt's embeddings for the prefix cache: their dtype, shape and bytes."""
    import hashlib

    import torch

    raw = embeds.reshape(-1).view(torch.uint8).numpy()
    return f"{embeds.dtype}{tuple(embeds.shape)}".encode() + hashlib.sha256(raw).digest()
