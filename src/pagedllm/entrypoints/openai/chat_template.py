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
            shape = "" if isinstance(part, dict) else \
                f" (a part is an object such as {{'type': 'text', 'text': ...}}, got a {type(part).__name__})"
            raise APIError(f"Message content of type {kind!r} is not supported yet; only 'text' parts are{shape}.",
                           param="messages")
    return "\n".join(texts)


def load_chat_template(value: Optional[str], from_command_line: bool = False) -> Optional[str]:
    """--chat-template (or LLM.chat's chat_template) -> the template text, as vLLM reads it: the contents of the
    file it names, else the string itself as a template (from the command line, with its backslash escapes such as
    a typed \\n decoded; non-ASCII text is kept). A string without any of "{", "}" or a newline cannot be a
    template, so a path that cannot be read is a ValueError, not a template that renders the path as every prompt;
    so is a template that does not parse (found now, not on the first request)."""
    import os

    if value is None:
        return None
    try:
        with open(os.path.expanduser(value), encoding="utf-8") as f:
            template = f.read()
        where = f"chat template file {value}"
    except (OSError, ValueError) as e:  # (ValueError: an embedded NUL, or not UTF-8)
        if not any(c in value for c in "{}\n"):
            raise ValueError(f"The chat template {value!r} looks like a file path, but it could not be read "
                             f"({type(e).__name__}: {e}).") from None
        template, where = value, "chat template"
        if from_command_line:  # (latin-1 + backslashreplace: unicode_escape alone would mangle UTF-8 text)
            template = value.encode("latin-1", "backslashreplace").decode("unicode_escape")
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:  # the environment transformers renders chat templates in
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"The {where} does not parse as a Jinja template: {e.message} (line {e.lineno}).") from None
    return template


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
        reasoning = getattr(msg, "reasoning_content", None) or getattr(msg, "reasoning", None)
        if reasoning:
            item["reasoning_content"] = reasoning
        conv.append(item)
    tools = None
    if prepare_tools is not None:
        conv, tools = prepare_tools(conv)
    kwargs = dict(chat_template_kwargs or {})
    if tools and "tools" not in kwargs:
        kwargs["tools"] = tools
    # As vLLM, the request's chat_template_kwargs win over the named fields (they were "got multiple values");
    # what the call returns is the server's choice, and a template only comes through the checked field.
    add_generation_prompt = kwargs.pop("add_generation_prompt", add_generation_prompt)
    continue_final_message = kwargs.pop("continue_final_message", continue_final_message)
    fixed = sorted(set(kwargs) & {"conversation", "chat_template", "tokenize", "return_dict", "return_tensors",
                                  "return_assistant_tokens_mask", "padding", "truncation", "max_length"})
    if fixed:
        raise APIError(f"chat_template_kwargs may not set {fixed}: give template variables only"
                       + (" (a template goes in 'chat_template')." if "chat_template" in fixed else "."),
                       param="chat_template_kwargs")
    if continue_final_message and add_generation_prompt:
        raise APIError("continue_final_message and add_generation_prompt cannot both be true.",
                       param="continue_final_message")
    try:
        text = tokenizer.apply_chat_template(
            conv, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, chat_template=chat_template, **kwargs)
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - template errors come from the request (roles, kwargs)
        raise APIError(f"Could not apply the chat template: {e}", param="messages")
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return text, list(ids)
