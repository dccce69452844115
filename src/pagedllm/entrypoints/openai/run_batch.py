"""`pagedllm run-batch -i IN.jsonl -o OUT.jsonl [MODEL] [serve's flags]`: vLLM's offline batch runner.

The input is an OpenAI batch file: one request a line, `{"custom_id", "method": "POST", "url", "body"}`. Each runs
through the server's own app in this process (no port), so a body means what it means to `pagedllm serve`. The
output has one line per input line, in input order: `{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"}`. A line that fails (bad JSON, an unknown url, a refused body) gets its error on its own output
line; the rest of the file still runs. The exit code is non-zero only when the run itself fails (the input cannot be
read, the output cannot be written, the engine does not start). IN and OUT may be local paths, http(s) URLs
(read with GET, written with PUT) or `-` (stdin / stdout).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import uuid
from typing import Any, Optional

logger = logging.getLogger("pagedllm.run_batch")

# vLLM's batch urls (the same routes `pagedllm serve` answers)
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/score", "/v1/rerank",
              "/v1/responses")
# requests in flight at once: the engine batches them; a bound keeps a large file's memory in check
MAX_IN_FLIGHT = 1024


def add_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from pagedllm.entrypoints.openai.cli_args import add_serve_args

    p.add_argument("-i", "--input-file", required=True, metavar="IN",
                   help="the OpenAI batch file: a local path, an http(s) URL, or - for stdin")
    p.add_argument("-o", "--output-file", required=True, metavar="OUT",
                   help="where the results go: a local path, an http(s) URL (written with PUT), or - for stdout")
    p.add_argument("--disable-progress-bar", action="store_true", help="no progress bar on stderr")
    return add_serve_args(p, positional_model=True)


def _new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def _output(custom_id: Any, status: Optional[int], body: Any, error: Any) -> dict:
    """One output line. `error`: the error object of a failed request (vLLM's `error`), else None; its
    `response.body` holds what the server answered (the error body too, as OpenAI's output file does)."""
    response = None if status is None else {"status_code": status, "request_id": _new_id("pagedllm-batch-"),
                                            "body": body}
    return {"id": _new_id("pagedllm-"), "custom_id": custom_id, "response": response, "error": error}


def _line_error(custom_id: Any, message: str, status: int = 400) -> dict:
    from pagedllm.entrypoints.openai.errors import error_body

    body = error_body(message, status)
    return _output(custom_id, status, body, body["error"])


def parse_line(line: str, seen: set) -> tuple[Any, Optional[dict], Optional[dict]]:
    """(custom_id, request, None) for a line that can run, else (custom_id, None, its error output line)."""
    try:
        item = json.loads(line)
    except ValueError as e:
        return None, None, _line_error(None, f"the line is not valid JSON: {e}")
    if not isinstance(item, dict):
        return None, None, _line_error(None, "a batch line must be a JSON object with custom_id, method, url, body")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return custom_id, None, _line_error(custom_id, "'custom_id' must be a non-empty string")
    if custom_id in seen:  # OpenAI's batch files need unique ids: the output could not tell the two apart
        return custom_id, None, _line_error(custom_id, f"duplicate custom_id {custom_id!r}")
    seen.add(custom_id)
    method = item.get("method", "POST")
    if not isinstance(method, str) or method.upper() != "POST":
        return custom_id, None, _line_error(custom_id, f"'method' must be POST, got {method!r}")
    url = item.get("url")
    if url not in BATCH_URLS:
        return custom_id, None, _line_error(custom_id, f"'url' must be one of {', '.join(BATCH_URLS)}, got {url!r}")
    body = item.get("body")
    if not isinstance(body, dict):
        return custom_id, None, _line_error(custom_id, "'body' must be a JSON object")
    if body.get("stream"):  # one JSON answer a line: a stream has no place in the output file
        return custom_id, None, _line_error(custom_id, "streaming is not supported in a batch ('stream': true)")
    return custom_id, {"url": url, "body": body}, None


async def run_one(client: Any, custom_id: str, request: dict) -> dict:
    # the body as the line spelled it (NaN included: httpx's json= refuses it, the server answers it as over HTTP)
    resp = await client.post(request["url"], content=json.dumps(request["body"]).encode(),
                             headers={"content-type": "application/json"})
    try:
        body = resp.json()
    except ValueError:
        body = {"error": {"message": resp.text, "type": "InternalServerError", "param": None,
                          "code": resp.status_code}}
    if resp.status_code >= 400:
        error = body.get("error") if isinstance(body, dict) and isinstance(body.get("error"), dict) else body
        return _output(custom_id, resp.status_code, body, error)
    return _output(custom_id, resp.status_code, body, None)


def batch_lines(text: str) -> list[str]:
    """The file's lines, split at LF (CRLF too) only, as JSONL is: str.splitlines also splits at U+2028, U+0085,
    form feeds and the like, which JSON leaves raw inside strings (json.dumps with ensure_ascii=False), so one
    request became two lines of invalid JSON."""
    return [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]


def read_input(path: str) -> str:
    """The file's text without a leading UTF-8 byte-order mark (editors on Windows write one: it made the first
    line invalid JSON, and a file of only a BOM a batch of one failed line instead of an empty one)."""
    if path == "-":
        text = sys.stdin.read()
    elif path.startswith(("http://", "https://")):
        import httpx

        resp = httpx.get(path, follow_redirects=True, timeout=60)
        resp.raise_for_status()
        text = resp.text
    else:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    return text[1:] if text.startswith("\ufeff") else text


def write_output(path: str, text: str) -> None:
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    if path.startswith(("http://", "https://")):
        import httpx

        httpx.put(path, content=text.encode(), timeout=60).raise_for_status()
        return
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _progress(total: int, disabled: bool) -> Any:
    from pagedllm import envs

    if disabled or envs.PAGEDLLM_DISABLE_PROGRESS_BARS or total == 0:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="Running batch", unit="req", file=sys.stderr)


async def run_lines(app: Any, lines: list[str], disable_progress: bool = False) -> list[dict]:
    """Each non-blank line's output, in input order."""
    import httpx

    seen: set = set()
    parsed = [parse_line(line, seen) for line in lines if line.strip()]
    bar = _progress(len(parsed), disable_progress)
    limit = asyncio.Semaphore(MAX_IN_FLIGHT)

    async def one(client: Any, custom_id: Any, request: Optional[dict], error: Optional[dict]) -> dict:
        if error is not None:
            out = error
        else:
            async with limit:
                try:
                    out = await run_one(client, custom_id, request)
                except Exception as e:  # noqa: BLE001 - this line's 500: the other lines still run
                    out = _line_error(custom_id, f"{type(e).__name__}: {e}", 500)
        if bar is not None:
            bar.update(1)
        return out

    # raise_app_exceptions=False: an unexpected error is that line's 500, as the server answers it
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://pagedllm-batch", timeout=None) as client:
            return list(await asyncio.gather(*(one(client, *p) for p in parsed)))
    finally:
        if bar is not None:
            bar.close()


async def run_batch(args: argparse.Namespace, text: str) -> int:
    from pagedllm.entrypoints.async_engine import AsyncEngine, EngineStartupError
    from pagedllm.entrypoints.openai.api_server import configure_state, served_names
    from pagedllm.entrypoints.openai.app import build_app
    from pagedllm.entrypoints.openai.chat_template import load_chat_template
    from pagedllm.entrypoints.openai.cli_args import check_unsupported_server_flags, to_engine_args
    from pagedllm.entrypoints.openai.hot_routes import HotRoutes
    from pagedllm.entrypoints.openai.lifecycle import Lifecycle
    from pagedllm.entrypoints.openai.lora_models import serve_lora_modules
    from pagedllm.generation_config import load_sampling_defaults
    from pagedllm.metrics import Metrics

    try:
        engine_args = to_engine_args(args)
        engine_args.validate()
        check_unsupported_server_flags(args)
        chat_template = load_chat_template(getattr(args, "chat_template", None), from_command_line=True)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    names = served_names(args)
    metrics = Metrics(names[0], num_engines=engine_args.data_parallel_size)
    engine = AsyncEngine(engine_args, log_level=args.log_level if args.log_level != "trace" else "debug",
                         metrics=metrics)
    try:
        try:
            await engine.start(startup_timeout_s=args.startup_timeout)
            defaults = load_sampling_defaults(engine_args.generation_config, engine.model_dir,
                                              engine_args.override_generation_config)
        except EngineStartupError as e:
            print(f"error: the engine failed to start: {e}", file=sys.stderr)
            return 1
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        state = configure_state(args, engine, names, metrics, defaults, chat_template)
        state.api_key = None  # no HTTP here: the batch's own requests need no key
        try:
            state.loras = await serve_lora_modules(engine, names, engine_args, args.lora_modules, metrics)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        state.lifecycle = Lifecycle(count_request=metrics.api_server_requests.inc)
        state.dashboard = False
        outputs = await run_lines(HotRoutes(build_app(state), state), batch_lines(text), args.disable_progress_bar)
        # the engine died under the batch: its lines say so (503s), and the run failed
        code = 0 if engine.is_healthy() else 1
    finally:
        await engine.shutdown()
    try:
        write_output(args.output_file, "".join(json.dumps(o, ensure_ascii=False) + "\n" for o in outputs))
    except Exception as e:  # noqa: BLE001 - one line, not a traceback: the results could not be saved
        print(f"error: cannot write {args.output_file}: {e}", file=sys.stderr)
        return 1
    failed = sum(1 for o in outputs if o["error"] is not None)
    logger.info("Batch done: %d requests, %d succeeded, %d failed", len(outputs), len(outputs) - failed, failed)
    if code:
        print(f"error: the engine stopped: {engine.dead_reason}", file=sys.stderr)
    return code


def run(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.openai.api_server import run_loop, setup_logging

    setup_logging(args.log_level)
    try:  # read before the engine loads: a missing file fails at once
        text = read_input(args.input_file)
    except Exception as e:  # noqa: BLE001 - one line, not a traceback
        print(f"error: cannot read {args.input_file}: {e}", file=sys.stderr)
        return 1
    out = args.output_file
    if out != "-" and not out.startswith(("http://", "https://")):  # now, not after the whole batch ran
        from pagedllm.entrypoints.cli.arg_types import output_problem

        folder = os.path.dirname(os.path.abspath(out))
        # (write_output makes no folders; output_problem alone would pass a missing one)
        problem = f"no such directory {folder}" if not os.path.isdir(folder) else output_problem(out)
        if problem:
            print(f"error: cannot write {out}: {problem}", file=sys.stderr)
            return 1
    if not text.strip():  # nothing to run: an empty output, without loading a model
        try:
            write_output(args.output_file, "")
        except Exception as e:  # noqa: BLE001 - one line, not a traceback
            print(f"error: cannot write {args.output_file}: {e}", file=sys.stderr)
            return 1
        return 0
    return run_loop(run_batch(args, text))


def main(argv: list[str], prog: str = "pagedllm run-batch") -> Optional[int]:
    from pagedllm.entrypoints.openai.cli_args import parse_serve_args

    parser = argparse.ArgumentParser(prog=prog, description="run an OpenAI batch file (JSONL) offline")
    add_args(parser)
    return run(parse_serve_args(parser, argv))


if __name__ == "__main__":  # vLLM's other spelling: python -m vllm.entrypoints.openai.run_batch -i IN -o OUT --model M
    sys.exit(main(sys.argv[1:], prog="python -m pagedllm.entrypoints.openai.run_batch"))
