"""Run the OpenAI-compatible server: `python -m pagedllm.entrypoints.openai.api_server --model M ...`
(the same as `pagedllm serve M ...`).

Order of start: parse flags -> validate (unsupported features fail here, before any loading) -> bind the
port (a busy port fails at once) -> spawn the engine-core process and wait for its ready handshake (a
startup error is printed as one line, exit code 1) -> load the tokenizer -> serve HTTP.

With `--api-server-count N` > 1 this process supervises N API server processes instead
(api_server_manager.py); each runs `serve()` below as one client of the engine cores (`run_api_child`).
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import logging
import socket
import sys
from typing import Any, Optional

from pagedllm.config import DEFAULT_SERVED_NAME

logger = logging.getLogger("pagedllm.api_server")


def setup_logging(level: str, tag: str = "") -> None:
    """`tag`: a name in front of every line (which API server process of several wrote it)."""
    level = "DEBUG" if level == "trace" else level.upper()
    root = logging.getLogger("pagedllm")
    if not root.handlers:
        handler = logging.StreamHandler()
        prefix = f"[{tag}] " if tag else ""
        handler.setFormatter(logging.Formatter(f"%(levelname)s %(asctime)s {prefix}%(name)s: %(message)s",
                                               "%H:%M:%S"))
        root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False


def served_names(args: argparse.Namespace) -> list[str]:
    if args.served_model_name:
        return list(args.served_model_name)
    if args.model:
        return [args.model]
    return [DEFAULT_SERVED_NAME]


def bind_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """Bound, not listening (uvicorn listens once the server starts). `reuse_port`: one of several API server
    processes on one port (the kernel spreads new connections over their listening sockets)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"error: cannot listen on {host}:{port}: {e.strerror}")
    sock.set_inheritable(True)
    return sock


def _startup_error(report: Any, message: str, code: int) -> int:
    """Say why the server cannot start: on stderr, or (one of several API processes) to the supervisor, which
    says it once."""
    if report is None:
        print(f"error: {message}", file=sys.stderr)
    else:
        report.send(("error", code, message))
    return code


def configure_state(args: argparse.Namespace, engine: Any, names: list[str], metrics: Any, defaults: dict,
                    chat_template: Optional[str]) -> Any:
    """The ServerState of a started engine, set from the serve flags (shared by `serve` and `run-batch`)."""
    from pagedllm import envs
    from pagedllm.entrypoints.openai.server_state import ServerState

    if getattr(args, "enable_log_requests", False):
        from pagedllm.entrypoints.request_logger import RequestLogger

        engine.request_logger = RequestLogger(getattr(args, "max_log_len", None),
                                              log_outputs=bool(getattr(args, "enable_log_outputs", False)))
    elif getattr(args, "enable_log_outputs", False):  # as in vLLM, outputs are logged by the request logger
        logger.warning("--enable-log-outputs logs nothing without --enable-log-requests")
    state = ServerState(engine, names, metrics=metrics, api_key=args.api_key or envs.PAGEDLLM_API_KEY,
                        sampling_defaults=defaults)
    state.tool_call_parser = getattr(args, "tool_call_parser", None) or "auto"
    state.exclude_tools_when_tool_choice_none = bool(getattr(args, "exclude_tools_when_tool_choice_none", False))
    state.response_role = getattr(args, "response_role", None) or "assistant"
    so_config = getattr(args, "structured_outputs_config", None) or {}  # (vLLM's reasoning keys: reasoning.py)
    state.reasoning_parser = getattr(args, "reasoning_parser", None) or so_config.get("reasoning_parser")
    state.grammar_in_reasoning = bool(so_config.get("enable_in_reasoning"))
    state.prompt_tokens_details = bool(getattr(args, "enable_prompt_tokens_details", False))
    state.return_tokens_as_token_ids = bool(getattr(args, "return_tokens_as_token_ids", False))
    state.force_include_usage = bool(getattr(args, "enable_force_include_usage", False))
    state.trust_request_chat_template = bool(getattr(args, "trust_request_chat_template", False))
    state.chat_template_content_format = getattr(args, "chat_template_content_format", None) or "auto"
    state.chat_template = chat_template
    state.tokenizer_info_endpoint = bool(getattr(args, "enable_tokenizer_info_endpoint", False))
    if chat_template is not None:  # --chat-template: every chat request renders with it (a request's own wins)
        engine.tokenizer.chat_template = chat_template
    return state


async def serve(args: argparse.Namespace, client: Any = None, report: Any = None) -> int:
    """Serve HTTP until stopped; the exit code. `client` (an ipc.ClientSpec) and `report` (a pipe to and from
    the supervisor): this is one of several API server processes."""
    import uvicorn

    from pagedllm import envs
    from pagedllm.core.engine_core import freeze_startup_objects
    from pagedllm.entrypoints.async_engine import AsyncEngine, EngineStartupError
    from pagedllm.entrypoints.openai.app import build_app
    from pagedllm.entrypoints.openai.chat_template import load_chat_template
    from pagedllm.entrypoints.openai.cli_args import (check_unsupported_server_flags, server_url, to_engine_args,
                                                      uvicorn_h11_settings)
    from pagedllm.entrypoints.openai.guards import RequestGuard
    from pagedllm.entrypoints.openai.hot_routes import HotRoutes
    from pagedllm.entrypoints.openai.lifecycle import DrainMiddleware, Lifecycle, server_class
    from pagedllm.entrypoints.openai.lora_models import serve_lora_modules
    from pagedllm.entrypoints.openai.middleware import load_middlewares, wrap_middlewares
    from pagedllm.generation_config import load_sampling_defaults, log_sampling_defaults
    from pagedllm.metrics import Metrics

    try:
        engine_args = to_engine_args(args)
        engine_args.validate()
        check_unsupported_server_flags(args)
        # --chat-template: read (and parsed) before the model loads
        chat_template = load_chat_template(getattr(args, "chat_template", None), from_command_line=True)
        middlewares = load_middlewares(getattr(args, "middleware", None))
        # read now: a bad value raised only at uvicorn's config, after the model had loaded, as a traceback
        keep_alive_s = envs.PAGEDLLM_HTTP_TIMEOUT_KEEP_ALIVE
    except (ValueError, TypeError) as e:
        return _startup_error(report, str(e), 2)
    from pagedllm.entrypoints.openai.errors import ERROR_STACK

    ERROR_STACK["log"] = bool(getattr(args, "log_error_stack", False))
    names = served_names(args)
    sock = bind_socket(args.host, args.port, reuse_port=client is not None)
    if args.port == 0:  # --port 0: the port the kernel chose, for the URLs logged below
        args = copy.copy(args)
        args.port = sock.getsockname()[1]
    index, count = (0, 1) if client is None else (client.index, client.layout.num_clients)
    metrics = Metrics(names[0], num_engines=engine_args.data_parallel_size, api_server=index,
                      multiprocess_dir=None if client is None else client.layout.metrics_dir)
    engine = AsyncEngine(engine_args, log_level=args.log_level if args.log_level != "trace" else "debug",
                         metrics=metrics, client=client)
    try:
        try:
            await engine.start(startup_timeout_s=args.startup_timeout)
        except EngineStartupError as e:
            return _startup_error(report, f"the engine failed to start: {e}", 1)
        except ValueError as e:  # the front end's own loading (the tokenizer: --tokenizer) after the engine's
            return _startup_error(report, str(e), 2)
        try:
            defaults = load_sampling_defaults(engine_args.generation_config, engine.model_dir,
                                              engine_args.override_generation_config)
        except ValueError as e:
            return _startup_error(report, str(e), 2)
        log_sampling_defaults(defaults, engine_args.generation_config, engine.model_dir,
                              engine_args.override_generation_config)
        state = configure_state(args, engine, names, metrics, defaults, chat_template)
        try:
            state.loras = await serve_lora_modules(engine, names, engine_args, args.lora_modules, metrics,
                                                   client_index=index, num_clients=count)
        except ValueError as e:
            return _startup_error(report, str(e), 1)
        lifecycle = Lifecycle(count_request=metrics.api_server_requests.inc)
        state.lifecycle = lifecycle
        lifecycle.track_load = bool(getattr(args, "enable_server_load_tracking", False))
        state.dashboard = args.dashboard
        state.fastapi_docs = not getattr(args, "disable_fastapi_docs", False)
        state.cors = {"origins": getattr(args, "allowed_origins", ["*"]),
                      "methods": getattr(args, "allowed_methods", ["*"]),
                      "headers": getattr(args, "allowed_headers", ["*"]),
                      "credentials": bool(getattr(args, "allow_credentials", False))}
        fastapi_app = build_app(state)
        # The guard is outermost: every early answer inside it (the drain's 503, the key's 401) comes after the
        # request body was read, and its own refusals read the rest of the body before closing.
        # HotRoutes: the generating routes without the framework's per-request layers (hot_routes.py).
        # --middleware: around the hot routes too (every request passes it) and the drain's counts (a request is
        # done for /load when the app's part of it is, as in vLLM), inside the guard
        app = wrap_middlewares(DrainMiddleware(HotRoutes(fastapi_app, state), lifecycle), middlewares)
        if getattr(args, "enable_request_id_headers", False):  # (inside the guard: streams keep its direct writes)
            from pagedllm.entrypoints.openai.guards import RequestIdHeaders

            app = RequestIdHeaders(app)
        app = RequestGuard(app, max_body_bytes=args.max_request_body_bytes, send_timeout_s=args.send_timeout,
                           request_id_headers=bool(getattr(args, "enable_request_id_headers", False)))
        freeze_startup_objects()  # the tokenizer and the app, for the server's life: it allocates per chunk
        config = uvicorn.Config(app, log_level=args.log_level, access_log=not args.disable_uvicorn_access_log,
                                timeout_keep_alive=keep_alive_s, timeout_graceful_shutdown=5,
                                lifespan="off",
                                root_path=getattr(args, "root_path", None) or "",
                                ssl_keyfile=getattr(args, "ssl_keyfile", None),
                                ssl_certfile=getattr(args, "ssl_certfile", None),
                                ssl_ca_certs=getattr(args, "ssl_ca_certs", None),
                                ssl_cert_reqs=getattr(args, "ssl_cert_reqs", 0), **uvicorn_h11_settings(args))
        ready = None if report is None else (lambda: report.send(("ready", {
            "name": names[0], "model_dir": engine.model_dir, "max_model_len": engine.max_model_len})))
        server = server_class()(config, engine, lifecycle, shutdown_timeout=args.shutdown_timeout,
                                engine_dead_grace_period=args.engine_dead_grace_period, on_started=ready,
                                supervised=client is not None)
        if client is None:  # several API processes: the supervisor says it once all of them serve
            logger.info("Serving %s (from %s, max_model_len %d) at %s/v1", names[0], engine.model_dir,
                        engine.max_model_len, server_url(args))
        if state.dashboard:
            fastapi_app.state.dashboard.start()  # reads the counters every 5 s until a page opens
            if client is None:
                logger.info("Dashboard: %s/dashboard", server_url(args))
        _SERVING["started"] = True
        if report is not None:  # every API process listens at once, when the supervisor says (after all prepared)
            report.send(("prepared",))
            await asyncio.get_running_loop().run_in_executor(None, report.recv)
        await server.serve(sockets=[sock])
        return lifecycle.exit_code
    finally:
        await engine.shutdown()
        sock.close()


_SERVING = {"started": False}


def run_loop(main: Any) -> Any:
    """asyncio.run on uvloop when it is installed (a faster event loop: each streamed chunk is a few callbacks
    and a socket write), else on asyncio's own loop. uvicorn's `loop` setting does not apply here: the server runs
    inside this loop, beside the engine client."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main)
    uvloop.install()  # Python 3.10: through the event loop policy
    return asyncio.run(main)


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    if (getattr(args, "node_rank", 0) or 0) > 0:
        return run_worker_node(args)
    count = api_server_count(args)
    if count is None:
        return 2
    if count > 1:
        from pagedllm.entrypoints.openai.api_server_manager import serve_with_api_servers
        from pagedllm.entrypoints.openai.cli_args import to_engine_args

        return serve_with_api_servers(args, to_engine_args(args), count, run_api_child, bind_socket)
    try:
        return run_loop(serve(args))
    except KeyboardInterrupt:
        # uvicorn re-raises Ctrl-C / SIGINT after its graceful shutdown: that is a normal stop, not a failure.
        return 0 if _SERVING["started"] else 130


def api_server_count(args: argparse.Namespace) -> Optional[int]:
    """How many API server processes to run (None: the flags are wrong, said on stderr)."""
    from pagedllm.entrypoints.openai.api_server_manager import resolve_api_server_count
    from pagedllm.entrypoints.openai.chat_template import load_chat_template
    from pagedllm.entrypoints.openai.cli_args import check_unsupported_server_flags, to_engine_args

    try:
        engine_args = to_engine_args(args)
        engine_args.validate()
        check_unsupported_server_flags(args)
        load_chat_template(getattr(args, "chat_template", None), from_command_line=True)  # before any engine starts
        return resolve_api_server_count(args, engine_args)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def run_api_child(args: argparse.Namespace, client: Any, report: Any) -> None:
    """Entry point of one of several API server processes (spawned by api_server_manager)."""
    import signal

    from pagedllm.process_utils import set_process_name, watch_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the supervisor too, which sends SIGTERM
    set_process_name(f"pagedllm-api-{client.index}")
    # the supervisor is gone: nobody watches the engine cores for this process, nor removes the channels
    watch_parent(exit_code=1, leftovers=client.layout.directory)
    setup_logging(args.log_level, tag=f"api {client.index}")
    _SERVING["started"] = True
    code = run_loop(serve(args, client=client, report=report))
    report.close()
    sys.exit(code)


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
