"""The `vllm` console script: `vllm serve|run-batch|chat|complete|bench ...` run pagedllm's commands."""
from __future__ import annotations

from typing import Optional


def main(argv: Optional[list[str]] = None) -> None:
    from pagedllm.entrypoints.cli.main import main as pagedllm_main

    pagedllm_main(argv, prog="vllm")


if __name__ == "__main__":
    main()
