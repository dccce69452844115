"""The one table of `--dtype` names: every alias a user may write -> its canonical torch dtype name.

Pure Python (config and the CLI import it without torch); `torch_dtype()` does the torch lookup for the worker.
"""
from __future__ import annotations

from typing import Any

# Order is the order `--help` lists them in.
DTYPE_ALIASES: dict[str, str] = {
    "float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
    "half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32",
}
DTYPE_CHOICES: list[str] = ["auto", *DTYPE_ALIASES]


def torch_dtype(name: str) -> Any:
    """`name` (an alias, or a torch name such as a config's "bfloat16") -> torch.dtype; KeyError if unknown."""
    import torch

    return getattr(torch, DTYPE_ALIASES[name])
