"""GET /v1/models and GET /v1/models/{model} (OpenAI's retrieve: the `openai` SDK's client.models.retrieve)."""
from __future__ import annotations

import time
import uuid

from fastapi.responses import Response

from pagedllm.entrypoints.openai.errors import APIError, dumps
from pagedllm.entrypoints.openai.server_state import ServerState


def _cards(state: ServerState) -> list[dict]:
    cards = [{"id": name, "object": "model", "created": state.created, "owned_by": "pagedllm",
              "root": state.engine.model_dir, "parent": None, "max_model_len": state.max_model_len}
             for name in state.served_model_names]
    if state.loras is not None:
        cards += state.loras.cards(state.created, state.max_model_len)
    for card in cards:  # vLLM's cards carry OpenAI's (legacy) permission list; clients may read it
        card["permission"] = [_permission()]
    return cards


def _permission() -> dict:
    return {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": int(time.time()),
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
            "group": None, "is_blocking": False}


async def list_models(state: ServerState) -> Response:
    return Response(dumps({"object": "list", "data": _cards(state)}), media_type="application/json")


async def retrieve_model(state: ServerState, model: str) -> Response:
    for card in _cards(state):
        if card["id"] == model:
            return Response(dumps(card), media_type="application/json")
    raise APIError(f"The model `{model}` does not exist.", status=404, param="model", code="model_not_found")
