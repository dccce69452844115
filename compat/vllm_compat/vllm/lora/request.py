"""`from vllm.lora.request import LoRARequest`: pagedllm's own class."""
from __future__ import annotations

from pagedllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
