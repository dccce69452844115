"""Chat messages -> prompt text and ids through the tokenizer's chat template (transformers)."""
from __future__ import annotations

from typing import Any, Callable, Optional

from pagedllm.entrypoints.openai.errors import APIError


def message_text(content: Any) -> str:
    """OpenAI content is a string or a list of parts; only text parts are supported."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise APIError("A message content part of type 'text' needs a 'text' string.", param="messages")
            texts.append(text)
        else:
            raise APIError(f"Message content of type {kind!r} is not supported yet; only 'text' parts are.",
                           param="messages")
    return "\n".join(texts)


def check_request_template(template: Optional[str], state: Any) -> None:
    """A request's own chat template only where the server trusts them (--trust-request-chat-template)."""
    if template is not None and not getattr(state, "trust_request_chat_template", False):
        raise APIError("This server does not take chat templates in requests ('chat_template'): the model's own "
                       "template applies. (A server started with --trust-request-chat-template does.)",
                       param="chat_template")


def render_chat(tokenizer: Any, messages: list[Any], add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template: Optional[str] = None,
                chat_template_kwargs: Optional[dict] = None, add_special_tokens: bool = False,
                prepare_tools: Optional[Callable[[list[dict]], tuple[list[dict], Optional[list]]]] = None
                ) -> tuple[str, list[int]]:
    """prepare_tools (tool calling): conversation -> (conversation, tools for the template)."""
    if not messages:
        raise APIError("'messages' must contain at least one message.", param="messages")
    conv = []
    for msg in messages:
        item = {"role": msg.role, "content": message_text(msg.content)}
        if msg.name:
            item["name"] = msg.name
        if getattr(msg, "tool_calls", None):
            item["tool_calls"] = msg.tool_calls
        if getattr(msg, "tool_call_id", None):
            item["tool_call_id"] = msg.tool_call_id
        conv.append(item)
    tools = None
    if prepare_tools is not None:
        conv, tools = prepare_tools(conv)
    if tools:
        chat_template_kwargs = dict(chat_template_kwargs or {}, tools=tools)
    if continue_final_message and add_generation_prompt:
        raise APIError("continue_final_message and add_generation_prompt cannot both be true.",
                       param="continue_final_message")
    try:
        text = tokenizer.apply_chat_template(
            conv, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, chat_template=chat_template,
            **(chat_template_kwargs or {}))
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - template errors come from the request (roles, kwargs)
        raise APIError(f"Could not apply the chat template: {e}", param="messages")
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return text, list(ids)
