"""`pagedllm` console script: serve | run-batch | chat | complete | bench {serve,sweep,throughput,latency} | --version.

Each subcommand registers its own flags and imports its heavy modules only when it runs, so
`pagedllm --help` stays fast (no torch, no transformers, no FastAPI).
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional


class _Sub:
    """A subcommand: name, help, how to add flags, and the module:function that runs it (imported lazily)."""

    def __init__(self, name: str, help_: str, add_args: str, run: str) -> None:
        self.name, self.help, self.add_args, self.run = name, help_, add_args, run

    def _load(self, spec: str):
        import importlib

        module, func = spec.split(":")
        return getattr(importlib.import_module(module), func)


_PKG = "pagedllm.entrypoints.cli"
SUBCOMMANDS = [
    _Sub("serve", "start the OpenAI-compatible server", f"{_PKG}.serve:add_args", f"{_PKG}.serve:run"),
    _Sub("run-batch", "run an OpenAI batch file (JSONL) offline, as vLLM's run-batch",
         "pagedllm.entrypoints.openai.run_batch:add_args", "pagedllm.entrypoints.openai.run_batch:run"),
    _Sub("chat", "chat with a running server (interactive, or one question with -q)",
         f"{_PKG}.clients:add_chat_args", f"{_PKG}.clients:run_chat"),
    _Sub("complete", "complete prompts against a running server", f"{_PKG}.clients:add_complete_args",
         f"{_PKG}.clients:run_complete"),
]
BENCH = [
    _Sub("serve", "load-test a running server (streaming; TTFT / TPOT / ITL)", f"{_PKG}.bench_serve:add_args",
         f"{_PKG}.bench_serve:run"),
    _Sub("sweep", "bench serve at several request rates (default 1,2,4,8,inf): table + throughput-latency plot",
         f"{_PKG}.bench_serve:add_sweep_args", f"{_PKG}.bench_serve:run_sweep"),
    _Sub("throughput", "offline throughput of the engine (pagedllm.LLM)", f"{_PKG}.bench_offline:add_throughput_args",
         f"{_PKG}.bench_offline:run_throughput"),
    _Sub("latency", "offline latency of one batch (time per step)", f"{_PKG}.bench_offline:add_latency_args",
         f"{_PKG}.bench_offline:run_latency"),
]


def _version() -> str:
    from pagedllm import __version__

    return __version__


def build_parser(prog: str = "pagedllm") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="pagedllm: LLM inference and serving engine")
    parser.add_argument("-v", "--version", action="version", version=f"%(prog)s {_version()}")
    subs = parser.add_subparsers(dest="command", metavar="COMMAND")
    for sub in SUBCOMMANDS:
        p = subs.add_parser(sub.name, help=sub.help, description=sub.help)
        sub._load(sub.add_args)(p)
        p.set_defaults(_run=sub.run, _sub=sub)
    bench = subs.add_parser("bench", help="benchmarks: serve | sweep | throughput | latency")
    bench_subs = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    for sub in BENCH:
        p = bench_subs.add_parser(sub.name, help=sub.help, description=sub.help)
        sub._load(sub.add_args)(p)
        p.set_defaults(_run=sub.run, _sub=sub)
    bench.set_defaults(_parser=bench)
    return parser


def main(argv: Optional[list[str]] = None, prog: str = "pagedllm") -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(prog)
    if argv and argv[0] == "serve":
        # serve parses its own flags (so --config YAML can supply defaults before the command line wins)
        from pagedllm.entrypoints.cli.serve import main as serve_main

        sys.exit(serve_main(argv[1:], prog=f"{prog} serve"))
    if argv and argv[0] == "run-batch":  # serve's flags, --config included
        from pagedllm.entrypoints.openai.run_batch import main as batch_main

        sys.exit(batch_main(argv[1:], prog=f"{prog} run-batch"))
    args = parser.parse_args(argv)
    if not hasattr(args, "_run"):
        (getattr(args, "_parser", None) or parser).print_help()
        sys.exit(2)
    sub: _Sub = args._sub
    try:
        code = sub._load(args._run)(args)
    except KeyboardInterrupt:  # Ctrl-C stops a benchmark (or a client): the shell's code, not a traceback
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code or 0)


if __name__ == "__main__":
    main()
