"""`python -m pagedllm ...`: the `pagedllm` command, for environments without its console script on PATH."""
from pagedllm.entrypoints.cli.main import main

if __name__ == "__main__":
    main(prog="pagedllm")
