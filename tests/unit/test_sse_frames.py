"""The SSE frames of a streamed response (entrypoints/openai/streaming.py): the pre-built template of a running
plain choice gives byte for byte the frame the general path writes from a dict, for completions and chat, with
and without include_usage / continuous_usage_stats, for texts JSON must escape;
the chat stream's prefix (role, echo) for every choice."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pagedllm.entrypoints.openai.errors import dumps
from pagedllm.entrypoints.openai.streaming import ChunkFramer, usage_dict

TEXTS = ["", "Hello", ' "quoted" \\ back', "line\nbreak\ttab", "é🎉\u2028", "</script>", "\x00\x1f"]
OPTIONS = [None, True, SimpleNamespace(include_usage=False, continuous_usage_stats=False),
           SimpleNamespace(include_usage=True, continuous_usage_stats=False),
           SimpleNamespace(include_usage=False, continuous_usage_stats=True),
           SimpleNamespace(include_usage=True, continuous_usage_stats=True)]


@pytest.mark.parametrize("options", OPTIONS, ids=["none", "bool", "off", "usage", "continuous-alone", "continuous"])
@pytest.mark.parametrize("index", [0, 3])
def test_completion_template_is_the_dict_frame(options, index: int) -> None:
    framer = ChunkFramer("cmpl-1", "text_completion", 1700000000, 'm "q"', options)
    before, after = framer.template(b'{"index":%d,"text":' % index)
    for num_gen, text in enumerate(TEXTS, start=1):
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": None, "stop_reason": None}
        usage = usage_dict(7, num_gen) if framer.continuous_usage else None
        frame = before + dumps(text) + after + framer.end(7, num_gen)
        assert frame == framer.choices([choice], usage)
        body = json.loads(frame[len(b"data: "):])
        assert body["choices"][0]["text"] == text and frame.endswith(b"}\n\n")


@pytest.mark.parametrize("options", OPTIONS, ids=["none", "bool", "off", "usage", "continuous-alone", "continuous"])
def test_chat_template_is_the_dict_frame(options) -> None:
    framer = ChunkFramer("chatcmpl-1", "chat.completion.chunk", 1700000000, "m", options)
    for index in (0, 1):
        before, after = framer.template(b'{"index":%d,"delta":{"content":' % index, b"}")
        for num_gen, text in enumerate(TEXTS, start=1):
            choice = {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None,
                      "stop_reason": None}
            usage = usage_dict(3, num_gen) if framer.continuous_usage else None
            assert before + dumps(text) + after + framer.end(3, num_gen) == framer.choices([choice], usage)


@pytest.mark.parametrize("options", OPTIONS, ids=["none", "bool", "off", "usage", "continuous-alone", "continuous"])
def test_direct_framer_is_direct_frame(options) -> None:
    """SSEStream.direct_framer (the closure the output handler calls per token) writes byte for byte what
    direct_frame writes, and counts the tokens the same (the usage chunk at the end reads num_gen)."""
    from pagedllm.entrypoints.openai.streaming import SSEStream

    def stream() -> SSEStream:
        s = SSEStream(None, None, None, ChunkFramer("cmpl-1", "text_completion", 1700000000, "m", options))
        s.templates = [s.framer.template(b'{"index":0,"text":')]
        s.num_prompt, s.num_gen = 5, 1
        return s

    a, b = stream(), stream()
    frame = b.direct_framer()
    for n, text in enumerate(TEXTS, start=1):
        assert frame(text, n) == a.direct_frame(text, n)
        assert a.num_gen == b.num_gen


def test_continuous_usage_stats_need_include_usage() -> None:
    """As vLLM: continuous_usage_stats alone adds no usage (a client that left include_usage off gets neither
    per-chunk usage nor the final usage-only chunk); with include_usage it puts the usage on every chunk."""
    alone = ChunkFramer("c", "text_completion", 1, "m", SimpleNamespace(include_usage=False,
                                                                       continuous_usage_stats=True))
    both = ChunkFramer("c", "text_completion", 1, "m", SimpleNamespace(include_usage=True,
                                                                      continuous_usage_stats=True))
    assert (alone.include_usage, alone.continuous_usage) == (False, False)
    assert (both.include_usage, both.continuous_usage) == (True, True)


@pytest.mark.parametrize("token_ids", [False, True])
def test_chat_stream_prefix_echoes_every_choice(token_ids: bool) -> None:
    """The role chunk, then the echo (chat `echo` of a continued assistant message), for each choice: with
    return_token_ids too, whose prompt ids ride on choice 0's role chunk."""
    from pagedllm.entrypoints.openai.chat_completions import _ChatStream
    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
    from pagedllm.entrypoints.openai.server_state import ServerState
    from pagedllm.entrypoints.openai.tool_calling import ToolPlan

    req = ChatCompletionRequest(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "My"}],
                                stream=True, echo=True, n=2, return_token_ids=token_ids)
    state = ServerState(SimpleNamespace(tokenizer=None), ["m"])
    stream = _ChatStream(req, state, [5, 6], None, None, None, ChunkFramer("r", "chat.completion.chunk", 0, "m", None),
                         ToolPlan("none"), "r")
    events = [json.loads(e[6:]) for e in stream.prefix().decode().split("\n\n") if e.startswith("data: {")]
    echoed = {i: "".join(c["delta"].get("content", "") for e in events for c in e["choices"] if c["index"] == i)
              for i in (0, 1)}
    assert echoed == {0: "My", 1: "My"}
    assert [e.get("prompt_token_ids") for e in events][0] == ([5, 6] if token_ids else None)
