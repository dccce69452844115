"""Prompts given as embeddings on the server (vLLM's /v1/completions `prompt_embeds`): base64 of a torch.save'd
tensor [num_tokens, hidden] (or [1, num_tokens, hidden]); and the bytes they travel in to the engine process."""
from __future__ import annotations

import base64
import binascii
import io
from typing import Any

_DTYPES = ("float32", "bfloat16", "float16")


def load_tensor(data: bytes) -> Any:
    """A tensor from torch.save's bytes; weights_only: the bytes come from a client, no pickled code runs."""
    import torch

    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


def dump_tensor(tensor: Any) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(tensor.contiguous(), buffer)
    return buffer.getvalue()


def decode_prompt_embeds(encoded: Any) -> Any:
    """One request item: base64 -> a dense 2-D float tensor on the CPU. ValueError saying what is wrong (the model's
    hidden size is checked by the engine)."""
    import torch

    if not isinstance(encoded, str):
        raise ValueError(f"prompt_embeds must be base64 strings of torch.save'd tensors, got {type(encoded).__name__}.")
    try:
        tensor = load_tensor(base64.b64decode(encoded, validate=True))
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"prompt_embeds is not valid base64: {e}.") from None
    except Exception as e:  # noqa: BLE001 - whatever torch.load says about bytes that are no tensor
        raise ValueError(f"prompt_embeds could not be loaded as a torch.save'd tensor: {e}.") from None
    if not isinstance(tensor, torch.Tensor) or str(tensor.dtype).replace("torch.", "") not in _DTYPES:
        raise ValueError("prompt_embeds must hold a float32, bfloat16 or float16 tensor.")
    tensor = tensor.to_dense()
    if tensor.dim() == 3 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.dim() != 2 or tensor.shape[0] < 1:
        raise ValueError(f"prompt_embeds must have shape [num_tokens, hidden_size], got {list(tensor.shape)}.")
    return tensor
