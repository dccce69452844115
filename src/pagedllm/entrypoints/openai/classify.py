"""POST /classify (vLLM's; also /v1/classify): a sequence classifier's (*ForSequenceClassification) class
probabilities for each input (texts, token ids, or one conversation in `messages` rendered by the chat template),
the softmax of its label logits (a one-label model's sigmoid), and the most likely label. The engine pools each
input's last token through the model's score head (pooling/)."""
from __future__ import annotations

import time
from typing import Any, Optional

from fastapi import Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.body import parse_body
from pagedllm.entrypoints.openai.embeddings import (PoolingRequest, input_field, list_response, pooled_vectors,
                                                    request_inputs, truncated)
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.request_params import request_ids, request_priority
from pagedllm.entrypoints.openai.server_state import ServerState


class ClassificationRequest(PoolingRequest):
    """vLLM's classification request: PoolingRequest's fields (texts, token ids or `messages`)."""
    activation: Optional[bool] = None  # vLLM's: false gives the raw label logits instead of their probabilities
    use_activation: Optional[bool] = None  # (vLLM's newer name of activation)


def request_activation(req: Any) -> tuple[Optional[bool], str]:
    """(the request's activation, by either of its names; the name it came by, for its errors)."""
    if req.activation is not None and req.use_activation is not None and req.activation != req.use_activation:
        raise APIError("'activation' and 'use_activation' (its newer name) disagree; give one.", param="activation")
    if req.use_activation is not None:
        return req.use_activation, "use_activation"
    return req.activation, "activation"


def classifier_labels(state: ServerState, what: str) -> list[str]:
    """The served classifier's labels; a 400 saying why `what` needs one when the model is not a classifier."""
    labels = state.engine.ready.classifier_labels
    if labels is None:
        raise APIError(f"{what} needs a sequence classification model (a *ForSequenceClassification checkpoint); "
                       "the served model is not one.", param="model")
    return labels


def classifier_inputs(state: ServerState, inputs: list, k: Optional[int]) -> list:
    """What the classifier reads of each input: trailing pad tokens dropped (pooling.classifier_input), then vLLM's
    truncate_prompt_tokens."""
    from pagedllm.pooling import classifier_input

    pad = state.engine.ready.pad_token_id
    return truncated([(text, classifier_input(ids, pad)) for text, ids in inputs], k, state)


async def class_logits(request: Request, state: ServerState, model: str, inputs: list, req: Any, request_id: str,
                       field: str) -> list[list[float]]:
    """The label logits of each input ([(text or None, token ids)], ready for the classifier)."""
    return await pooled_vectors(request, state, model, inputs, "last", request_priority(req, state.scheduling_policy),
                                request_id, field=field, what="classification")


async def classified(request: Request, state: ServerState, req: PoolingRequest, model: str, request_id: str,
                     activation: Optional[bool]) -> tuple[list, list[list[float]]]:
    """(the inputs as the classifier reads them, [(text or None, token ids)], and their class probabilities, or
    their label logits where `activation` is False)."""
    from pagedllm.pooling import class_probs

    inputs = classifier_inputs(state, await request_inputs(request, req, state), req.truncate_prompt_tokens)
    logits = await class_logits(request, state, model, inputs, req, request_id, input_field(req))
    return inputs, logits if activation is False else [class_probs(row) for row in logits]


async def create_classification(request: Request, state: ServerState) -> Response:
    req = await parse_body(request, ClassificationRequest)
    model = state.check_model(req.model)
    labels = classifier_labels(state, "/classify")
    request_id, engine_id = request_ids(request, "classify", req.request_id)
    created = int(time.time())
    inputs, rows = await classified(request, state, req, model, engine_id, request_activation(req)[0])
    data = []
    for i, probs in enumerate(rows):
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append({"index": i, "label": labels[best] if best < len(labels) else None, "probs": probs,
                     "num_classes": len(probs)})
    return list_response(request_id, created, model, data, inputs)
