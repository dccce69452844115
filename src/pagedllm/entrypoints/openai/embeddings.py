"""POST /v1/embeddings (OpenAI's, with vLLM's extras): one vector per input, the served model's final hidden states
pooled as pooling/ describes (the model's sentence-transformers files, else the last token's; unit length unless
they or the request's `normalize` say otherwise)."""
from __future__ import annotations

import base64
import time
from typing import Any, Literal, Optional, Union

import numpy as np
from fastapi import Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.body import parse_body, render_work, tokenize_work
from pagedllm.entrypoints.openai.chat_template import check_request_template, render_chat
from pagedllm.entrypoints.openai.completions import parse_prompts
from pagedllm.entrypoints.openai.errors import APIError, dumps
from pagedllm.entrypoints.openai.protocol import ChatMessage, Int, TokenId, _Req
from pagedllm.entrypoints.openai.request_params import (data_parallel_rank, request_ids, request_priority,
                                                        truncate_prompt)
from pagedllm.entrypoints.openai.server_state import ServerState
from pagedllm.entrypoints.openai.streaming import merge_streams, start_disconnect_watch

MAX_INPUTS = 2048  # OpenAI's limit of inputs per request


class PoolingRequest(_Req):
    """What an embeddings and a classification request both take (request_inputs reads them)."""
    model: Optional[str] = None
    input: Optional[Union[str, list[TokenId], list[Union[str, list[TokenId]]]]] = None
    # vLLM's chat-style request: one conversation, rendered by the chat template, pooled as one input
    messages: Optional[list[ChatMessage]] = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    user: Optional[str] = None
    # vLLM's extras
    truncate_prompt_tokens: Optional[Int] = None
    add_special_tokens: Optional[bool] = None  # (default: true for `input`, false for `messages`, as vLLM)
    priority: Optional[Int] = None
    request_id: Optional[str] = None


class EmbeddingRequest(PoolingRequest):
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[Int] = None
    normalize: Optional[bool] = None


async def request_inputs(request: Request, req: PoolingRequest, state: ServerState
                         ) -> list[tuple[Optional[str], list[int]]]:
    """A pooling request's inputs, [(text or None, token ids)]: its `input` (texts or token ids), or its `messages`
    (vLLM's chat-style request: one conversation rendered by the chat template, one input)."""
    if (req.input is None) == (req.messages is None):
        raise APIError("Give exactly one of 'input' or 'messages'.", param="input")
    if req.input is not None:  # the chat template's fields shape only a conversation
        for name in ("add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs"):
            if getattr(req, name):
                raise APIError(f"'{name}' applies to 'messages' (a conversation rendered by the chat template), not "
                               "to 'input'.", param=name)
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        return await tokenize_work(request, parse_inputs, req.input, state.tokenizer, state.engine.ready.vocab_size,
                                   add_special)
    check_request_template(req.chat_template, state)
    return [await render_work(request, req, render_chat, state.tokenizer, req.messages, req.add_generation_prompt,
                              req.continue_final_message, req.chat_template, req.chat_template_kwargs,
                              bool(req.add_special_tokens), content_format=state.chat_template_content_format)]


def input_field(req: Any) -> str:
    """The request field a pooling request's inputs came from, for its errors: 'messages' or 'input'."""
    return "input" if getattr(req, "messages", None) is None else "messages"


def parse_inputs(inputs: Any, tokenizer: Any, vocab_size: int, add_special_tokens: bool
                 ) -> list[tuple[Optional[str], list[int]]]:
    """-> [(text or None, token ids)] for str | [str] | [int] | [[int]] (completions' prompt shapes)."""
    if isinstance(inputs, list) and len(inputs) > MAX_INPUTS and not isinstance(inputs[0], int):
        raise APIError(f"'input' may have at most {MAX_INPUTS} inputs (got {len(inputs)}).", param="input")
    return parse_prompts(inputs, tokenizer, vocab_size, add_special_tokens, field="input")


def pooling_defaults(state: ServerState) -> Any:
    """The served model's pooling (pooling.ModelPooling): its files and the engine's flags, read once."""
    from pagedllm.pooling import model_pooling

    if state.pooling_defaults is None:
        args = state.engine.engine_args
        try:
            state.pooling_defaults = model_pooling(state.engine.ready.model_dir, args.pooler_config, args.hf_overrides,
                                                   args.hf_config_dir())
        except ValueError as e:
            raise APIError(str(e), status=400, param="model") from None
    return state.pooling_defaults


def embedding_options(req: Any, state: ServerState) -> tuple[str, bool, Optional[int]]:
    """(pooling kind, normalize, dimensions) of a request's embeddings: its dimensions / normalize over the served
    model's pooling; a 400 naming dimensions where they do not fit."""
    from pagedllm.pooling import PoolingParams, resolve

    try:
        return resolve(PoolingParams(dimensions=req.dimensions, normalize=req.normalize), pooling_defaults(state),
                       state.engine.ready.hidden_size)
    except ValueError as e:
        raise APIError(str(e), param="dimensions") from None


def truncated(inputs: list, k: Optional[int], state: ServerState) -> list:
    """vLLM's truncate_prompt_tokens on embedding inputs: each input's last k tokens (pooling.input_truncation)."""
    from pagedllm.pooling import input_truncation

    if k is None:
        return inputs
    k = input_truncation(k, state.max_model_len)
    return [(None, truncate_prompt(ids, k, state.max_model_len)) for _, ids in inputs]


def check_fits(state: ServerState, inputs: list, field: str, what: str = "embedding",
               params: Optional[list[str]] = None) -> None:
    """Each of `inputs` ([(text or None, token ids)]) fits the context, else a 400 naming `field` (and, of several,
    the input's index in it); its param `field`, or params[i] where given (the request field of input i)."""
    limit = state.max_model_len - 1  # (the engine runs one step past the input, whose token it drops)
    for i, (_, ids) in enumerate(inputs):
        if len(ids) > limit:
            which = "" if len(inputs) == 1 else f" {i}"
            article = "an" if what[0] in "aeiou" else "a"
            raise APIError(f"This model's maximum context length is {state.max_model_len} tokens. However, {field}"
                           f"{which} has {len(ids)} tokens; {article} {what} input may have at most {limit}. Shorten "
                           "it or set truncate_prompt_tokens.", param=field if params is None else params[i])


async def pooled_vectors(request: Request, state: ServerState, model: str, inputs: list, kind: str, priority: int,
                         request_id: str, field: str = "input", what: str = "embedding") -> list[list[float]]:
    """The engine's pooled hidden states of `inputs` ([(text or None, token ids)]), in order (a classifier's: its
    label logits); each input fits the context (a 400 naming `field` otherwise); a client that leaves aborts them
    all. `what`: the request's kind, for its messages."""
    from pagedllm.pooling import sampling_params_for

    check_fits(state, inputs, field, what)
    engine = state.engine
    params = sampling_params_for(kind)
    sub_ids = [f"{request_id}-{i}" for i in range(len(inputs))] if len(inputs) > 1 else [request_id]
    lora = state.lora_request(model)
    rank = data_parallel_rank(request, engine)
    gens = [engine.generate(text, ids, params, sid, output_kind="final_only", lora_request=lora, priority=priority,
                            data_parallel_rank=rank)
            for (text, ids), sid in zip(inputs, sub_ids)]
    watch = start_disconnect_watch(request, engine, sub_ids)
    finals: dict[int, Any] = {}
    merged = merge_streams(gens)
    try:
        async for i, out in merged:
            finals[i] = out
    finally:
        watch.cancel()
        await merged.aclose()
    vectors = []
    for i in range(len(inputs)):
        final = finals.get(i)
        if final is None or final.pooled is None:
            reason = final.outputs[0].finish_reason if final is not None and final.outputs else "no output"
            raise APIError(f"The {what} of {field} {i} failed ({reason}).", status=500)
        vectors.append(final.pooled)
    return vectors


async def embedded(request: Request, state: ServerState, req: EmbeddingRequest, model: str, request_id: str
                   ) -> tuple[list, list[list[float]]]:
    """(the inputs, [(text or None, token ids)], and their embeddings: pooled, normalized and shortened as the
    request and the model's pooling say)."""
    from pagedllm.pooling import finish

    priority = request_priority(req, state.scheduling_policy)
    ready = state.engine.ready
    if ready.classifier_labels is not None:
        raise APIError("The served model is a sequence classifier: it has no embeddings; use POST /classify, or "
                       "/v1/score and /v1/rerank for text pairs.", param="model")
    if ready.pooling_tasks and "embed" not in ready.pooling_tasks:
        from pagedllm.pooling import token_only_refusal

        raise APIError(token_only_refusal(ready.architecture, ready.token_labels is not None, "embeddings"),
                       param="model")
    kind, normalize, dimensions = embedding_options(req, state)
    inputs = truncated(await request_inputs(request, req, state), req.truncate_prompt_tokens, state)
    vectors = await pooled_vectors(request, state, model, inputs, kind, priority, request_id, field=input_field(req))
    return inputs, [finish(pooled, normalize, dimensions) for pooled in vectors]


def encoded(vector: list[float], encoding_format: str) -> Any:
    """A vector as the request asked: floats, or OpenAI's base64 of little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


def list_response(request_id: str, created: int, model: str, data: list, inputs: list,
                  completion_tokens: bool = True) -> Response:
    """A pooling route's answer: {id, object: "list", created, model, data, usage}, the usage counting the inputs'
    tokens (with completion_tokens 0, as vLLM's classify / pooling; OpenAI's embeddings have none)."""
    num_tokens = sum(len(ids) for _, ids in inputs)
    usage = {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    if completion_tokens:
        usage["completion_tokens"] = 0
    body = {"id": request_id, "object": "list", "created": created, "model": model, "data": data, "usage": usage}
    return Response(dumps(body), media_type="application/json")


async def create_embedding(request: Request, state: ServerState) -> Response:
    req = await parse_body(request, EmbeddingRequest)
    model = state.check_model(req.model)
    request_id, engine_id = request_ids(request, "embd", req.request_id)
    created = int(time.time())
    inputs, vectors = await embedded(request, state, req, model, engine_id)
    data = [{"object": "embedding", "index": i, "embedding": encoded(vector, req.encoding_format)}
            for i, vector in enumerate(vectors)]
    return list_response(request_id, created, model, data, inputs, completion_tokens=False)
