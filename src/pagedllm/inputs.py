"""vLLM's prompt types (`vllm.inputs`): the prompt dicts LLM.generate, beam_search and embed take, typed, so a
vLLM script's `TokensPrompt(prompt_token_ids=[...])` runs unchanged. Text only: the engine refuses
multi_modal_data and the other multimodal keys with a ValueError naming them."""
from __future__ import annotations

from typing import TypedDict, Union


class _Text(TypedDict):
    prompt: str


class TextPrompt(_Text, total=False):
    cache_salt: str  # a prefix-cache salt: prompts with different salts share no cached blocks


class _Tokens(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_Tokens, total=False):
    prompt: str  # the text the ids stand for, reported back as RequestOutput.prompt (not tokenized again)
    cache_salt: str


PromptType = Union[str, list[int], TextPrompt, TokensPrompt]
