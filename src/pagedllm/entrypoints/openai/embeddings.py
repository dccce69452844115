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

from pagedllm.entrypoints.openai.body import parse_body, tokenize_work
from pagedllm.entrypoints.openai.completions import parse_prompts
from pagedllm.entrypoints.openai.errors import APIError, dumps
from pagedllm.entrypoints.openai.protocol import _Req, random_id
from pagedllm.entrypoints.openai.request_params import request_priority, truncate_prompt
from pagedllm.entrypoints.openai.server_state import ServerState
from pagedllm.entrypoints.openai.streaming import merge_streams, start_disconnect_watch

MAX_INPUTS = 2048  # OpenAI's limit of inputs per request


class EmbeddingRequest(_Req):
    model: Optional[str] = None
    input: Union[str, list[int], list[Union[str, list[int]]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None
    # vLLM's extras
    truncate_prompt_tokens: Optional[int] = None
    add_special_tokens: bool = True
    normalize: Optional[bool] = None
    priority: Optional[int] = None
    request_id: Optional[str] = None


def parse_inputs(inputs: Any, tokenizer: Any, vocab_size: int, add_special_tokens: bool
                 ) -> list[tuple[Optional[str], list[int]]]:
    """-> [(text or None, token ids)] for str | [str] | [int] | [[int]] (completions' prompt shapes)."""
    if isinstance(inputs, list) and len(inputs) > MAX_INPUTS and not isinstance(inputs[0], int):
        raise APIError(f"'input' may have at most {MAX_INPUTS} inputs (got {len(inputs)}).", param="input")
    return parse_prompts(inputs, tokenizer, vocab_size, add_special_tokens, field="input")


async def create_embedding(request: Request, state: ServerState) -> Response:
    from pagedllm.pooling import PoolingParams, finish, model_pooling, resolve, sampling_params_for

    req = await parse_body(request, EmbeddingRequest)
    model = state.check_model(req.model)
    priority = request_priority(req, state.scheduling_policy)
    engine = state.engine
    ready = engine.ready
    if state.pooling_defaults is None:  # the model directory's files, read once
        try:
            state.pooling_defaults = model_pooling(ready.model_dir, engine.engine_args.pooler_config,
                                                   engine.engine_args.hf_overrides)
        except ValueError as e:
            raise APIError(str(e), status=400, param="model") from None
    try:
        kind, normalize, dimensions = resolve(PoolingParams(dimensions=req.dimensions, normalize=req.normalize),
                                              state.pooling_defaults, ready.hidden_size)
    except ValueError as e:
        raise APIError(str(e), param="dimensions") from None
    inputs = await tokenize_work(request, parse_inputs, req.input, state.tokenizer, ready.vocab_size,
                                 req.add_special_tokens)
    limit = state.max_model_len - 1  # (the engine runs one step past the input, whose token it drops)
    k = req.truncate_prompt_tokens
    if k is not None:  # -1 (the model's context): what an embedding input may hold, not a length it then refuses
        inputs = [(None, truncate_prompt(ids, limit if k == -1 else k, state.max_model_len)) for _, ids in inputs]
    for i, (_, ids) in enumerate(inputs):
        if len(ids) > limit:
            which = "" if len(inputs) == 1 else f" {i}"
            raise APIError(f"This model's maximum context length is {state.max_model_len} tokens. However, input"
                           f"{which} has {len(ids)} tokens; an embedding input may have at most {limit}. Shorten it "
                           "or set truncate_prompt_tokens.", param="input")
    params = sampling_params_for(kind)
    request_id = req.request_id or random_id("embd")
    sub_ids = [f"{request_id}-{i}" for i in range(len(inputs))] if len(inputs) > 1 else [request_id]
    lora = state.lora_request(model)
    gens = [engine.generate(text, ids, params, sid, output_kind="final_only", lora_request=lora, priority=priority)
            for (text, ids), sid in zip(inputs, sub_ids)]
    watch = start_disconnect_watch(request, engine, sub_ids)
    created = int(time.time())
    finals: dict[int, Any] = {}
    merged = merge_streams(gens)
    try:
        async for i, out in merged:
            finals[i] = out
    finally:
        watch.cancel()
        await merged.aclose()
    data = []
    num_tokens = 0
    for i, (_, ids) in enumerate(inputs):
        final = finals.get(i)
        if final is None or final.pooled is None:
            reason = final.outputs[0].finish_reason if final is not None and final.outputs else "no output"
            raise APIError(f"The embedding of input {i} failed ({reason}).", status=500)
        num_tokens += len(ids)
        vector = finish(final.pooled, normalize, dimensions)
        if req.encoding_format == "base64":  # OpenAI's: little-endian float32 bytes
            embedding: Any = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
        else:
            embedding = vector
        data.append({"object": "embedding", "index": i, "embedding": embedding})
    body = {"id": request_id, "object": "list", "created": created, "model": model, "data": data,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}
    return Response(dumps(body), media_type="application/json")
