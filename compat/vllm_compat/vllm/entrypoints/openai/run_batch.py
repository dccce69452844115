"""`python -m vllm.entrypoints.openai.run_batch -i IN.jsonl -o OUT.jsonl --model M` runs pagedllm's batch runner."""
import sys

from pagedllm.entrypoints.openai.run_batch import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="python -m vllm.entrypoints.openai.run_batch"))
