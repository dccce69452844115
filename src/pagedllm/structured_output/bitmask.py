"""Packed token bitmasks on the device: int32 [rows, ceil(V / 32)], bit j of word w allows token 32 w + j.

On CUDA the mask is unpacked with a byte lookup table (a gather and a masked fill: no host sync, no kernel to
compile); on CPU xgrammar's C++ kernel does it when xgrammar is installed (faster than the table there:
docs/benchmarks.md, structured outputs).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

_FORBIDDEN_BITS: dict[torch.device, torch.Tensor] = {}
_XGR: list[Optional[Any]] = []


def _forbidden_table(device: torch.device) -> torch.Tensor:
    table = _FORBIDDEN_BITS.get(device)
    if table is None:  # [256, 8] bool: bit j of byte b is clear
        bits = (torch.arange(256, dtype=torch.int32)[:, None] >> torch.arange(8, dtype=torch.int32)) & 1
        table = _FORBIDDEN_BITS[device] = (bits == 0).to(device)
    return table


def forbidden_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size]: True where the token is NOT allowed. Tokens past the mask's width are not allowed."""
    rows, words = bitmask.shape
    # Little-endian bytes of each word: byte k holds tokens 32 w + 8 k .. + 7 (CPUs and CUDA GPUs alike).
    as_bytes = bitmask.contiguous().view(torch.uint8).to(torch.int32)  # [rows, words * 4]
    bits = _forbidden_table(bitmask.device)[as_bytes].view(rows, words * 32)
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    pad = torch.ones(rows, vocab_size - bits.shape[1], dtype=torch.bool, device=bits.device)
    return torch.cat([bits, pad], dim=1)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size]: True where the token is allowed."""
    return ~forbidden_tokens(bitmask, vocab_size)


def _xgrammar() -> Optional[Any]:
    if not _XGR:
        try:
            import xgrammar
        except Exception:  # noqa: BLE001 - optional fast path
            xgrammar = None
        _XGR.append(xgrammar)
    return _XGR[0]


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set forbidden logits to -inf in place. logits: [rows, V] (any float dtype); bitmask: [rows, W] int32."""
    vocab = logits.shape[1]
    width = bitmask.shape[1] * 32
    xgr = _xgrammar() if logits.device.type == "cpu" else None
    if xgr is not None and logits.is_contiguous() and logits.dtype in (torch.float32, torch.bfloat16) \
            and width >= vocab:
        xgr.apply_token_bitmask_inplace(logits, bitmask.contiguous(), vocab_size=vocab)
        return logits
    return logits.masked_fill_(forbidden_tokens(bitmask, vocab), float("-inf"))
