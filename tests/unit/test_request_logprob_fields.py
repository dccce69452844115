"""The server's checks of the logprob counts a request asks for, against vLLM's server."""
from __future__ import annotations

import pytest

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.request_params import check_logprob_fields


def _req(**kw) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "x", **kw})


def test_prompt_logprobs_minus_one_is_the_whole_vocabulary():
    # vLLM's server takes prompt_logprobs=-1 (every token of the vocabulary) where --max-logprobs allows it
    # (-1: the server state's limit is then the vocabulary's size); it was refused as "not between 0 and N".
    vocab = 64
    req = _req(prompt_logprobs=-1)
    check_logprob_fields(req, vocab, top_name="logprobs", top=None, vocab_size=vocab)
    with pytest.raises(APIError, match="prompt_logprobs must be between 0 and 20"):
        check_logprob_fields(req, 20, top_name="logprobs", top=None, vocab_size=vocab)
    with pytest.raises(APIError, match="prompt_logprobs must be between"):
        check_logprob_fields(_req(prompt_logprobs=-2), vocab, top_name="logprobs", top=None, vocab_size=vocab)
    with pytest.raises(APIError, match="logprobs must be between"):  # logprobs itself takes no -1 (vLLM)
        check_logprob_fields(_req(logprobs=-1), vocab, top_name="logprobs", top=-1, vocab_size=vocab)
