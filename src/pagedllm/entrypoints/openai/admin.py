"""vLLM's development routes: sleep mode (`POST /sleep?level=1`, `POST /wake_up?tags=weights`, `GET /is_sleeping`)
and `POST /reset_prefix_cache`. Served only with PAGEDLLM_SERVER_DEV_MODE=1 (or VLLM_SERVER_DEV_MODE=1), else 404
as vLLM; behind --api-key (app.KEYED_PREFIXES). Each reaches every engine core (data parallel: each sleeps its own
workers); with several API server processes any one of them may be asked, the engine cores are shared.
"""
from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from pagedllm import envs
from pagedllm.entrypoints import messages as m
from pagedllm.entrypoints.async_engine import RequestRejected
from pagedllm.entrypoints.openai.errors import APIError, dumps

logger = logging.getLogger(__name__)

ADMIN_PATHS = ("/sleep", "/wake_up", "/is_sleeping", "/reset_prefix_cache")


def _sleep_level(request: Request) -> int:
    raw = request.query_params.get("level", "1")
    if raw.strip() not in ("1", "2"):
        raise APIError(f"level must be 1 (weights to host memory) or 2 (weights discarded), got {raw!r}.", 400,
                       param="level")
    return int(raw)


def install(app: FastAPI, state: Any) -> None:
    if not envs.PAGEDLLM_SERVER_DEV_MODE:
        return
    engine = state.engine
    client = engine.client_index

    @app.post("/sleep")
    async def sleep(request: Request) -> Response:
        level = _sleep_level(request)
        try:
            await engine.admin_call(lambda seq: m.Sleep(seq, level, client_index=client))
        except RequestRejected:
            # Data parallel: the idle cores slept before a busy one refused (409). Wake them, or the refused sleep
            # would leave them answering 503 until someone calls /wake_up (wake_up is a no-op on an awake core).
            if engine.num_engines > 1:
                try:
                    await engine.admin_call(lambda seq: m.WakeUp(seq, None, client_index=client))
                except Exception:  # noqa: BLE001 - the sleep's own error is the one to report
                    logger.exception("Waking the engine cores after a refused sleep failed")
            raise
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(request: Request) -> Response:
        tags = request.query_params.getlist("tags") or None
        await engine.admin_call(lambda seq: m.WakeUp(seq, tags, client_index=client))
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping() -> Response:
        replies = await engine.admin_call(lambda seq: m.IsSleeping(seq, client_index=client))
        return Response(dumps({"is_sleeping": any(r.value for r in replies)}), media_type="application/json")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        replies = await engine.admin_call(lambda seq: m.ResetPrefixCache(seq, client_index=client))
        if not all(r.value for r in replies):  # a request still holds cached blocks: nothing was forgotten
            raise APIError("The prefix cache was not reset: requests are running; try again when they are done.",
                           409)
        return Response(status_code=200)
