"""Run the OpenAI-compatible server: `python -m pagedllm.entrypoints.openai.api_server --model M ...`
(the same as `pagedllm serve M ...`).

Order of start: parse flags -> validate (unsupported features fail here, before any loading) -> bind the
port (a busy port fails at once) -> spawn the engine-core process and wait for its ready handshake (a
startup error is printed as one line, exit code 1) -> load the tokenizer -> serve HTTP.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
from typing import Optional

logger = logging.getLogger("pagedllm.api_server")

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


def setup_logging(level: str) -> None:
    level = "DEBUG" if level == "trace" else level.upper()
    root = logging.getLogger("pagedllm")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
        root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False


def served_names(args: argparse.Namespace) -> list[str]:
    if args.served_model_name:
        return list(args.served_model_name)
    if args.model:
        return [args.model]
    return [DEFAULT_SERVED_NAME]


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"error: cannot listen on {host}:{port}: {e.strerror}")
    sock.set_inheritable(True)
    return sock


async def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from pagedllm import envs
    from pagedllm.core.engine_core import freeze_startup_objects
    from pagedllm.entrypoints.async_engine import AsyncEngine, EngineStartupError
    from pagedllm.entrypoints.openai.app import build_app
    from pagedllm.entrypoints.openai.cli_args import check_unsupported_server_flags, to_engine_args
    from pagedllm.entrypoints.openai.guards import RequestGuard
    from pagedllm.entrypoints.openai.lifecycle import DrainMiddleware, Lifecycle, server_class
    from pagedllm.entrypoints.openai.lora_models import serve_lora_modules
    from pagedllm.entrypoints.openai.server_state import ServerState
    from pagedllm.generation_config import load_sampling_defaults, log_sampling_defaults
    from pagedllm.metrics import Metrics

    try:
        engine_args = to_engine_args(args)
        engine_args.validate()
        check_unsupported_server_flags(args)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    names = served_names(args)
    sock = bind_socket(args.host, args.port)
    metrics = Metrics(names[0], num_engines=engine_args.data_parallel_size)
    engine = AsyncEngine(engine_args, log_level=args.log_level if args.log_level != "trace" else "debug",
                         metrics=metrics)
    try:
        try:
            await engine.start(startup_timeout_s=args.startup_timeout)
        except EngineStartupError as e:
            print(f"error: the engine failed to start: {e}", file=sys.stderr)
            return 1
        try:
            defaults = load_sampling_defaults(engine_args.generation_config, engine.model_dir)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        log_sampling_defaults(defaults, engine_args.generation_config, engine.model_dir)
        state = ServerState(engine, names, metrics=metrics, api_key=args.api_key or envs.PAGEDLLM_API_KEY,
                            sampling_defaults=defaults)
        state.tool_call_parser = getattr(args, "tool_call_parser", None) or "auto"
        try:
            state.loras = await serve_lora_modules(engine, names, engine_args, args.lora_modules, metrics)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        lifecycle = Lifecycle()
        state.lifecycle = lifecycle
        state.dashboard = args.dashboard
        fastapi_app = build_app(state)
        guarded = RequestGuard(fastapi_app, max_body_bytes=args.max_request_body_bytes,
                               send_timeout_s=args.send_timeout)
        app = DrainMiddleware(guarded, lifecycle)
        freeze_startup_objects()  # the tokenizer and the app, for the server's life: it allocates per chunk
        config = uvicorn.Config(app, log_level=args.log_level, access_log=not args.disable_uvicorn_access_log,
                                timeout_keep_alive=5, timeout_graceful_shutdown=5, lifespan="off")
        server = server_class()(config, engine, lifecycle, shutdown_timeout=args.shutdown_timeout,
                                engine_dead_grace_period=args.engine_dead_grace_period)
        host = f"[{args.host}]" if ":" in args.host else args.host
        logger.info("Serving %s (from %s, max_model_len %d) at http://%s:%d/v1", names[0], engine.model_dir,
                    engine.max_model_len, host, args.port)
        if state.dashboard:
            fastapi_app.state.dashboard.start()  # reads the counters every 5 s until a page opens
            logger.info("Dashboard: http://%s:%d/dashboard", host, args.port)
        _SERVING["started"] = True
        await server.serve(sockets=[sock])
        return lifecycle.exit_code
    finally:
        await engine.shutdown()
        sock.close()


_SERVING = {"started": False}


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    if (getattr(args, "node_rank", 0) or 0) > 0:
        return run_worker_node(args)
    try:
        return asyncio.run(serve(args))
    except KeyboardInterrupt:
        # uvicorn re-raises Ctrl-C / SIGINT after its graceful shutdown: that is a normal stop, not a failure.
        return 0 if _SERVING["started"] else 130


def run_worker_node(args: argparse.Namespace) -> int:
    """--node-rank > 0: this machine only runs its share of the worker ranks (the head serves HTTP)."""
    from pagedllm.entrypoints.openai.cli_args import to_engine_args
    from pagedllm.executor.multinode import run_worker_node as run_node

    try:
        engine_args = to_engine_args(args)
        engine_args.validate()
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run_node(engine_args)


def main(argv: Optional[list[str]] = None) -> None:
    from pagedllm.entrypoints.openai.cli_args import add_serve_args, parse_serve_args

    parser = argparse.ArgumentParser(prog="python -m pagedllm.entrypoints.openai.api_server",
                                     description="pagedllm OpenAI-compatible server")
    add_serve_args(parser, positional_model=False)
    args = parse_serve_args(parser, argv)
    sys.exit(run(args))


if __name__ == "__main__":
    main()
