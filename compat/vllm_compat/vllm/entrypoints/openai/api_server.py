"""`python -m vllm.entrypoints.openai.api_server --model M ...` runs pagedllm's server."""
from pagedllm.entrypoints.openai.api_server import main

if __name__ == "__main__":
    main()
