"""The chat endpoint's tool-calling glue: request -> ToolPlan (400s), the grammar of "required" / named choices onto
SamplingParams, and each choice's message / streamed deltas."""
from __future__ import annotations

from functools import partial
from typing import Any, Optional

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.tool_calling import (
    ToolPlan,
    ToolRequestError,
    extract_tool_calls,
    finish_reason_with_tools,
    plan_tools,
    prepare_conversation,
    tool_structured_outputs,
)
from pagedllm.entrypoints.openai.tool_streaming import ToolCallStreamer


def chat_template_source(tokenizer: Any, override: Optional[str]) -> Optional[str]:
    template = override or getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one, or the tool-use one if there is one
        template = template.get("tool_use") or template.get("default")
    return template if isinstance(template, str) else None


def plan_request_tools(req: Any, state: Any) -> tuple[ToolPlan, Any]:
    """(plan, the prepare_tools hook for render_chat)."""
    template = chat_template_source(state.tokenizer, req.chat_template)
    try:
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls,
                          getattr(state, "tool_call_parser", "auto"), template,
                          show_unused=not getattr(state, "exclude_tools_when_tool_choice_none", False))
    except ToolRequestError as e:
        raise APIError(str(e), param=e.param) from None
    return plan, partial(_prepare, plan=plan, template=template)


def _prepare(conv: list[dict], plan: ToolPlan, template: Optional[str]) -> tuple[list[dict], Optional[list]]:
    try:
        return prepare_conversation(conv, plan, template)
    except ToolRequestError as e:  # (a malformed tool call in the history)
        raise APIError(str(e), param=e.param) from None


def keep_tool_markers(params: Any, plan: ToolPlan, tokenizer: Any) -> None:
    """tool_choice "auto": a parser's start marker that is a special token ([TOOL_CALLS] of Mistral's tokenizers,
    <tool_call> where it is special) would be dropped from the text by skip_special_tokens, and the calls read as
    content; such requests keep special tokens (as vLLM's hermes / mistral parsers' adjust_request do)."""
    if plan.mode != "auto" or plan.parser is None or tokenizer is None or not params.skip_special_tokens:
        return
    for marker in plan.parser.start_markers:
        try:
            ids = tokenizer.encode(marker, add_special_tokens=False)
            dropped = marker not in tokenizer.decode(ids, skip_special_tokens=True)
        except Exception:  # noqa: BLE001 - a tokenizer that cannot say: keep the request as it is
            continue
        if dropped and marker in tokenizer.decode(ids, skip_special_tokens=False):
            params.skip_special_tokens = False
            return


def apply_tool_grammar(params: Any, plan: ToolPlan, tokenizer: Any = None) -> None:
    keep_tool_markers(params, plan, tokenizer)
    try:
        so = tool_structured_outputs(plan)
    except ValueError as e:  # the functions' parameters as a spec (e.g. an integer msgpack cannot carry)
        raise APIError(str(e), param="tools") from None
    if so is None:
        return
    if params.structured_outputs is not None:
        raise APIError(f"tool_choice {plan.mode!r} decides the output's format itself: it cannot be combined with "
                       "response_format / structured_outputs.", param="tool_choice")
    params.structured_outputs = so


def choice_message(plan: ToolPlan, text: str, finish_reason: Optional[str]) -> tuple[dict, Optional[str]]:
    """(the choice's message, its finish_reason) for a non-streamed response."""
    if not plan.active:
        return {"role": "assistant", "content": text}, finish_reason
    result = extract_tool_calls(plan, text, finish_reason)
    message: dict = {"role": "assistant", "content": result.content}
    if result.called:
        message["tool_calls"] = [c.to_openai() for c in result.tool_calls]
    return message, finish_reason_with_tools(result, finish_reason)


class ChoiceStreams:
    """One ToolCallStreamer per choice index (streaming only when tools are in play)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.streamers: dict[int, ToolCallStreamer] = {}
        self.held_logprobs: dict[int, list] = {}  # choice index -> logprobs of tokens whose text is held back

    def deltas(self, index: int, text: str, finish_reason: Optional[str]) -> tuple[list[dict], Optional[str]]:
        s = self.streamers.get(index)
        if s is None:
            s = self.streamers[index] = ToolCallStreamer(self.plan)
        out = s.feed(text)
        if finish_reason is None:
            return out, None
        last, reason = s.finish(finish_reason)
        return out + last, reason
