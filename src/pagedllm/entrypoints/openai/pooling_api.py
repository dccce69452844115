"""POST /pooling (vLLM's generic pooling route): what the served model pools for each input, as LLM.encode gives it:
the embedding (task "embed", an embedding-capable model's default; as /v1/embeddings makes it) or the class
probabilities (task "classify", a sequence classifier's default; as /classify makes them)."""
from __future__ import annotations

import time
from typing import Literal, Optional

from fastapi import Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.body import parse_body
from pagedllm.entrypoints.openai.classify import classified, classifier_labels
from pagedllm.entrypoints.openai.embeddings import EmbeddingRequest, embedded, encoded, list_response
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import random_id
from pagedllm.entrypoints.openai.server_state import ServerState


class PoolingAPIRequest(EmbeddingRequest):
    task: Optional[Literal["embed", "classify"]] = None  # (None: the model's own)
    activation: Optional[bool] = None  # classify: false gives the raw label logits (embed: see normalize)


async def create_pooling(request: Request, state: ServerState) -> Response:
    req = await parse_body(request, PoolingAPIRequest)
    model = state.check_model(req.model)
    task = req.task or ("classify" if state.engine.ready.classifier_labels is not None else "embed")
    request_id = req.request_id or random_id("pool")
    created = int(time.time())
    if task == "embed":
        if req.activation is not None:  # (never silently unused)
            raise APIError("'activation' applies to the 'classify' task; the 'embed' task takes 'normalize'.",
                           param="activation")
        inputs, rows = await embedded(request, state, req, model, request_id)
    else:
        classifier_labels(state, "The 'classify' task")
        for name in ("dimensions", "normalize"):
            if getattr(req, name) is not None:
                raise APIError(f"'{name}' applies to the 'embed' task, not to 'classify'.", param=name)
        inputs, rows = await classified(request, state, req, model, request_id, req.activation)
    data = [{"index": i, "object": "pooling", "data": encoded(row, req.encoding_format)} for i, row in enumerate(rows)]
    return list_response(request_id, created, model, data, inputs)
