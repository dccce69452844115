"""`pagedllm chat` and `pagedllm complete`: small clients for any OpenAI-compatible server (openai SDK).

Interactive by default (history kept in chat; answers stream as they are generated); `-q MSG` asks once.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

from pagedllm.entrypoints.cli.arg_types import non_negative_float, positive_int


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://localhost:8000/v1", help="the server's OpenAI base URL")
    p.add_argument("--model-name", default=None, help="model to use (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None, help="API key (default: $OPENAI_API_KEY, else 'EMPTY')")
    p.add_argument("-q", "--quick", default=None, metavar="MESSAGE", help="send one message, print the answer, exit")
    # checked here: the server's 400 for a bad value ended an interactive session at its first question
    p.add_argument("--max-tokens", type=positive_int, default=None)
    p.add_argument("--temperature", type=non_negative_float, default=None)
    p.add_argument("--no-stream", action="store_true", help="wait for the whole answer instead of streaming")


def add_chat_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    _add_common(p)
    p.add_argument("--system-prompt", default=None)
    return p


def add_complete_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    _add_common(p)
    return p


def _client(args: argparse.Namespace) -> tuple[Any, str]:
    import openai

    try:  # no --api-key: the SDK reads $OPENAI_API_KEY; with neither, a keyless server still answers
        client = openai.OpenAI(base_url=args.url, api_key=args.api_key)
    except openai.OpenAIError:
        client = openai.OpenAI(base_url=args.url, api_key="EMPTY")
    model = args.model_name
    if model is None:
        models = client.models.list().data
        if not models:
            raise SystemExit(f"error: {args.url} serves no models")
        model = models[0].id
    return client, model


def _extra(args: argparse.Namespace) -> dict:
    kw: dict = {}
    if args.max_tokens is not None:
        kw["max_tokens"] = args.max_tokens
    if args.temperature is not None:
        kw["temperature"] = args.temperature
    return kw


def _reasoning(message: Any) -> Optional[str]:
    """A message's or delta's reasoning (a server with --reasoning-parser: vLLM's `reasoning`, DeepSeek's
    `reasoning_content`)."""
    return getattr(message, "reasoning", None) or getattr(message, "reasoning_content", None)


def _chat_once(client: Any, model: str, messages: list[dict], args: argparse.Namespace) -> str:
    """The answer on stdout; a thinking model's reasoning on stderr as it comes (stdout stays the answer)."""
    if args.no_stream:
        resp = client.chat.completions.create(model=model, messages=messages, **_extra(args))
        thought = _reasoning(resp.choices[0].message)
        if thought:
            print(thought, file=sys.stderr, flush=True)
        text = resp.choices[0].message.content or ""
        print(text, flush=True)
        return text
    parts: list[str] = []
    thinking = False
    for chunk in client.chat.completions.create(model=model, messages=messages, stream=True, **_extra(args)):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        thought = _reasoning(delta)
        if thought:
            thinking = True
            print(thought, end="", file=sys.stderr, flush=True)
        if delta.content:
            if thinking:
                print(file=sys.stderr, flush=True)
                thinking = False
            parts.append(delta.content)
            print(delta.content, end="", flush=True)
    if thinking:
        print(file=sys.stderr, flush=True)
    print(flush=True)
    return "".join(parts)


def _complete_once(client: Any, model: str, prompt: str, args: argparse.Namespace) -> str:
    kw = _extra(args)
    if args.no_stream:
        text = client.completions.create(model=model, prompt=prompt, **kw).choices[0].text
        print(text, flush=True)
        return text
    parts = []
    for chunk in client.completions.create(model=model, prompt=prompt, stream=True, **kw):
        if chunk.choices and chunk.choices[0].text:
            parts.append(chunk.choices[0].text)
            print(chunk.choices[0].text, end="", flush=True)
    print(flush=True)
    return "".join(parts)


def _read(prompt: str) -> Optional[str]:
    try:
        return input(prompt)
    except (EOFError, KeyboardInterrupt):
        print(file=sys.stderr)
        return None


def _connection_guard(func):
    def wrapper(args: argparse.Namespace) -> int:
        import openai

        try:
            return func(args)
        except openai.APIConnectionError:
            print(f"error: cannot reach a server at {args.url} (start one with `pagedllm serve`)", file=sys.stderr)
            return 1
        except openai.APIStatusError as e:
            message = e.message
            if isinstance(e.body, dict) and isinstance(e.body.get("message"), str):
                message = e.body["message"]
            print(f"error: {e.status_code}: {message}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # Ctrl-C while an answer streams: quit, as the banner says, not with a traceback
            print(file=sys.stderr)
            return 130
    return wrapper


@_connection_guard
def run_chat(args: argparse.Namespace) -> int:
    client, model = _client(args)
    messages: list[dict] = []
    if args.system_prompt:
        messages.append({"role": "system", "content": args.system_prompt})
    if args.quick is not None:
        messages.append({"role": "user", "content": args.quick})
        _chat_once(client, model, messages, args)
        return 0
    print(f"Using model {model} at {args.url}. Ctrl-D or Ctrl-C to quit.", file=sys.stderr)
    while True:
        line = _read("> ")
        if line is None:
            return 0
        messages.append({"role": "user", "content": line})
        answer = _chat_once(client, model, messages, args)
        messages.append({"role": "assistant", "content": answer})


@_connection_guard
def run_complete(args: argparse.Namespace) -> int:
    client, model = _client(args)
    if args.quick is not None:
        _complete_once(client, model, args.quick, args)
        return 0
    print(f"Using model {model} at {args.url}. Ctrl-D or Ctrl-C to quit.", file=sys.stderr)
    while True:
        line = _read("> ")
        if line is None:
            return 0
        _complete_once(client, model, line, args)
