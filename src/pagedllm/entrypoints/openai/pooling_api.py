"""POST /pooling (vLLM's generic pooling route): what the served model pools for each input, as LLM.encode gives it:
the embedding (task "embed", an embedding-capable model's default; as /v1/embeddings makes it), the class
probabilities (task "classify", a sequence classifier's default; as /classify makes them), or one row per input
token (task "token_embed": each token's embedding; "token_classify", a token classifier's and a reward engine's
default: each token's label probabilities, or a reward engine's hidden states)."""
from __future__ import annotations

import time
from typing import Literal, Optional

from fastapi import Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.body import parse_body
from pagedllm.entrypoints.openai.classify import classified, classifier_labels, request_activation
from pagedllm.entrypoints.openai.embeddings import (EmbeddingRequest, embedded, embedding_options, encoded,
                                                    input_field, list_response, pooled_vectors, request_inputs,
                                                    truncated)
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.request_params import request_ids, request_priority
from pagedllm.entrypoints.openai.server_state import ServerState


class PoolingAPIRequest(EmbeddingRequest):
    task: Optional[Literal["embed", "classify", "token_embed", "token_classify"]] = None  # (None: the model's own)
    # classify / token_classify: false gives the raw label logits (embed: see normalize); use_activation is vLLM's
    # newer name
    activation: Optional[bool] = None
    use_activation: Optional[bool] = None


def served_tasks(state: ServerState) -> list[str]:
    """The pooling tasks of the served model, its default first."""
    ready = state.engine.ready
    return list(ready.pooling_tasks) or (["classify"] if ready.classifier_labels is not None else ["embed"])


async def create_pooling(request: Request, state: ServerState) -> Response:
    req = await parse_body(request, PoolingAPIRequest)
    model = state.check_model(req.model)
    task = req.task or served_tasks(state)[0]
    activation, given = request_activation(req)
    request_id, engine_id = request_ids(request, "pool", req.request_id)
    created = int(time.time())
    if task in ("embed", "token_embed") and activation is not None:  # (never silently unused)
        raise APIError(f"'{given}' applies to the classify tasks; the '{task}' task takes 'normalize'.", param=given)
    if task in ("classify", "token_classify"):
        for name in ("dimensions", "normalize"):
            if getattr(req, name) is not None:
                raise APIError(f"'{name}' applies to the embed tasks, not to '{task}'.", param=name)
    if task == "embed":
        inputs, rows = await embedded(request, state, req, model, engine_id)
    elif task == "classify":
        classifier_labels(state, "The 'classify' task")
        inputs, rows = await classified(request, state, req, model, engine_id, activation)
    else:
        inputs, rows = await per_token(request, state, req, task, activation, given, model, engine_id)
    data = [{"index": i, "object": "pooling", "data": encoded(row, req.encoding_format)} for i, row in enumerate(rows)]
    return list_response(request_id, created, model, data, inputs)


async def per_token(request: Request, state: ServerState, req: PoolingAPIRequest, task: str,
                    activation: Optional[bool], given: str, model: str, request_id: str) -> tuple[list, list]:
    """(the inputs, [(text or None, token ids)], and one row per token of each) for a token task
    (pooling.token_outputs); `given`: the request's name for `activation`."""
    from pagedllm.pooling import NO_HEAD_ACTIVATION, token_outputs

    ready = state.engine.ready
    tasks = served_tasks(state)
    if task not in tasks:
        raise APIError(f"The served model does not serve the '{task}' task; it serves {', '.join(tasks)}.",
                       param="task")
    has_head = ready.classifier_labels is not None or ready.token_labels is not None
    if task == "token_classify" and not has_head and activation:
        raise APIError(NO_HEAD_ACTIVATION, param=given)
    normalize, dimensions = True, None
    if task == "token_embed":
        _, normalize, dimensions = embedding_options(req, state)
    inputs = truncated(await request_inputs(request, req, state), req.truncate_prompt_tokens, state)
    flats = await pooled_vectors(request, state, model, inputs, "all", request_priority(req, state.scheduling_policy),
                                 request_id, field=input_field(req), what="per-token pooling")
    # STEP pooling (the engine's pooler_config, or a process reward model's default): the rows of step-tag tokens
    step = ready.step_pooling if task == "token_classify" else None
    return inputs, [token_outputs(flat, len(ids), task, has_head, activation, normalize, dimensions, step, ids)
                    for flat, (_, ids) in zip(flats, inputs)]
