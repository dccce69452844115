"""POST /v1/chat/completions: messages -> the model's chat template -> generation; SSE streaming."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.body import parse_body, render_work
from pagedllm.entrypoints.openai.chat_template import check_request_template, message_text, render_chat
from pagedllm.entrypoints.openai.chat_tools import (ChoiceStreams, apply_tool_grammar, choice_message,
                                                    plan_request_tools)
from pagedllm.entrypoints.openai.errors import APIError, dumps
from pagedllm.entrypoints.openai.logprobs import iter_logprobs, prompt_logprobs_json, safe_float, token_bytes
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.reasoning import ChoiceReasoning, request_reasoning
from pagedllm.entrypoints.openai.request_params import (build_sampling_params, check_context_length,
                                                        check_logprob_fields, context_max_tokens, data_parallel_rank,
                                                        request_cache_salt, request_ids, request_priority,
                                                        truncate_prompt)
from pagedllm.entrypoints.openai.server_state import ServerState
from pagedllm.entrypoints.openai.streaming import (CachedTokens, ChunkFramer, SSEResponse, SSEStream, first_output,
                                                   last_output, usage_dict)
from pagedllm.entrypoints.openai.tool_calling import ToolPlan


async def create_chat_completion(request: Request, state: ServerState) -> Response:
    req = await parse_body(request, ChatCompletionRequest)
    model = state.check_model(req.model)
    if req.return_tokens_as_token_ids is None:  # --return-tokens-as-token-ids: the server's default
        req.return_tokens_as_token_ids = state.return_tokens_as_token_ids
    salt = request_cache_salt(req)
    priority = request_priority(req, state.scheduling_policy)
    engine = state.engine
    if req.top_logprobs and not req.logprobs:  # (0 asks for nothing: accepted without logprobs, as vLLM does)
        raise APIError("When using 'top_logprobs', 'logprobs' must be set to true.", param="top_logprobs")
    check_logprob_fields(req, state.max_logprobs, top_name="top_logprobs", top=req.top_logprobs,
                         vocab_size=engine.ready.vocab_size)
    check_request_template(req.chat_template, state)
    tool_plan, prepare_tools = plan_request_tools(req, state)
    prompt_text, prompt_ids = await render_work(
        request, req, render_chat, state.tokenizer, req.messages, req.add_generation_prompt,
        req.continue_final_message, req.chat_template, req.chat_template_kwargs, req.add_special_tokens,
        prepare_tools=prepare_tools, content_format=state.chat_template_content_format, documents=req.documents)
    if req.truncate_prompt_tokens is not None:
        kept = truncate_prompt(prompt_ids, req.truncate_prompt_tokens, state.max_model_len)
        if len(kept) < len(prompt_ids):
            prompt_text, prompt_ids = None, kept
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    request_id, engine_id = request_ids(request, "chatcmpl", req.request_id)
    if req.best_of is not None and req.best_of != req.n and not req.use_beam_search:
        raise APIError("'best_of' other than n is only supported with use_beam_search.", param="best_of")
    if req.use_beam_search:
        from pagedllm.beam_search.driver import ClientDisconnected
        from pagedllm.entrypoints.openai import beam_search

        room = max(1, state.max_model_len - len(prompt_ids))
        # a silent request: the generation config's max_new_tokens (as the sampling path's), clamped to the room
        beam_max = max_tokens if max_tokens is not None else min(room, (state.sampling_defaults or {}).get(
            "max_tokens", room))
        check_context_length(len(prompt_ids), beam_max, state.max_model_len)
        # (the beams' think blocks are split off as the sampling path's answers are: vLLM parses both alike)
        reasoning = request_reasoning(state, None, prompt_text, prompt_ids, bool(req.include_reasoning))
        try:
            body = await beam_search.chat_response(req, state, model, request_id,
                                                   int(time.time()), prompt_ids, beam_max, request.is_disconnected,
                                                   salt, priority, response_role(req, state),
                                                   data_parallel_rank(request, engine), reasoning)
        except ClientDisconnected:  # the client left mid-search: nobody reads an answer
            return Response(status_code=499)
        return Response(dumps(body), media_type="application/json")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = build_sampling_params(req, max_tokens, logprobs, req.prompt_logprobs, state.sampling_defaults)
    apply_tool_grammar(params, tool_plan, state.tokenizer)
    check_context_length(len(prompt_ids), context_max_tokens(max_tokens, params, state.sampling_defaults),
                         state.max_model_len)
    reasoning = request_reasoning(state, params, prompt_text, prompt_ids, bool(req.include_reasoning))
    stream = bool(req.stream)
    # A stream takes each engine step's output as it comes (batches: what arrived while it was writing).
    generate = engine.generate_batches if stream else engine.generate
    gen = generate(prompt_text, prompt_ids, params, engine_id, output_kind="delta" if stream else "final_only",
                   lora_request=state.lora_request(model), cache_salt=salt, priority=priority,
                   data_parallel_rank=data_parallel_rank(request, engine))
    created = int(time.time())
    first, watch = await first_output(request, engine, gen, [engine_id])
    if stream:
        framer = ChunkFramer(request_id, "chat.completion.chunk", created, model, req.stream_options,
                             state.force_include_usage)
        return SSEResponse(_ChatStream(req, state, prompt_ids, gen, first, watch, framer, tool_plan, engine_id,
                                       reasoning))
    final = await last_output(gen, first, watch)
    return Response(dumps(_full_response(req, state, model, request_id, created, prompt_ids, final, tool_plan,
                                         reasoning)), media_type="application/json")



def _chat_logprobs(tok: Any, token_ids: list[int], logprobs: Optional[list], top_n: int, as_ids: bool = False
                   ) -> dict:
    """`as_ids`: tokens as "token_id:<id>" (vLLM's return_tokens_as_token_ids; `bytes` encode that string, as
    vLLM's do)."""
    content = []
    for tid, s, lp, tops in iter_logprobs(tok, list(token_ids), logprobs, as_ids, with_ids=True):
        top_items = [{"token": ts, "logprob": safe_float(tl), "bytes": token_bytes(tok, top_id, ts)}
                     for top_id, ts, tl, rank in tops if rank is None or rank <= top_n][:top_n]
        content.append({"token": s, "logprob": safe_float(lp), "bytes": token_bytes(tok, tid, s),
                        "top_logprobs": top_items})
    return {"content": content}


def response_role(req: ChatCompletionRequest, state: ServerState) -> str:
    """vLLM's role of the answer: --response-role after a generation prompt, else the last message's (the text
    continues that message)."""
    return state.response_role if req.add_generation_prompt or not req.messages else req.messages[-1].role


def _echo_text(req: ChatCompletionRequest, role: str) -> str:
    """vLLM's chat `echo`: the last message's content goes before the answer when it has the answer's role
    (the message being continued); otherwise there is nothing to echo."""
    if not req.echo or not req.messages or req.messages[-1].role != role:
        return ""
    return message_text(req.messages[-1].content)


def _full_response(req: ChatCompletionRequest, state: ServerState, model: str, request_id: str, created: int,
                   prompt_ids: list[int], final: Any, tool_plan: ToolPlan,
                   reasoning: Optional[ChoiceReasoning] = None) -> dict:
    choices = []
    num_gen = 0
    role = response_role(req, state)
    echo = _echo_text(req, role)
    for out in sorted(final.outputs, key=lambda o: o.index):
        num_gen += len(out.token_ids)
        lp = _chat_logprobs(state.tokenizer, out.token_ids, out.logprobs, req.top_logprobs or 0,
                            bool(req.return_tokens_as_token_ids)) if req.logprobs else None
        # The echo is content ahead of the answer, never parsed for calls: the stream sends it before the streamer.
        text, thought = out.text, None
        if reasoning is not None:  # the reasoning first; calls are read from the content after it
            thought, text = reasoning.split(out.text)
        message, finish_reason = choice_message(tool_plan, text or "", out.finish_reason)
        message["role"] = role
        if text is None and not message.get("tool_calls"):
            message["content"] = None
        if echo:
            message["content"] = echo + (message["content"] or "")
        if reasoning is not None:
            message.update(reasoning.fields(thought if reasoning.include else None))
        choice = {"index": out.index, "message": message,
                  "logprobs": lp, "finish_reason": finish_reason, "stop_reason": out.stop_reason}
        if req.return_token_ids:
            choice["token_ids"] = list(out.token_ids)
        choices.append(choice)
    cached = CachedTokens(state.prompt_tokens_details)
    cached.note(0, final)
    body = {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage_dict(len(prompt_ids), num_gen, cached.total())}
    if req.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_json(state.tokenizer, final.prompt_logprobs)
    if req.return_token_ids:  # vLLM: on the response (one prompt for every choice)
        body["prompt_token_ids"] = list(prompt_ids)
    return body


class _ChatStream(SSEStream):
    """The SSE chunks of a streamed chat completion: the role first (and the echo), then one chunk per choice
    per engine step."""

    def __init__(self, req: ChatCompletionRequest, state: ServerState, prompt_ids: list[int], batches: AsyncIterator,
                 first: Any, watch: Any, framer: ChunkFramer, tool_plan: ToolPlan, engine_id: str,
                 reasoning: Optional[ChoiceReasoning] = None) -> None:
        super().__init__(batches, first, watch, framer)
        self.req, self.tok, self.num_prompt, self.num_gen = req, state.tokenizer, len(prompt_ids), 0
        self.choice_gen = [0] * req.n  # each choice's tokens so far: vLLM's continuous usage is the choice's own
        self.prompt_ids = prompt_ids
        self.top_n = req.top_logprobs or 0
        self.tool_streams = ChoiceStreams(tool_plan) if tool_plan.active else None
        # return_token_ids: each chunk's token_ids; those of tokens a tool parser holds back wait for its next chunk.
        self.token_ids = bool(req.return_token_ids)
        self.held_ids: dict[int, list[int]] = {}
        self.reasoning = reasoning
        self.role = response_role(req, state)
        # A running choice of a plain stream (no logprobs, tools, token ids or reasoning) is a template and its text.
        self.cached = CachedTokens(state.prompt_tokens_details)
        self.plain = (not req.logprobs and self.tool_streams is None and not self.token_ids and reasoning is None
                      and not (self.cached.enabled and framer.continuous_usage))  # (its template has no details)
        self.templates = [framer.template(b'{"index":%d,"delta":{"content":' % i, b"}") for i in range(req.n)]
        if self.plain and req.n == 1:
            self.direct = (state.engine, engine_id)

    def usage(self) -> dict:
        return usage_dict(self.num_prompt, self.num_gen, self.cached.total())

    def frame(self, choice: dict) -> bytes:
        if not self.framer.continuous_usage:
            return self.framer.choices([choice])
        return self.framer.choices([choice], usage_dict(self.num_prompt, self.choice_gen[choice["index"]],
                                                        self.cached.total()))

    def prefix(self) -> bytes:
        """The role goes first, in its own delta, once per choice (as OpenAI does)."""
        echo = _echo_text(self.req, self.role)
        frames = []
        for i in range(self.req.n):
            role = {"index": i, "delta": {"role": self.role, "content": ""}, "logprobs": None, "finish_reason": None}
            if self.token_ids and i == 0:  # vLLM: the prompt's ids on the stream's first chunk, at its top level
                usage = usage_dict(self.num_prompt, 0, self.cached.total()) if self.framer.continuous_usage else None
                frames.append(self.framer.choices([role], usage, b',"prompt_token_ids":' + dumps(self.prompt_ids)))
            else:
                frames.append(self.frame(role))
            if echo:
                frames.append(self.frame({"index": i, "delta": {"content": echo}, "logprobs": None,
                                          "finish_reason": None}))
        return b"".join(frames)

    def frames(self, batch: list) -> bytes:
        if len(batch) == 1:
            return self.chunks(batch[0])
        return b"".join([self.chunks(ro) for ro in batch])

    def chunks(self, ro: Any) -> bytes:
        """The frames of one engine step's output (one per choice that has news; tool calls may add some)."""
        frames = []
        self.cached.note(0, ro)
        for out in ro.outputs:
            self.num_gen += len(out.token_ids)
            self.choice_gen[out.index] += len(out.token_ids)
            if not out.text and out.finish_reason is None and not out.token_ids:
                continue
            if self.plain and out.finish_reason is None:
                before, after = self.templates[out.index]
                frames.append(before + dumps(out.text) + after
                              + self.framer.end(self.num_prompt, self.choice_gen[out.index]))
                continue
            lp = _chat_logprobs(self.tok, out.token_ids, out.logprobs, self.top_n,
                                bool(self.req.return_tokens_as_token_ids)) if self.req.logprobs else None
            ids = None
            if self.token_ids:
                ids = self.held_ids.pop(out.index, []) + list(out.token_ids)
            if self.reasoning is not None:
                thought, text = self.reasoning.feed(out.index, out.text, out.finish_reason is not None)
                if thought and self.reasoning.include:  # the reasoning's delta carries the step's logprobs and ids
                    choice = {"index": out.index, "delta": self.reasoning.fields(thought), "logprobs": lp,
                              "finish_reason": None}
                    if ids is not None:
                        choice["token_ids"] = ids
                    frames.append(self.frame(choice))
                    lp, ids = None, ([] if ids is not None else None)
                if not text and out.finish_reason is None and lp is None and not ids:
                    continue  # nothing of the answer yet (held back, or reasoning only)
                out = dataclasses.replace(out, text=text)
            if self.tool_streams is not None:
                tool_frames = _tool_frames(self.frame, self.tool_streams, out, lp, ids)
                if ids is not None and not tool_frames:
                    self.held_ids[out.index] = ids
                frames += tool_frames
                continue
            delta = {"content": out.text} if out.text or out.finish_reason is None else {}
            choice = {"index": out.index, "delta": delta, "logprobs": lp, "finish_reason": out.finish_reason,
                      "stop_reason": out.stop_reason}
            if ids is not None:
                choice["token_ids"] = ids
            frames.append(self.frame(choice))
        return frames[0] if len(frames) == 1 else b"".join(frames)


def _tool_frames(frame: Any, streams: ChoiceStreams, out: Any, lp: Any, ids: Optional[list[int]] = None
                 ) -> list[bytes]:
    """A choice's chunk with tools in play: content held back where a call may start, calls as tool_calls deltas.
    ids (return_token_ids): go out on the first frame; with no frame the caller keeps them for the next."""
    deltas, finish_reason = streams.deltas(out.index, out.text, out.finish_reason)
    if lp is not None:
        # The logprobs of tokens held back (a call may be starting) go out with the next chunk sent, so the stream
        # carries every token's, as the full response does.
        held = streams.held_logprobs.pop(out.index, None)
        if held:
            lp = {"content": held + lp["content"]}
        if not deltas and out.finish_reason is None:
            streams.held_logprobs[out.index] = lp["content"]
            lp = None
    choices = [{"index": out.index, "delta": d, "logprobs": lp if i == 0 else None, "finish_reason": None}
               for i, d in enumerate(deltas)]
    if out.finish_reason is not None:
        choices.append({"index": out.index, "delta": {}, "logprobs": None if deltas else lp,
                        "finish_reason": finish_reason, "stop_reason": out.stop_reason})
    if ids is not None:
        for i, choice in enumerate(choices):
            choice["token_ids"] = ids if i == 0 else []
    return [frame(choice) for choice in choices]
