from pagedllm.inputs import PromptType, TextPrompt, TokensPrompt  # noqa: F401
