from pagedllm.outputs import CompletionOutput, RequestOutput  # noqa: F401
