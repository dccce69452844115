"""OpenAI's Responses API request (POST /v1/responses) and its translation into the chat request the chat path
serves: input items -> chat messages, flat function tools -> chat tools, text.format -> a structured-outputs spec.

Nothing is stored: `store` is accepted (its default is true) but a later request cannot refer to a response
(`previous_response_id` is a 400), as no response outlives its HTTP answer. (A store in memory would be per API
process: with --api-server-count > 1 a follow-up served by another process would not find it.)
"""
from __future__ import annotations

import re
from typing import Any, Optional, Union

from pydantic import ValidationError

from pagedllm.entrypoints.openai import limits
from pagedllm.entrypoints.openai.errors import APIError, format_validation_error
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, Int, VllmSamplingExtras
from pagedllm.structured_output.params import StructuredOutputsParams


class ResponsesRequest(VllmSamplingExtras):
    model: Optional[str] = None
    input: Union[str, list[Any]]  # (items checked in input_messages: pydantic's union error would say "string")
    instructions: Optional[str] = None
    max_output_tokens: Optional[Int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: Optional[bool] = False
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[dict[str, Any]] = None
    user: Optional[str] = None
    metadata: Optional[dict[str, Any]] = None
    store: Optional[bool] = True
    # accepted, nothing to do here: one service tier; the prefix cache needs no key; no abuse monitoring
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None
    stream_options: Optional[dict[str, Any]] = None  # (include_obfuscation: nothing is obfuscated here)
    # Asked-for features not built: refused with a 400 naming them when a value asks for something (_REFUSED).
    previous_response_id: Optional[str] = None
    reasoning: Optional[dict[str, Any]] = None
    background: Optional[bool] = None
    include: Optional[list[Any]] = None
    conversation: Optional[Any] = None
    prompt: Optional[Any] = None
    truncation: Optional[str] = None
    max_tool_calls: Optional[Int] = None
    top_logprobs: Optional[Int] = None
    # vLLM's sampling extras, as chat takes them (VllmSamplingExtras; copied onto the chat request: _SHARED)
    seed: Optional[Int] = None
    stop: Optional[Union[str, list[str]]] = None
    presence_penalty: Optional[float] = 0.0
    frequency_penalty: Optional[float] = 0.0
    logit_bias: Optional[dict[str, float]] = None
    bad_words: Optional[list[str]] = None
    request_id: Optional[str] = None
    cache_salt: Optional[str] = None
    priority: Optional[Int] = 0  # vLLM's Responses take it too (it was ignored here, named as unknown)


_SHARED = ("model", "temperature", "top_p", "stream", "parallel_tool_calls", "user", "seed", "stop",
           "presence_penalty", "frequency_penalty", "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
           "stop_token_ids", "skip_special_tokens", "include_stop_str_in_output", "logit_bias", "bad_words",
           "request_id", "cache_salt", "priority")

# field -> whether its value asks for something pagedllm does not do (an answer without it would look complete)
_REFUSED = {
    "background": lambda v: bool(v),
    "include": lambda v: bool(v),
    "conversation": lambda v: v is not None,
    "prompt": lambda v: v is not None,
    "truncation": lambda v: v not in (None, "disabled"),
    "max_tool_calls": lambda v: v is not None,
    "top_logprobs": lambda v: bool(v),
    "reasoning": lambda v: bool(v) and any(x is not None for x in v.values()),
}


def check_refused(req: ResponsesRequest) -> None:
    if req.previous_response_id is not None:
        raise APIError("'previous_response_id' is not supported: pagedllm stores no responses (store is accepted, but "
                       "nothing is kept), so send the whole conversation as 'input'.", param="previous_response_id")
    for name, asks in _REFUSED.items():
        if asks(getattr(req, name)):
            raise APIError(f"'{name}' is not supported yet by pagedllm.", param=name)


# ---- input -> chat messages ----------------------------------------------------------------------------------


def _content_text(content: Any, where: str, field: str = "content") -> str:
    """A message's content (a function_call_output's output: field 'output'): a string, or parts of type
    input_text / output_text (joined as chat joins parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where}.{field} must be a string or a list of content parts.", param=f"{where}.{field}")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text"):
            if not isinstance(part.get("text"), str):
                raise APIError(f"{where}.{field}[{j}].text must be a string.", param=f"{where}.{field}")
            texts.append(part["text"])
        elif kind in ("input_image", "input_file", "input_audio", "refusal"):
            raise APIError(f"'{kind}' is not supported yet by pagedllm.", param=f"{where}.{field}")
        else:
            raise APIError(f"{where}.{field}[{j}] must be a part of type 'input_text' or 'output_text', got "
                           f"{kind!r}.", param=f"{where}.{field}")
    return "\n".join(texts)


_ROLES = {"user": "user", "system": "system", "assistant": "assistant",
          "developer": "system"}  # chat templates (SmolLM2's) know no developer role: it instructs as system does


def input_messages(req: ResponsesRequest) -> list[ChatMessage]:
    """instructions (a system message first) + input as chat messages. Consecutive function_call items become one
    assistant message's tool_calls; each function_call_output a tool message."""
    msgs: list[ChatMessage] = []
    if req.instructions:
        msgs.append(ChatMessage(role="system", content=req.instructions))
    if isinstance(req.input, str):
        msgs.append(ChatMessage(role="user", content=req.input))
        return msgs
    if not req.input:
        raise APIError("'input' must contain at least one item.", param="input")
    if len(req.input) > limits.MAX_MESSAGES:  # (named here: chat's own check would name 'messages')
        raise APIError(f"'input' may have at most {limits.MAX_MESSAGES} items (got {len(req.input)}).",
                       param="input")
    call_ids: set[str] = set()
    thought: Optional[str] = None  # a reasoning item's text, for the assistant turn that follows it
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(f"{where} must be an input item object (a message, function_call or "
                           f"function_call_output), got {item!r:.80}.", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            role = _ROLES.get(role) if isinstance(role, str) else None
            if role is None:
                raise APIError(f"{where}.role must be 'user', 'system', 'developer' or 'assistant', got "
                               f"{item.get('role')!r}.", param=f"{where}.role")
            msgs.append(ChatMessage(role=role, content=_content_text(item.get("content"), where),
                                    reasoning_content=thought if role == "assistant" else None))
            thought = None
        elif kind == "reasoning":  # an earlier response's reasoning, sent back: the next assistant turn's
            thought = _reasoning_text(item, where)
        elif kind == "function_call":
            call = _history_call(item, where)
            call_ids.add(call["id"])
            last = msgs[-1] if msgs else None
            if last is not None and last.role == "assistant" and last.tool_calls:
                last.tool_calls.append(call)
            else:
                msgs.append(ChatMessage(role="assistant", content=None, tool_calls=[call], reasoning_content=thought))
            thought = None
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise APIError(f"{where}.call_id must be a string.", param=f"{where}.call_id")
            if call_id not in call_ids:  # (OpenAI's 400 too: an output answers a call made earlier in input)
                raise APIError(f"No tool call found for function call output with call_id {call_id!r} ({where}): "
                               "a function_call item with that call_id must come before it.",
                               param=f"{where}.call_id")
            text = _content_text(output, where, "output")
            msgs.append(ChatMessage(role="tool", content=text, tool_call_id=call_id))
        elif kind in ("item_reference", "file_search_call", "web_search_call", "computer_call",
                      "computer_call_output", "code_interpreter_call", "image_generation_call", "local_shell_call",
                      "local_shell_call_output", "mcp_call", "mcp_list_tools", "mcp_approval_request",
                      "mcp_approval_response", "custom_tool_call", "custom_tool_call_output"):
            raise APIError(f"'{kind}' is not supported yet by pagedllm.", param=f"{where}.type")
        else:
            raise APIError(f"{where}.type must be 'message', 'function_call', 'function_call_output' or "
                           f"'reasoning', got {kind!r}.", param=f"{where}.type")
    if not msgs:
        raise APIError("'input' must contain a message or function_call item (reasoning items alone carry nothing "
                       "to answer).", param="input")
    return msgs


def _reasoning_text(item: dict, where: str) -> Optional[str]:
    """A reasoning item's text (its reasoning_text parts; a summary stands in when there are none), or None."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        raise APIError(f"{where}.content must be a list of reasoning_text parts.", param=f"{where}.content")
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or not isinstance(part.get("text"), str):
            raise APIError(f"{where}.content[{j}] must be a part with a text string.", param=f"{where}.content")
        texts.append(part["text"])
    return "".join(texts) or None


def _history_call(item: dict, where: str) -> dict:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise APIError(f"{where}.{key} must be a string.", param=f"{where}.{key}")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


# ---- tools, tool_choice, text.format --------------------------------------------------------------------------


def chat_tools(tools: Optional[list]) -> Optional[list]:
    """Flat function tools ({type, name, description, parameters, strict}) -> chat's nested ones."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            if isinstance(kind, str) and kind:
                raise APIError(f"'{kind}' is not supported yet by pagedllm.", param="tools")
            raise APIError(f"tools[{i}].type must be 'function'.", param="tools")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise APIError(f"tools[{i}].name must be a non-empty string.", param="tools")
        # (chat would take a non-string description into the prompt and never read strict: refused here, as OpenAI)
        for key, kind, what in (("description", str, "a string"), ("strict", bool, "true or false")):
            if tool.get(key) is not None and not isinstance(tool[key], kind):
                raise APIError(f"tools[{i}].{key} must be {what}, got {tool[key]!r}.", param=f"tools[{i}].{key}")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """{"type": "function", "name": X} -> chat's {"type": "function", "function": {"name": X}}; strings as they are."""
    if not isinstance(choice, dict):
        return choice
    kind = choice.get("type")
    if kind == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if kind != "function" and isinstance(kind, str):
        raise APIError(f"tool_choice of type '{kind}' is not supported yet by pagedllm.", param="tool_choice")
    raise APIError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}.",
                   param="tool_choice")


def text_format_spec(text: Optional[dict]) -> Optional[StructuredOutputsParams]:
    """text.format -> the output constraint (None for plain text); errors name text.format."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):  # ("json_object" alone: its type would read as missing, "got None")
        raise APIError(f"text.format must be an object such as {{'type': 'text'}}, got {fmt!r:.80}.",
                       param="text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams.from_dict({"json_object": True}, origin="text.format")
    if kind != "json_schema":
        raise APIError(f"text.format.type must be 'text', 'json_schema' or 'json_object', got {kind!r}.",
                       param="text.format")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise APIError("text.format of type 'json_schema' needs a 'schema' JSON schema object (and a 'name').",
                       param="text.format.schema")
    strict = fmt.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise APIError(f"text.format.strict must be true or false, got {strict!r}.", param="text.format.strict")
    name = fmt.get("name")  # required by OpenAI (its SDK's parse() always sends one): a 400 there too
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise APIError(f"text.format.name must be a string of 1 to 64 letters, digits, '_' or '-', got {name!r:.80}.",
                       param="text.format.name")
    try:  # strict or not, the grammar follows the schema exactly (as chat's response_format does)
        return StructuredOutputsParams.from_dict({"json": schema}, origin="text.format.schema")
    except (ValueError, TypeError) as e:
        raise APIError(str(e), param="text.format.schema") from None


def _check_metadata(metadata: Optional[dict]) -> None:
    """OpenAI's bounds: at most 16 pairs, string keys of up to 64 characters, string values of up to 512 (the
    response echoes metadata: a client relying on more would fail there)."""
    if metadata is None:
        return
    if len(metadata) > 16:
        raise APIError(f"'metadata' may have at most 16 key-value pairs (got {len(metadata)}).", param="metadata")
    for k, v in metadata.items():
        if len(k) > 64:
            raise APIError(f"'metadata' keys may be at most 64 characters long (got {len(k)}).", param="metadata")
        if not isinstance(v, str) or len(v) > 512:
            raise APIError(f"metadata[{k!r:.70}] must be a string of at most 512 characters, got {v!r:.80}.",
                           param="metadata")


def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that generates this response (its structured output apart: text_format_spec), held to the
    chat request's bounds (limits.py: the number of messages, ...)."""
    fields = {name: getattr(req, name) for name in _SHARED}
    _check_metadata(req.metadata)
    mot = req.max_output_tokens  # checked here: the sampling checks would name chat's 'max_tokens'
    if mot is not None and not 1 <= mot < 2 ** 63:
        raise APIError(f"'max_output_tokens' must be an integer >= 1 (and below 2**63), got {mot}.",
                       param="max_output_tokens")
    try:
        chat = ChatCompletionRequest(messages=input_messages(req), max_tokens=req.max_output_tokens,
                                     tools=chat_tools(req.tools), tool_choice=chat_tool_choice(req.tool_choice),
                                     **fields)
    except ValidationError as e:  # (the fields were validated as the Responses request's: not expected)
        raise format_validation_error(e) from None
    limits.check_request_limits(chat)
    return chat
