"""Packed token bitmasks on the device: int32 [rows, ceil(V / 32)], bit j of word w allows token 32 w + j.

Unpacking is a shift-and-test over the batch (a few elementwise kernels, no host sync), so it runs on the
device inside the sampler and inside the greedy LM-head shortcut alike.
"""
from __future__ import annotations

import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size]: True where the token is allowed. Tokens past the mask's width are not."""
    shifts = _SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _SHIFTS[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    rows, words = bitmask.shape
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(rows, words * 32).bool()  # [rows, words * 32]
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    pad = torch.zeros(rows, vocab_size - bits.shape[1], dtype=torch.bool, device=bits.device)
    return torch.cat([bits, pad], dim=1)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set forbidden logits to -inf in place. logits: [rows, V] (any float dtype); bitmask: [rows, W] int32."""
    allowed = allowed_tokens(bitmask, logits.shape[1])
    return logits.masked_fill_(~allowed, float("-inf"))
