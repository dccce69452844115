"""`from vllm.lora.request import LoRARequest`: pagedllm's class when it has one, else vLLM's shape."""
from __future__ import annotations

try:
    from pagedllm.lora.request import LoRARequest  # noqa: F401
except ImportError:
    from dataclasses import dataclass
    from typing import Optional

    @dataclass
    class LoRARequest:  # type: ignore[no-redef]
        """Names one LoRA adapter: a unique name, a positive integer id, and its local path."""

        lora_name: str
        lora_int_id: int
        lora_path: str = ""
        base_model_name: Optional[str] = None

        def __post_init__(self) -> None:
            if self.lora_int_id < 1:
                raise ValueError(f"lora_int_id must be > 0, got {self.lora_int_id}.")

        @property
        def adapter_id(self) -> int:
            return self.lora_int_id

        @property
        def name(self) -> str:
            return self.lora_name

        @property
        def path(self) -> str:
            return self.lora_path
