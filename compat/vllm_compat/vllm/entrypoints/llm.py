from pagedllm.entrypoints.llm import LLM  # noqa: F401
