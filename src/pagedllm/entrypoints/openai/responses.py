"""POST /v1/responses (OpenAI's Responses API, as vLLM serves it): the request becomes a chat request
(responses_protocol.py) and runs the chat path's helpers (template, tools, sampling, structured outputs); the answer
is a response object with output items, or its SSE events (`event:` + `data:`, each with a sequence_number)."""
from __future__ import annotations

import re
import time
import uuid
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.body import parse_body, render_work
from pagedllm.entrypoints.openai.chat_template import render_chat
from pagedllm.entrypoints.openai.chat_tools import ChoiceStreams, apply_tool_grammar, choice_message, \
    plan_request_tools
from pagedllm.entrypoints.openai.errors import APIError, dumps
from pagedllm.entrypoints.openai.request_params import build_sampling_params, check_context_length, \
    context_max_tokens, data_parallel_rank, request_cache_salt, request_priority
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest, check_refused, text_format_spec, \
    to_chat_request
from pagedllm.entrypoints.openai.server_state import ServerState
from pagedllm.entrypoints.openai.streaming import SSEResponse, SSEStream, first_output, last_output
from pagedllm.entrypoints.openai.reasoning import ChoiceReasoning, request_reasoning
from pagedllm.entrypoints.openai.tool_calling import ToolPlan


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# The chat path's tool errors name chat's nested tools[i].function.X; the client sent the flat tools[i].X.
_NESTED_TOOL_FIELD = re.compile(r"(tools\[\d+\])\.function\.")


def flat_tool_names(e: APIError) -> APIError:
    e.message = _NESTED_TOOL_FIELD.sub(r"\1.", e.message)
    if e.param:
        e.param = _NESTED_TOOL_FIELD.sub(r"\1.", e.param)
    return e


async def create_response(request: Request, state: ServerState) -> Response:
    try:
        return await _create_response(request, state)
    except APIError as e:
        raise flat_tool_names(e) from None


async def _create_response(request: Request, state: ServerState) -> Response:
    req = await parse_body(request, ResponsesRequest)
    check_refused(req)
    model = state.check_model(req.model)
    chat = to_chat_request(req)
    salt, priority = request_cache_salt(chat), request_priority(chat, state.scheduling_policy)
    spec = text_format_spec(req.text)
    tool_plan, prepare_tools = plan_request_tools(chat, state)
    prompt_text, prompt_ids = await render_work(request, chat, render_chat, state.tokenizer, chat.messages, True,
                                                False, None, None, False, prepare_tools=prepare_tools,
                                                content_format=state.chat_template_content_format)
    params = build_sampling_params(chat, chat.max_tokens, None, None, state.sampling_defaults)
    params.structured_outputs = spec
    apply_tool_grammar(params, tool_plan, state.tokenizer)
    check_context_length(len(prompt_ids), context_max_tokens(chat.max_tokens, params, state.sampling_defaults),
                         state.max_model_len, "input", "max_output_tokens")
    reasoning = request_reasoning(state, params, prompt_text, prompt_ids)
    request_id = req.request_id or _id("resp")
    # A client's id may be another running request's: the engine's adds random characters, as vLLM's does.
    engine_id = request_id if req.request_id is None else f"{request_id}-{uuid.uuid4().hex[:8]}"
    stream = bool(req.stream)
    generate = state.engine.generate_batches if stream else state.engine.generate
    gen = generate(prompt_text, prompt_ids, params, engine_id, output_kind="delta" if stream else "final_only",
                   lora_request=state.lora_request(model), cache_salt=salt, priority=priority,
                   data_parallel_rank=data_parallel_rank(request, state.engine))
    shell = _ResponseShell(req, model, request_id, int(time.time()), len(prompt_ids), state.tokenizer)
    first, watch = await first_output(request, state.engine, gen, [engine_id])
    if stream:
        return SSEResponse(_ResponsesStream(gen, first, watch, shell, tool_plan, reasoning))
    final = await last_output(gen, first, watch)
    out = final.outputs[0]
    thought, text = (None, out.text) if reasoning is None else reasoning.split(out.text)
    message, _ = choice_message(tool_plan, text or "", out.finish_reason)
    items = []
    status = "incomplete" if out.finish_reason == "length" else "completed"
    if thought is not None:  # the reasoning item first, as OpenAI's reasoning models answer
        items.append(_reasoning_item(_id("rs"), thought, "completed" if text is not None else status))
        shell.reasoning_text = thought
        if text is None and not message.get("tool_calls"):
            message["content"] = None
    calls = message.get("tool_calls") or []
    if message["content"] is not None and (message["content"] or not (calls or items)):
        items.append(_message_item(_id("msg"), message["content"], "completed" if calls else status))
    for i, c in enumerate(calls):  # only the last call can have been cut short (as the stream closes them)
        items.append(_call_item(_id("fc"), c["id"], c["function"]["name"], c["function"]["arguments"],
                                status if i == len(calls) - 1 else "completed"))
    body = shell.body(status, items, len(out.token_ids), final.num_cached_tokens)
    return Response(dumps(body), media_type="application/json")


def _message_item(item_id: str, text: Optional[str], status: str) -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _reasoning_item(item_id: str, text: Optional[str], status: str) -> dict:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "encrypted_content": None,
            "status": status}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


class _ResponseShell:
    """The response object around its output: the request's settings echoed, the usage."""

    def __init__(self, req: ResponsesRequest, model: str, response_id: str, created: int, num_prompt: int,
                 tokenizer: Any = None) -> None:
        self.req, self.model, self.id, self.created, self.num_prompt = req, model, response_id, created, num_prompt
        self.tokenizer = tokenizer
        self.reasoning_text: Optional[str] = None  # the answer's reasoning (--reasoning-parser), for its usage

    def reasoning_tokens(self) -> int:
        """The reasoning's length in tokens (its text re-encoded: the split is made on text)."""
        if not self.reasoning_text or self.tokenizer is None:
            return 0
        return len(self.tokenizer.encode(self.reasoning_text, add_special_tokens=False))

    def body(self, status: str, output: list, num_gen: Optional[int] = None, cached: Optional[int] = None) -> dict:
        req = self.req
        usage = None
        if num_gen is not None:
            usage = {"input_tokens": self.num_prompt, "input_tokens_details": {"cached_tokens": cached or 0},
                     "output_tokens": num_gen, "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens()},
                     "total_tokens": self.num_prompt + num_gen}
        return {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model, "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": req.temperature, "top_p": req.top_p,
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": req.tools or [],
            # OpenAI's echo always has text.format (its default plain text), also beside a sent verbosity
            "text": {**(req.text or {}), "format": (req.text or {}).get("format") or {"type": "text"}},
            "previous_response_id": None, "reasoning": None, "store": req.store is not False,
            "truncation": req.truncation or "disabled", "background": False, "user": req.user, "usage": usage,
        }


class _ResponsesStream(SSEStream):
    """A streamed response's events. The message item opens at the first text; a tool call (as the chat stream's
    tool deltas find it) closes an open message item and streams as a function_call item; the final event carries
    the whole response, built from what was streamed. vLLM's way: response.completed ends every stream that did not
    fail, its response's status saying whether it is incomplete (the SDK's stream helpers wait for that event)."""

    def __init__(self, batches: AsyncIterator, first: Any, watch: Any, shell: _ResponseShell,
                 tool_plan: ToolPlan, reasoning: Optional[ChoiceReasoning] = None) -> None:
        super().__init__(batches, first, watch, None)
        self.shell = shell
        self.tool_streams = ChoiceStreams(tool_plan) if tool_plan.active else None
        self.reasoning = reasoning
        self.thinking: Optional[dict] = None  # the open reasoning item
        self.seq = 0
        self.num_gen = 0
        self.cached: Optional[int] = None
        self.output: list[dict] = []  # finished items
        self.message: Optional[dict] = None  # the open message item
        self.call: Optional[dict] = None  # the open function_call item

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + dumps(data) + b"\n\n"

    def prefix(self) -> bytes:
        body = self.shell.body("in_progress", [])
        return self.event("response.created", response=body) + self.event("response.in_progress", response=body)

    def frames(self, batch: list) -> bytes:
        frames: list[bytes] = []
        for ro in batch:
            out = ro.outputs[0]
            self.num_gen += len(out.token_ids)
            if ro.num_cached_tokens is not None:
                self.cached = ro.num_cached_tokens
            text = out.text
            if self.reasoning is not None:
                thought, text = self.reasoning.feed(0, text, out.finish_reason is not None)
                if thought:
                    self.thought(frames, thought)
                if text:
                    self.close_thinking(frames, "completed")
            if self.tool_streams is None:
                if text:
                    self.text(frames, text)
            else:
                deltas, _ = self.tool_streams.deltas(0, text, out.finish_reason)
                for d in deltas:
                    if d.get("content"):
                        self.text(frames, d["content"])
                    for tc in d.get("tool_calls") or ():
                        self.call_delta(frames, tc)
            if out.finish_reason is not None:
                self.finish(frames, "incomplete" if out.finish_reason == "length" else "completed")
        return b"".join(frames)

    def thought(self, frames: list, delta: str) -> None:
        if self.thinking is None:
            self.thinking = _reasoning_item(_id("rs"), None, "in_progress")
            index = len(self.output)
            frames.append(self.event("response.output_item.added", output_index=index, item=dict(self.thinking)))
            self.thinking["content"] = [{"type": "reasoning_text", "text": ""}]
            frames.append(self.event("response.content_part.added", item_id=self.thinking["id"],
                                     output_index=index, content_index=0, part=self.thinking["content"][0]))
        self.thinking["content"][0]["text"] += delta
        frames.append(self.event("response.reasoning_text.delta", item_id=self.thinking["id"],
                                 output_index=len(self.output), content_index=0, delta=delta))

    def close_thinking(self, frames: list, status: str) -> None:
        item, self.thinking = self.thinking, None
        if item is None:
            return
        index, part = len(self.output), item["content"][0]
        self.shell.reasoning_text = part["text"]
        frames.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                 content_index=0, text=part["text"]))
        frames.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                 content_index=0, part=part))
        item["status"] = status
        frames.append(self.event("response.output_item.done", output_index=index, item=item))
        self.output.append(item)

    def open_message(self, frames: list) -> None:
        self.close_thinking(frames, "completed")
        self.close_call(frames, "completed")
        self.message = _message_item(_id("msg"), None, "in_progress")
        index = len(self.output)
        frames.append(self.event("response.output_item.added", output_index=index, item=self.message))
        self.message["content"] = [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]
        frames.append(self.event("response.content_part.added", item_id=self.message["id"], output_index=index,
                                 content_index=0, part=self.message["content"][0]))

    def text(self, frames: list, delta: str) -> None:
        if self.message is None:
            self.open_message(frames)
        self.message["content"][0]["text"] += delta
        frames.append(self.event("response.output_text.delta", item_id=self.message["id"],
                                 output_index=len(self.output), content_index=0, delta=delta, logprobs=[]))

    def close_message(self, frames: list, status: str) -> None:
        item, self.message = self.message, None
        if item is None:
            return
        index, part = len(self.output), item["content"][0]
        frames.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                 content_index=0, text=part["text"], logprobs=[]))
        frames.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                 content_index=0, part=part))
        item["status"] = status
        frames.append(self.event("response.output_item.done", output_index=index, item=item))
        self.output.append(item)

    def call_delta(self, frames: list, tc: dict) -> None:
        """A chat tool-call delta: one with an id starts a call, the others add to its arguments."""
        fn = tc.get("function") or {}
        if tc.get("id") is not None:
            self.close_thinking(frames, "completed")
            self.close_message(frames, "completed")
            self.close_call(frames, "completed")
            self.call = _call_item(_id("fc"), tc["id"], fn.get("name"), "", "in_progress")
            frames.append(self.event("response.output_item.added", output_index=len(self.output),
                                     item=dict(self.call)))
        args = fn.get("arguments")
        if args and self.call is not None:
            self.call["arguments"] += args
            frames.append(self.event("response.function_call_arguments.delta", item_id=self.call["id"],
                                     output_index=len(self.output), delta=args))

    def close_call(self, frames: list, status: str) -> None:
        item, self.call = self.call, None
        if item is None:
            return
        index = len(self.output)
        frames.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                 arguments=item["arguments"]))
        item["status"] = status
        frames.append(self.event("response.output_item.done", output_index=index, item=item))
        self.output.append(item)

    def finish(self, frames: list, status: str) -> None:
        self.close_thinking(frames, status)
        if self.message is None and self.call is None and not self.output:
            self.open_message(frames)  # no text, reasoning or call: an empty message, as the full response has
        self.close_message(frames, status)
        self.close_call(frames, status)
        body = self.shell.body(status, self.output, self.num_gen, self.cached)
        frames.append(self.event("response.completed", response=body))

    def tail(self, error: Optional[BaseException]) -> bytes:
        # No [DONE]: the Responses API's stream ends with its last event.
        if error is None:
            return b""
        status = getattr(error, "status", 500)
        message = flat_tool_names(error).message if isinstance(error, APIError) else str(error)
        return self.event("error", code=str(status), message=message, param=getattr(error, "param", None))

    def usage(self) -> dict:  # (SSEStream's; the usage travels in the final response)
        return {}
