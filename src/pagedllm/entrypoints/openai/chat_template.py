"""Chat messages -> prompt text and ids through the tokenizer's chat template (transformers)."""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Union

from pagedllm.entrypoints.openai.errors import APIError

# vLLM's chat_template_content_format: how a message's content reaches the template ("auto": as it reads it)
CONTENT_FORMATS = ("auto", "string", "openai")


# Text-like content parts and the key of their text, as vLLM reads them: the Responses API's input_text /
# output_text, and an assistant's refusal (OpenAI's assistant parts are text or refusal, so histories carry them).
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def _part_text(part: Any) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    key = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
    if key is None and isinstance(part, dict) and kind is None:  # (once "content of type None")
        raise APIError(f"A message content part needs a 'type' ('text' for text), got an object with keys "
                       f"{sorted(part)[:8]}.", param="messages")
    if key is None:
        shape = "" if isinstance(part, dict) else \
            f" (a part is an object such as {{'type': 'text', 'text': ...}}, got a {type(part).__name__})"
        raise APIError(f"Message content of type {kind!r} is not supported yet; only 'text' parts are{shape}.",
                       param="messages")
    text = part.get(key)
    if not isinstance(text, str):
        raise APIError(f"A message content part of type {kind!r} needs a {key!r} string.", param="messages")
    return text


def message_text(content: Any) -> str:
    """OpenAI content is a string or a list of parts; only text parts are supported."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join([_part_text(part) for part in content])


def check_content_format(value: Any, name: str = "chat_template_content_format") -> str:
    if not isinstance(value, str) or value not in CONTENT_FORMATS:
        raise ValueError(f"{name} must be 'auto', 'string' or 'openai', got {value!r}.")
    return value


def resolve_content_format(given: str, template: Any) -> str:
    """'string' or 'openai': the one given, or for "auto" the one the template reads (detect_content_format)."""
    if given != "auto":
        return given
    return detect_content_format(template) if isinstance(template, str) else "string"


def message_content(content: Any, content_format: str) -> Union[str, list[dict]]:
    """A message's content as the template gets it: "string": one string, text parts joined by newlines
    (message_text); "openai": a list of {"type": "text", "text": ...} parts, a string being one part (vLLM's)."""
    text = message_text(content)  # (the same parts are refused in both formats)
    if content_format == "string":
        return text
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [{"type": "text", "text": _part_text(part)} for part in content]


def with_content_format(conv: list[dict], content_format: str) -> list[dict]:
    """"openai": string contents (those the tool-call rewriting made) as one text part each."""
    if content_format != "openai":
        return conv
    return [dict(m, content=[{"type": "text", "text": m["content"]}]) if isinstance(m.get("content"), str) else m
            for m in conv]


@functools.lru_cache(maxsize=32)
def detect_content_format(template: str) -> str:
    """vLLM's "auto": "openai" when the template loops over a message's content (so it reads a list of parts),
    else "string" (also for a template that does not parse: applying it says why). The loops are found in the
    template's syntax tree: loops over `messages` (or names set from it, slices and filters of it) give the
    message variables; a loop over one's `content` (or over a variable named `content`, as in a macro) is one."""
    import jinja2
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        tree = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"
    loops = [loop for loop in tree.find_all(nodes.For) if isinstance(loop.target, nodes.Name)]
    assigns = [a for a in tree.find_all(nodes.Assign) if isinstance(a.target, nodes.Name)]
    lists, items, contents = {"messages"}, set(), {"content"}
    grown = True
    while grown:  # names set from names found: to a fixed point (templates chain a few)
        before = len(lists) + len(items) + len(contents)
        for a in assigns:
            if _reads(a.node, lists):
                lists.add(a.target.name)
            elif _reads(a.node, items) or _element(a.node, lists):
                items.add(a.target.name)
            elif _field(a.node, items, "content") or _reads(a.node, contents):
                contents.add(a.target.name)
        items.update(loop.target.name for loop in loops if _reads(loop.iter, lists))
        grown = len(lists) + len(items) + len(contents) > before
    return "openai" if any(_field(loop.iter, items, "content") or _reads(loop.iter, contents) for loop in loops) \
        else "string"


def _base(node: Any) -> Any:
    """What a filter, a test or a slice is applied to, down to the expression it reads."""
    from jinja2 import nodes

    while True:
        if isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        else:
            return node


def _reads(node: Any, names: set) -> bool:
    from jinja2 import nodes

    node = _base(node)
    return isinstance(node, nodes.Name) and node.name in names


def _element(node: Any, names: set) -> bool:
    """names[i]"""
    from jinja2 import nodes

    node = _base(node)
    return isinstance(node, nodes.Getitem) and _reads(node.node, names)


def _field(node: Any, names: set, key: str) -> bool:
    """name[key] or name.key"""
    from jinja2 import nodes

    node = _base(node)
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == key and _reads(node.node, names)
    return isinstance(node, nodes.Getattr) and node.attr == key and _reads(node.node, names)


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
                prepare_tools: Optional[Callable[[list[dict]], tuple[list[dict], Optional[list]]]] = None,
                content_format: str = "auto", documents: Optional[list[dict]] = None) -> tuple[str, list[int]]:
    """prepare_tools (tool calling): conversation -> (conversation, tools for the template); content_format:
    --chat-template-content-format; documents: the request's (vLLM's RAG field), the template's `documents`."""
    if not messages:
        raise APIError("'messages' must contain at least one message.", param="messages")
    content_format = resolve_content_format(content_format, chat_template or getattr(tokenizer, "chat_template", None))
    conv = []
    for msg in messages:
        item = {"role": msg.role, "content": message_content(msg.content, content_format)}
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
        conv = with_content_format(conv, content_format)
    kwargs = dict(chat_template_kwargs or {})
    if tools and "tools" not in kwargs:
        kwargs["tools"] = tools
    if documents is not None and "documents" not in kwargs:
        kwargs["documents"] = documents
    # As vLLM, the request's chat_template_kwargs win over the named fields (they were "got multiple values");
    # what the call returns is the server's choice, and a template only comes through the checked field.
    add_generation_prompt = kwargs.pop("add_generation_prompt", add_generation_prompt)
    continue_final_message = kwargs.pop("continue_final_message", continue_final_message)
    fixed = sorted(set(kwargs) & {"conversation", "chat_template", "tokenize", "return_dict", "return_tensors",
                                  "return_assistant_tokens_mask", "padding", "truncation", "max_length"})
    conversation = sorted(set(kwargs) & {"messages", "conversations"})
    if conversation:  # the template's own names for the conversation (once a bare "got multiple values" 400)
        raise APIError(f"chat_template_kwargs may not set {conversation}: the template gets the conversation from "
                       "the request's 'messages'.", param="chat_template_kwargs")
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
