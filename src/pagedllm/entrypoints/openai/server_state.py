"""What every endpoint reads: the engine, the served model names, the tokenizer; the `model` field check."""
from __future__ import annotations

import time
from typing import Any, Optional

from pagedllm.entrypoints.openai.errors import APIError


class ServerState:
    """What the endpoints need: the engine, the served model names, the tokenizer."""

    def __init__(self, engine: Any, served_model_names: list[str], metrics: Any = None,
                 api_key: Optional[str] = None) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.metrics = metrics
        self.api_key = api_key
        self.created = int(time.time())

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_model(self, name: Optional[str]) -> str:
        if name is None or name == "" or name in self.served_model_names:
            return self.model_name
        raise APIError(f"The model `{name}` does not exist.", status=404, param="model", code="model_not_found")
