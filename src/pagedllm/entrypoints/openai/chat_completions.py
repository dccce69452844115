"""POST /v1/chat/completions: messages -> the model's chat template -> generation; SSE streaming."""
from __future__ import annotations

import time
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from pagedllm.entrypoints.openai import common as c
from pagedllm.entrypoints.openai.completions import from_stream_error
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, random_id


async def create_chat_completion(request: Request, state: c.ServerState) -> Response:
    req = await c.parse_body(request, ChatCompletionRequest)
    model = state.check_model(req.model)
    engine = state.engine
    if req.top_logprobs is not None and not req.logprobs:
        raise c.APIError("When using 'top_logprobs', 'logprobs' must be set to true.", param="top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise c.APIError(f"top_logprobs must be between 0 and 20, got {req.top_logprobs}.", param="top_logprobs")
    prompt_text, prompt_ids = c.render_chat(
        state.tokenizer, req.messages, req.add_generation_prompt, req.continue_final_message,
        req.chat_template, req.chat_template_kwargs, req.add_special_tokens)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if req.best_of is not None and req.best_of != req.n and not req.use_beam_search:
        raise c.APIError("'best_of' other than n is only supported with use_beam_search.", param="best_of")
    if req.use_beam_search:
        from pagedllm.entrypoints.openai import beam_search

        beam_max = max_tokens if max_tokens is not None else max(1, state.max_model_len - len(prompt_ids))
        c.check_context_length(len(prompt_ids), beam_max, state.max_model_len)
        body = await beam_search.chat_response(req, state, model, req.request_id or random_id("chatcmpl"),
                                               int(time.time()), prompt_ids, beam_max)
        return Response(c.dumps(body), media_type="application/json")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = c.build_sampling_params(req, max_tokens, logprobs)
    c.check_context_length(len(prompt_ids), params.max_tokens, state.max_model_len)
    request_id = req.request_id or random_id("chatcmpl")
    stream = bool(req.stream)
    gen = engine.generate(prompt_text, prompt_ids, params, request_id, output_kind="delta" if stream else "final_only")
    watch = c.start_disconnect_watch(request, engine, [request_id])
    created = int(time.time())
    try:
        first = await gen.__anext__()
    except BaseException:
        watch.cancel()
        await gen.aclose()
        raise
    if stream:
        body = _stream(req, state, model, request_id, created, len(prompt_ids), first, gen, watch)
        return StreamingResponse(body, media_type="text/event-stream")
    final = first
    try:
        async for out in gen:
            final = out
    finally:
        watch.cancel()
    return Response(c.dumps(_full_response(req, state, model, request_id, created, len(prompt_ids), final)),
                    media_type="application/json")


def _chat_logprobs(tok: Any, token_ids: list[int], logprobs: Optional[list], top_n: int) -> dict:
    content = []
    for s, lp, tops in c.iter_logprobs(tok, list(token_ids), logprobs):
        top_items = [{"token": ts, "logprob": c.safe_float(tl), "bytes": list(ts.encode("utf-8"))}
                     for ts, tl, rank in tops if rank is None or rank <= top_n][:top_n]
        content.append({"token": s, "logprob": c.safe_float(lp), "bytes": list(s.encode("utf-8")),
                        "top_logprobs": top_items})
    return {"content": content}


def _full_response(req: ChatCompletionRequest, state: c.ServerState, model: str, request_id: str, created: int,
                   num_prompt: int, final: Any) -> dict:
    choices = []
    num_gen = 0
    for out in sorted(final.outputs, key=lambda o: o.index):
        num_gen += len(out.token_ids)
        lp = _chat_logprobs(state.tokenizer, out.token_ids, out.logprobs, req.top_logprobs or 0) \
            if req.logprobs else None
        choices.append({"index": out.index, "message": {"role": "assistant", "content": out.text},
                        "logprobs": lp, "finish_reason": out.finish_reason, "stop_reason": out.stop_reason})
    usage = {"prompt_tokens": num_prompt, "completion_tokens": num_gen, "total_tokens": num_prompt + num_gen}
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage}


async def _stream(req: ChatCompletionRequest, state: c.ServerState, model: str, request_id: str, created: int,
                  num_prompt: int, first: Any, gen: AsyncIterator, watch: Any) -> AsyncIterator[bytes]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    head = (b'{"id":' + c.dumps(request_id) + b',"object":"chat.completion.chunk","created":'
            + str(created).encode() + b',"model":' + c.dumps(model) + b',"choices":')
    tail = b',"usage":null}\n\n' if include_usage else b"}\n\n"
    top_n = req.top_logprobs or 0
    num_gen = 0

    def frame(choice: dict) -> bytes:
        return b"data: " + head + c.dumps([choice]) + tail

    def chunks(ro: Any) -> list[bytes]:
        nonlocal num_gen
        frames = []
        for out in ro.outputs:
            num_gen += len(out.token_ids)
            if not out.text and out.finish_reason is None and not out.token_ids:
                continue
            lp = _chat_logprobs(state.tokenizer, out.token_ids, out.logprobs, top_n) if req.logprobs else None
            delta = {"content": out.text} if out.text or out.finish_reason is None else {}
            frames.append(frame({"index": out.index, "delta": delta, "logprobs": lp,
                                 "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}))
        return frames

    try:
        # The role goes first, in its own delta, once per choice (as OpenAI does).
        for i in range(req.n):
            yield frame({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None})
        for f in chunks(first):
            yield f
        if not first.finished:
            async for ro in gen:
                for f in chunks(ro):
                    yield f
        if include_usage:
            usage = {"prompt_tokens": num_prompt, "completion_tokens": num_gen, "total_tokens": num_prompt + num_gen}
            yield b"data: " + head + b"[]" + b',"usage":' + c.dumps(usage) + b"}\n\n"
    except Exception as e:  # noqa: BLE001 - headers are gone; report in-band like vLLM
        yield from_stream_error(e)
    finally:
        watch.cancel()
        await gen.aclose()
    yield b"data: [DONE]\n\n"
