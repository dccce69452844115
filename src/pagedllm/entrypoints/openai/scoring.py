"""vLLM's score and rerank APIs: POST /score (/v1/score) scores text pairs, POST /rerank (/v1/rerank, /v2/rerank:
the Jina / Cohere shape Open WebUI's external reranker speaks) orders documents for a query. With an embedding
model a score is the cosine similarity of the two texts' embeddings (embeddings.py's pooling, each vector
normalized); with a cross-encoder (a sequence classifier with one label) each pair is one input, the tokenizer's
pair encoding, and its score the sigmoid of the classifier's logit, as vLLM scores with each kind."""
from __future__ import annotations

import time
from typing import Any, Optional, Union

from fastapi import Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.body import parse_body, tokenize_work
from pagedllm.entrypoints.openai.completions import parse_prompts
from pagedllm.entrypoints.openai.embeddings import MAX_INPUTS, check_fits, pooled_vectors, pooling_defaults, \
    truncated
from pagedllm.entrypoints.openai.errors import APIError, dumps
from pagedllm.entrypoints.openai.protocol import Int, _Req
from pagedllm.entrypoints.openai.request_params import check_truncation, request_ids, request_priority
from pagedllm.entrypoints.openai.server_state import ServerState
from pagedllm.entrypoints.openai.classify import class_logits, classifier_inputs, classifier_labels, \
    request_activation
from pagedllm.pooling import class_probs, cosine, input_truncation, pair_input, score_pairs


class ScoreRequest(_Req):
    model: Optional[str] = None
    text_1: Union[str, list[str]]
    text_2: Union[str, list[str]]
    truncate_prompt_tokens: Optional[Int] = None
    priority: Optional[Int] = None
    request_id: Optional[str] = None
    # vLLM's, for a cross-encoder: false scores with the raw logit instead of its sigmoid (use_activation: the newer
    # name)
    activation: Optional[bool] = None
    use_activation: Optional[bool] = None


class RerankRequest(_Req):
    model: Optional[str] = None
    query: str
    documents: list[str]
    top_n: Optional[Int] = None  # the best n (None or 0: all)
    return_documents: bool = True
    truncate_prompt_tokens: Optional[Int] = None
    priority: Optional[Int] = None
    request_id: Optional[str] = None
    activation: Optional[bool] = None  # (as ScoreRequest's)
    use_activation: Optional[bool] = None


async def _texts_scored(request: Request, state: ServerState, req: Any, model: str, firsts: list[str],
                        seconds: list[str], names: tuple[str, str], prefix: str) -> tuple[list[float], int, str]:
    """(one score per (firsts[i], seconds[i]) pair, prompt tokens, request id): a cross-encoder reads each pair as
    one input; an embedding model embeds each distinct text once and scores the cosines."""
    for name, group in zip(names, (firsts, seconds)):
        if any(t == "" for t in group):
            raise APIError(f"'{name}' must not contain an empty string.", param=name)
    activation, given = request_activation(req)
    if state.engine.ready.classifier_labels is not None:
        return await _pairs_scored(request, state, req, model, firsts, seconds, names, prefix, activation)
    if activation is not None:  # (never silently unused: a cosine has no activation)
        raise APIError(f"'{given}' applies to a cross-encoder's scores; the served model scores by the cosine of "
                       "embeddings.", param=given)
    texts = list(dict.fromkeys(firsts + seconds))  # distinct, in order
    if len(texts) > MAX_INPUTS:
        raise APIError(f"A request may score at most {MAX_INPUTS} distinct texts (got {len(texts)}).",
                       param=names[1])
    inputs = await tokenize_work(request, parse_prompts, texts, state.tokenizer, state.engine.ready.vocab_size, True,
                                 field=names[1])
    inputs = truncated(inputs, req.truncate_prompt_tokens, state)
    ids_of = {text: ids for text, (_, ids) in zip(texts, inputs)}
    for name, group in zip(names, (firsts, seconds)):
        # each field's own texts by their index in it (one text repeated: no index), so a 400 names the right one:
        # the distinct texts' list mixes both fields
        own = group[:1] if len(set(group)) == 1 else group
        check_fits(state, [(None, ids_of[t]) for t in own], name)
    request_id, engine_id = request_ids(request, prefix, req.request_id)
    kind = pooling_defaults(state).pooling_type
    vectors = await pooled_vectors(request, state, model, inputs, kind, request_priority(req, state.scheduling_policy),
                                   engine_id, field=names[1])
    of = dict(zip(texts, vectors))
    tokens = dict(zip(texts, (len(ids) for _, ids in inputs)))
    scores = [cosine(of[a], of[b]) for a, b in zip(firsts, seconds)]
    num_tokens = sum(tokens[a] + tokens[b] for a, b in zip(firsts, seconds))
    return scores, num_tokens, request_id


def _pair_inputs(tokenizer: Any, firsts: list[str], seconds: list[str], max_tokens: Optional[int]
                 ) -> list[tuple[None, list[int]]]:
    return [(None, pair_input(tokenizer, a, b, max_tokens)) for a, b in zip(firsts, seconds)]


async def _pairs_scored(request: Request, state: ServerState, req: Any, model: str, firsts: list[str],
                        seconds: list[str], names: tuple[str, str], prefix: str, activation: Optional[bool]
                        ) -> tuple[list[float], int, str]:
    """A cross-encoder's scores: each pair's pair encoding classified, the sigmoid of its one logit (the logit
    itself where `activation` is False)."""
    labels = classifier_labels(state, "Scoring with a sequence classifier")
    if len(labels) != 1:
        raise APIError(f"The served model is a sequence classifier with {len(labels)} labels, not a cross-encoder "
                       "(one label): score its inputs with POST /classify.", param="model")
    if len(firsts) > MAX_INPUTS:
        raise APIError(f"A request may score at most {MAX_INPUTS} pairs (got {len(firsts)}).", param=names[1])
    k = req.truncate_prompt_tokens
    # checked before the tokenizer's pair truncation takes it: one past its integer type was an OverflowError, a 500
    check_truncation(k, state.max_model_len)
    inputs = await tokenize_work(request, _pair_inputs, state.tokenizer, firsts, seconds,
                                 None if k is None else input_truncation(k, state.max_model_len))
    inputs = classifier_inputs(state, inputs, k)  # (checks k; trims only what the pair truncation could not)
    # an input is a pair, named as one (it was named by the second field alone, though the first may be the long
    # one); its param: the field of the pair's longer text
    check_fits(state, inputs, f"the pair of {names[0]} and {names[1]}", "classification",
               [names[0] if len(a) > len(b) else names[1] for a, b in zip(firsts, seconds)])
    request_id, engine_id = request_ids(request, prefix, req.request_id)
    logits = await class_logits(request, state, model, inputs, req, engine_id, names[1])
    scores = [row[0] if activation is False else class_probs(row)[0] for row in logits]
    return scores, sum(len(ids) for _, ids in inputs), request_id


async def create_score(request: Request, state: ServerState) -> Response:
    req = await parse_body(request, ScoreRequest)
    model = state.check_model(req.model)
    try:
        firsts, seconds = score_pairs(req.text_1, req.text_2)
    except ValueError as e:
        raise APIError(str(e), param="text_1" if not req.text_1 else "text_2") from None
    created = int(time.time())
    scores, num_tokens, request_id = await _texts_scored(request, state, req, model, firsts, seconds,
                                                         ("text_1", "text_2"), "score")
    body = {"id": request_id, "object": "list", "created": created, "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}
    return Response(dumps(body), media_type="application/json")


async def create_rerank(request: Request, state: ServerState) -> Response:
    req = await parse_body(request, RerankRequest)
    model = state.check_model(req.model)
    if req.query == "":
        raise APIError("'query' must not be empty.", param="query")
    if not req.documents:
        raise APIError("'documents' must not be empty.", param="documents")
    if req.top_n is not None and req.top_n < 0:
        raise APIError(f"'top_n' must be >= 0 (0: all), got {req.top_n}.", param="top_n")
    scores, num_tokens, request_id = await _texts_scored(request, state, req, model,
                                                         [req.query] * len(req.documents), list(req.documents),
                                                         ("query", "documents"), "rerank")
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if req.top_n:
        order = order[:req.top_n]
    results = []
    for i in order:
        item: dict = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            item["document"] = {"text": req.documents[i]}
        results.append(item)
    body = {"id": request_id, "model": model, "usage": {"total_tokens": num_tokens}, "results": results}
    return Response(dumps(body), media_type="application/json")
