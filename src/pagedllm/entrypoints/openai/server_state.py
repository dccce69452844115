"""What every endpoint reads: the engine, the served model names, the tokenizer; the `model` field check."""
from __future__ import annotations

import time
from typing import Any, Optional

from pagedllm.entrypoints.openai.errors import APIError


class ServerState:
    """What the endpoints need: the engine, the served model names, the tokenizer."""

    def __init__(self, engine: Any, served_model_names: list[str], metrics: Any = None,
                 api_key: Optional[str] = None, sampling_defaults: Optional[dict] = None) -> None:
        self.engine = engine
        # the model's generation-config defaults (--generation-config) for fields a request leaves out
        self.sampling_defaults = dict(sampling_defaults or {})
        self.served_model_names = served_model_names
        self.metrics = metrics
        self.api_key = api_key
        self.created = int(time.time())
        self.loras: Any = None  # lora_models.LoRAModels: adapter names the `model` field may name
        self.dashboard = True  # GET /dashboard (--no-dashboard: off)
        self.tool_call_parser = "auto"  # --tool-call-parser
        self.exclude_tools_when_tool_choice_none = False  # --exclude-tools-when-tool-choice-none
        self.response_role = "assistant"  # --response-role: the chat answer's role after a generation prompt
        self.reasoning_parser: Optional[str] = None  # --reasoning-parser (reasoning.py)
        self.grammar_in_reasoning = False  # --structured-outputs-config enable_in_reasoning: no grammar-after-reasoning
        self.prompt_tokens_details = False  # --enable-prompt-tokens-details: usage's cached prompt tokens
        self.return_tokens_as_token_ids = False  # --return-tokens-as-token-ids: the default of the request field
        self.force_include_usage = False  # --enable-force-include-usage: every stream's chunks carry the usage
        self.trust_request_chat_template = False  # --trust-request-chat-template
        self.chat_template_content_format = "auto"  # --chat-template-content-format
        self.chat_template: Optional[str] = None  # --chat-template's text (GET /tokenizer_info reports it)
        self.tokenizer_info_endpoint = False  # --enable-tokenizer-info-endpoint: GET /tokenizer_info
        self.lifecycle: Any = None  # lifecycle.Lifecycle, set by the server (the dashboard's stream ends on drain)
        self.pooling_defaults: Any = None  # pooling.ModelPooling of the model, read by the first /v1/embeddings

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def scheduling_policy(self) -> str:
        return getattr(self.engine.engine_args, "scheduling_policy", "fcfs")

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_logprobs(self) -> int:
        """--max-logprobs (-1: the vocabulary size)."""
        limit = getattr(self.engine.engine_args, "max_logprobs", 20)
        return self.engine.ready.vocab_size if limit == -1 else limit

    def check_model(self, name: Optional[str]) -> str:
        if name is None or name == "" or name in self.served_model_names:
            return self.model_name
        if self.loras is not None and self.loras.get(name) is not None:
            return name
        raise APIError(f"The model `{name}` does not exist.", status=404, param="model", code="model_not_found")

    def lora_request(self, model: str) -> Any:
        """The LoRARequest a checked `model` name routes to (None: the base model). An adapter unloaded since the
        check (the request awaited its tokenization meanwhile) is a 404, as a request naming it afterwards gets:
        None would run the request on the base model, answered under the adapter's name."""
        if self.loras is None or model in self.served_model_names:
            return None
        request = self.loras.get(model)
        if request is None:
            raise APIError(f"The model `{model}` does not exist.", status=404, param="model", code="model_not_found")
        return request
