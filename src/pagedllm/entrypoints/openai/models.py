"""GET /v1/models."""
from __future__ import annotations

from fastapi.responses import Response

from pagedllm.entrypoints.openai.errors import dumps
from pagedllm.entrypoints.openai.server_state import ServerState


async def list_models(state: ServerState) -> Response:
    cards = [{"id": name, "object": "model", "created": state.created, "owned_by": "pagedllm",
              "root": state.engine.model_dir, "parent": None, "max_model_len": state.max_model_len}
             for name in state.served_model_names]
    if state.loras is not None:
        cards += state.loras.cards(state.created, state.max_model_len)
    return Response(dumps({"object": "list", "data": cards}), media_type="application/json")
