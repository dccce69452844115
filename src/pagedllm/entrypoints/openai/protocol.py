"""Pydantic models of the OpenAI-compatible API requests (the fields OpenAI and vLLM accept; unknown ones are
ignored with a warning naming them, see fields.py).

Request models only check shapes and types; value rules (n >= 1, 0 < top_p <= 1, ...) live in
SamplingParams so the offline API and the server give the same messages.
"""
from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Strict

# A token id: an integer, not a bool, float or numeric string that the lax default would turn into one (a prompt of
# [true, false] is no prompt of tokens 1 and 0).
TokenId = Annotated[int, Strict()]


def _no_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("Input should be a valid integer, not a boolean")
    return value


# A count, length or seed: an integer (a whole float such as 2.0 too, as pydantic reads it), never true / false.
Int = Annotated[int, BeforeValidator(_no_bool)]


def _null_is_one(value: Any) -> Any:
    return 1 if value is None else _no_bool(value)


# OpenAI's `n` is "integer or null" (null: the default, 1), as vLLM's Optional[int] = 1: clients that send every
# parameter (null where unset) must not get a 400. Read as 1, so `req.n` stays an int.
CountOrNull = Annotated[int, BeforeValidator(_null_is_one)]


class _Req(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


_NAMES: dict[type, frozenset[str]] = {}


def field_or_none(req: Any, name: str) -> Any:
    """getattr(req, name, None), where a request model that lacks `name` (e.g. `messages` of a completions
    request) answers None at once: pydantic's __getattr__ raises and catches an AttributeError for it, which
    costs more than the rest of a field check."""
    cls = type(req)
    names = _NAMES.get(cls)
    if names is None:
        if not issubclass(cls, BaseModel):
            return getattr(req, name, None)
        names = _NAMES[cls] = frozenset(cls.model_fields) | frozenset(dir(cls))
    return getattr(req, name, None) if name in names else None


# ---- shared request pieces -----------------------------------------------------------------------


class StreamOptions(_Req):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False


class VllmSamplingExtras(_Req):
    """vLLM's sampling extras every generating endpoint takes (/v1/responses too)."""

    top_k: Optional[Int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[TokenId]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


class _SamplingFields(VllmSamplingExtras):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Optional[str] = None
    max_tokens: Optional[Int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: CountOrNull = 1
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[Int] = None
    presence_penalty: Optional[float] = 0.0
    frequency_penalty: Optional[float] = 0.0
    user: Optional[str] = None
    # vLLM's extras (with VllmSamplingExtras')
    spaces_between_special_tokens: bool = True
    request_id: Optional[str] = None
    cache_salt: Optional[str] = None  # vLLM: only requests of the same salt share prefix-cache blocks
    priority: Optional[Int] = 0  # vLLM: lower first; not 0 only under --scheduling-policy priority
    return_token_ids: Optional[bool] = None  # vLLM: the choices' token_ids and the prompt's prompt_token_ids
    logit_bias: Optional[dict[str, float]] = None  # OpenAI: token id (as a string) -> bias in [-100, 100]
    bad_words: Optional[list[str]] = None
    allowed_token_ids: Optional[list[TokenId]] = None
    prompt_logprobs: Optional[Int] = None
    truncate_prompt_tokens: Optional[Int] = None  # keep the prompt's last k tokens; -1: the model's context length
    # vLLM's: logprobs name tokens "token_id:<id>" (entrypoints/openai/logprobs.token_label)
    return_tokens_as_token_ids: Optional[bool] = None
    # vLLM's beam search extension (entrypoints/openai/beam_search.py); early_stopping as in transformers.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: Union[bool, Literal["never"]] = False
    # Structured outputs (entrypoints/openai/structured_request.py): OpenAI's response_format, vLLM's
    # structured_outputs and its older guided_* extras.
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_decoding_backend: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None


class CompletionRequest(_SamplingFields):
    # vLLM's: prompt may be left out when prompt_embeds (base64 of torch.save'd tensors) carries the prompts
    prompt: Optional[Union[str, list[TokenId], list[Union[str, list[TokenId]]]]] = None
    prompt_embeds: Optional[Union[str, list[str]]] = None
    echo: Optional[bool] = False
    logprobs: Optional[Int] = None
    suffix: Optional[str] = None
    best_of: Optional[Int] = None
    add_special_tokens: bool = True


class ChatMessage(_Req):
    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None  # an assistant's earlier calls
    tool_call_id: Optional[str] = None  # role "tool": the call this message answers
    # an assistant's earlier reasoning (vLLM's `reasoning`, DeepSeek's `reasoning_content`): to the chat template as
    # `reasoning_content`, which thinking models' templates read
    reasoning: Optional[str] = None
    reasoning_content: Optional[str] = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[Int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[Int] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    echo: bool = False  # vLLM: echo the last message's content when it has the assistant role
    best_of: Optional[Int] = None  # only with use_beam_search: the beam width
    # Tool calling (entrypoints/openai/tool_calling.py)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    include_reasoning: bool = True  # vLLM's: with --reasoning-parser, false leaves the reasoning out
    # vLLM's: documents for RAG, handed to the chat template as `documents` (templates such as Command-R's read them)
    documents: Optional[list[dict[str, Any]]] = None


class TokenizeRequest(_Req):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # As the chat request's: the same prompt as /v1/chat/completions renders (tools in the template)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None


class DetokenizeRequest(_Req):
    model: Optional[str] = None
    tokens: list[TokenId]
