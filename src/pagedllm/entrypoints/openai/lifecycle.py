"""The server's life after start: graceful drain on SIGTERM / SIGINT, and exiting when the engine died.

Drain (what a load balancer or Kubernetes expects from a replica being stopped):
  1. the first SIGTERM (or Ctrl-C) marks the server draining: `/health` answers 503, so balancers take the
     replica out, and new requests get 503 (nginx retries them on another replica); the port stays open;
  2. requests in flight run to completion, for at most `--shutdown-timeout` seconds; whatever is still
     running then ends with an error (a 503, or an SSE error event and `[DONE]`), never a cut-off stream;
  3. uvicorn closes the listening socket and idle connections, the engine process stops, the exit code is 0.
A second signal stops at once (uvicorn's own shutdown: running requests end with an error event).

Engine death: when the engine-core process is gone, `/health` is 503 and requests fail at once; after
`--engine-dead-grace-period` seconds the API process exits with code 1, so an orchestrator restarts the
replica instead of it serving 503 forever (a negative value keeps it up).

Several API server processes (`--api-server-count`): the supervisor gets the signals and sends each process
SIGTERM (a second signal: a second SIGTERM), so each one drains as above; they ignore SIGINT themselves (Ctrl-C
reaches the whole process group, and would count twice).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Optional

from pagedllm.entrypoints.openai.errors import dumps, error_body
from pagedllm.entrypoints.openai.guards import route_path

logger = logging.getLogger("pagedllm.api_server")

# Not counted as in-flight work and still answered while draining (probes and scrapes).
_PROBE_PATHS = ("/health", "/metrics", "/version", "/load")
# vLLM's --enable-server-load-tracking: the routes whose requests in flight GET /load reports (server_load).
LOAD_PATHS = frozenset(("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/pooling",
                        "/classify", "/v1/classify", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank",
                        "/invocations"))
# Live views that never end by themselves: not in-flight work (a drain does not wait for them; they end when it starts).
_LIVE_PATHS = ("/dashboard/events",)
ENGINE_DEAD_EXIT_CODE = 1


class Lifecycle:
    """Shared by the ASGI guard (counts requests, refuses new ones while draining) and the server."""

    def __init__(self, count_request: Any = None) -> None:
        self.draining = False
        self.in_flight = 0
        self.exit_code = 0
        self.count_request = count_request  # called once per HTTP request that is not a probe (metrics)
        self.track_load = False  # --enable-server-load-tracking
        self.server_load = 0  # requests of LOAD_PATHS in flight, while track_load


class DrainMiddleware:
    """Pure ASGI: counts HTTP requests in flight (a streaming response counts until its last byte is sent)
    and, while the server drains, answers /health and every new request with 503."""

    def __init__(self, app: Any, lifecycle: Lifecycle) -> None:
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        if self.lifecycle.draining and path not in ("/metrics", "/version"):
            await _send_503(send, "The server is shutting down; retry on another replica.")
            return
        if path in _PROBE_PATHS or path in _LIVE_PATHS:
            await self.app(scope, receive, send)
            return
        if self.lifecycle.count_request is not None:
            self.lifecycle.count_request()
        load = self.lifecycle.track_load and path in LOAD_PATHS
        self.lifecycle.in_flight += 1
        self.lifecycle.server_load += load
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.in_flight -= 1
            self.lifecycle.server_load -= load


async def _send_503(send: Any, message: str) -> None:
    body = dumps(error_body(message, 503))
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), (b"retry-after", b"1")]})
    await send({"type": "http.response.body", "body": body})


def server_class() -> type:
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn.Server with the drain above and the engine-death exit."""

        def __init__(self, config: Any, engine: Any, lifecycle: Lifecycle, shutdown_timeout: float,
                     engine_dead_grace_period: float, on_started: Any = None, supervised: bool = False) -> None:
            super().__init__(config)
            self.engine = engine
            self.lifecycle = lifecycle
            self.shutdown_timeout = shutdown_timeout
            self.engine_dead_grace_period = engine_dead_grace_period
            self.on_started = on_started  # called once the socket listens
            self.supervised = supervised  # one of several API processes: signals come from the supervisor
            self._loop: Optional[asyncio.AbstractEventLoop] = None
            self._tasks: list[asyncio.Task] = []

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets=sockets)
            self._loop = asyncio.get_running_loop()
            self._tasks.append(self._loop.create_task(self._watch_engine(), name="pagedllm-engine-exit"))
            if self.on_started is not None and self.started:
                self.on_started()

        def handle_exit(self, sig: int, frame: Any) -> None:
            import signal

            if self.supervised and sig == signal.SIGINT:
                return  # Ctrl-C: the supervisor got it too and sends SIGTERM
            # Runs in the signal handler: hand over to the loop. Not recorded in uvicorn's captured signals
            # (which it re-raises at exit), so a drained stop exits 0.
            if self.lifecycle.draining or self._loop is None:
                self.force_exit = self.lifecycle.draining
                super().handle_exit(sig, frame)
                return
            self.lifecycle.draining = True
            self._loop.call_soon_threadsafe(self._start_drain, sig)

        def _start_drain(self, sig: int) -> None:
            self._tasks.append(asyncio.get_running_loop().create_task(self._drain(sig), name="pagedllm-drain"))

        async def _drain(self, sig: int) -> None:
            import signal

            try:
                name = signal.Signals(sig).name
            except ValueError:
                name = f"signal {sig}"
            logger.info("%s: draining (%d request(s) in flight, up to %.0f s); /health is 503 now", name,
                        self.lifecycle.in_flight, self.shutdown_timeout)
            deadline = time.monotonic() + self.shutdown_timeout
            while self.lifecycle.in_flight and time.monotonic() < deadline and not self.should_exit:
                await asyncio.sleep(0.05)
            if self.lifecycle.in_flight:
                logger.warning("shutdown timeout: ending %d request(s) still running", self.lifecycle.in_flight)
                self.engine.fail_pending("the server is shutting down")
                flush_deadline = time.monotonic() + 2.0
                while self.lifecycle.in_flight and time.monotonic() < flush_deadline:
                    await asyncio.sleep(0.05)
            else:
                logger.info("drained: no requests in flight")
            self.should_exit = True

        @property
        def should_exit(self) -> bool:
            return self._should_exit

        @should_exit.setter
        def should_exit(self, value: bool) -> None:
            # Setting it (a signal handler, the drain, the engine's death) wakes main_loop at once.
            self._should_exit = value
            wake, loop = getattr(self, "_wake", None), getattr(self, "_loop", None)
            if value and wake is not None and loop is not None:
                loop.call_soon_threadsafe(wake.set)

        async def main_loop(self) -> None:
            """uvicorn's main loop wakes 10 times a second to refresh its date header (once a second) and to see
            should_exit; this one ticks once a second and is woken by should_exit, so an idle server sleeps."""
            self._wake = asyncio.Event()
            while not await self.on_tick(0):
                try:
                    await asyncio.wait_for(self._wake.wait(), 1.0)
                except asyncio.TimeoutError:
                    pass
                self._wake.clear()

        async def _watch_engine(self) -> None:
            if self.engine_dead_grace_period < 0:
                return
            dead = getattr(self.engine, "dead", None)
            if dead is not None:
                await dead.wait()
            while not self.engine.errored:
                await asyncio.sleep(0.2)
            logger.error("the engine process is not running (%s); exiting in %.0f s so the replica is restarted",
                         self.engine.dead_reason, self.engine_dead_grace_period)
            await asyncio.sleep(self.engine_dead_grace_period)
            self.lifecycle.exit_code = ENGINE_DEAD_EXIT_CODE
            self.should_exit = True

        async def shutdown(self, sockets: Any = None) -> None:
            for task in self._tasks:
                task.cancel()
            # Anything still running (a forced stop) ends with an error event instead of a cut-off stream.
            self.engine.fail_pending("the server is shutting down")
            await super().shutdown(sockets=sockets)

    return GracefulServer
