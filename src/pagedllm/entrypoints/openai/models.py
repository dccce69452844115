"""GET /v1/models and GET /v1/models/{model} (OpenAI's retrieve: the `openai` SDK's client.models.retrieve)."""
from __future__ import annotations

from fastapi.responses import Response

from pagedllm.entrypoints.openai.errors import APIError, dumps
from pagedllm.entrypoints.openai.server_state import ServerState


def _cards(state: ServerState) -> list[dict]:
    cards = [{"id": name, "object": "model", "created": state.created, "owned_by": "pagedllm",
              "root": state.engine.model_dir, "parent": None, "max_model_len": state.max_model_len}
             for name in state.served_model_names]
    if state.loras is not None:
        cards += state.loras.cards(state.created, state.max_model_len)
    return cards


async def list_models(state: ServerState) -> Response:
    return Response(dumps({"object": "list", "data": _cards(state)}), media_type="application/json")


async def retrieve_model(state: ServerState, model: str) -> Response:
    for card in _cards(state):
        if card["id"] == model:
            return Response(dumps(card), media_type="application/json")
    raise APIError(f"The model `{model}` does not exist.", status=404, param="model", code="model_not_found")
