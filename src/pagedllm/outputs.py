"""What the user gets back: RequestOutput with one CompletionOutput per sample. Shapes follow vLLM.

Logprobs are per position a dict {token_id: Logprob}: the sampled token plus the top-k tokens of the
raw distribution (so a dict holds k or k + 1 entries).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union


@dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None  # 1 = most likely token
    decoded_token: Optional[str] = None


# One dict per generated position / per prompt position (the first prompt position has none).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[Optional[dict[int, Logprob]]]


@dataclass
class CompletionOutput:
    """One sample of a request. With output_kind "delta", text / token_ids / logprobs hold only what is new."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]  # None unless logprobs were requested
    logprobs: Optional[SampleLogprobs]
    # None while running; "stop" | "length" | "abort" | "error" (offline: the engine failed this request mid-run;
    # the warning logged says why)
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None  # stop string or stop token id; None for EOS / length
    # LLM.chat(..., tools=[...]): the calls parsed from text (entrypoints/openai/tool_parsers), else None.
    tool_calls: Optional[list] = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        lp = f"<{len(self.logprobs)} positions>" if self.logprobs is not None else None
        return (f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids}, "
                f"cumulative_logprob={self.cumulative_logprob}, logprobs={lp}, "
                f"finish_reason={self.finish_reason}, stop_reason={self.stop_reason!r})")


@dataclass
class RequestMetrics:
    """Monotonic timestamps (time.monotonic()) of one request's life, seen from the front end."""

    arrival_time: float
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None


@dataclass
class RequestOutput:
    """The state of one user request (all its n samples). finished: every sample has finished."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: Optional[list[int]]
    prompt_logprobs: Optional[PromptLogprobs]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: Optional[int] = None
    metrics: Optional[RequestMetrics] = field(default=None, repr=False)
    lora_request: Optional[Any] = None  # the LoRARequest it ran with (None: the base model)
    # An embedding request's pooled final hidden state, not yet normalized (pooling/; LLM.embed and /v1/embeddings
    # return pooling.EmbeddingRequestOutput built from it).
    pooled: Optional[list[float]] = field(default=None, repr=False)

    def __repr__(self) -> str:
        prompt_ids = self.prompt_token_ids
        if prompt_ids is not None and len(prompt_ids) > 16:
            prompt_ids = f"[{', '.join(map(str, prompt_ids[:16]))}, ... ({len(prompt_ids)} tokens)]"
        return (f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
                f"prompt_token_ids={prompt_ids}, outputs={self.outputs}, finished={self.finished}, "
                f"num_cached_tokens={self.num_cached_tokens})")
