"""LoRARequest: names one adapter for a request (vLLM's class: `from vllm.lora.request import LoRARequest`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class LoRARequest:
    """A LoRA adapter: a unique name, a positive integer id (the engine's key), and its PEFT directory (or a Hugging
    Face repo id, downloaded when it is registered: lora/resolve.py).

    Two requests with the same `lora_int_id` use the same adapter: the id, not the path, identifies it, so give a
    different adapter a different id (an id given another path, or load_inplace=True, is read again while no request
    runs with it; blocks cached with its old weights are not reused).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    lora_local_path: Optional[str] = None  # vLLM's deprecated alias of lora_path
    long_lora_max_len: Optional[int] = None
    base_model_name: Optional[str] = None
    # vLLM's field (adapters serialized with tensorizer), here so vLLM's keywords and positions fit: only None
    tensorizer_config_dict: Optional[dict] = None
    # vLLM's: read the adapter again even if its id is loaded (new weights saved at the same path)
    load_inplace: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}.")
        if not self.lora_name or not isinstance(self.lora_name, str):
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}.")
        if not self.lora_path and self.lora_local_path:
            self.lora_path = self.lora_local_path
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r} needs lora_path (a local PEFT adapter directory "
                             "or a Hugging Face repo id).")
        if self.tensorizer_config_dict is not None:
            raise ValueError("tensorizer_config_dict (tensorizer-serialized adapters) is not supported by pagedllm; "
                             "give lora_path a PEFT adapter directory.")
        if self.long_lora_max_len is not None:
            raise ValueError("long_lora_max_len (long-context LoRA) is not supported by pagedllm.")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_int_id == other.lora_int_id

    def __hash__(self) -> int:
        return hash(self.lora_int_id)
