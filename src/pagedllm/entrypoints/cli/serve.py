"""`pagedllm serve [MODEL] [flags]`: the OpenAI-compatible server (see entrypoints/openai/api_server.py)."""
from __future__ import annotations

import argparse
from typing import Optional


def add_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from pagedllm.entrypoints.openai.cli_args import add_serve_args

    return add_serve_args(p, positional_model=True)


def run(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.openai.api_server import run as run_server

    return run_server(args)


def main(argv: list[str], prog: str = "pagedllm serve") -> Optional[int]:
    from pagedllm.entrypoints.openai.cli_args import parse_serve_args

    parser = argparse.ArgumentParser(prog=prog, description="start the OpenAI-compatible server")
    add_args(parser)
    return run(parse_serve_args(parser, argv))
