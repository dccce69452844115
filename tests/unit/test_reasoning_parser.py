"""--reasoning-parser: the split of a thinking model's answer into `reasoning` and `content`, whole and streamed at
every split point (the same result), and the chat endpoint's SSE chunks and full message built from engine outputs
carrying think tags (with tools, n > 1, include_reasoning false). The server end to end: tests/e2e/test_reasoning.py."""
from __future__ import annotations

import json
import random
from types import SimpleNamespace
from typing import Optional

import pytest

from pagedllm.entrypoints.openai.reasoning import ChoiceReasoning, ReasoningStreamer, prompt_opens_thinking
from pagedllm.outputs import CompletionOutput, RequestOutput

CASES = [
    # parser, the prompt opened <think> (True) / closed one at its end (False) / neither (None), answer ->
    # (reasoning, content)
    ("qwen3", None, "<think>\nLet me think.\n</think>\n\nParis.", ("Let me think.\n", "Paris.")),
    ("qwen3", None, "Paris is the capital.", (None, "Paris is the capital.")),  # thinking off: no tags
    ("qwen3", True, "Let me think.\n</think>\n\nParis.", ("Let me think.\n", "Paris.")),
    ("qwen3", False, "Paris.", (None, "Paris.")),
    ("qwen3", None, "  <think>x</think>y", ("x", "y")),
    ("qwen3", None, "Tags <think> mid-answer </think> stay content", (None, "Tags <think> mid-answer </think> stay "
                                                                         "content")),
    ("qwen3", None, "<think>cut off before the end </thi", ("cut off before the end </thi", None)),
    ("qwen3", None, "", (None, "")),
    ("qwen3", None, "<", (None, "<")),
    ("deepseek_r1", None, "hmm </think>\n\nanswer", ("hmm ", "answer")),  # R1 starts inside
    ("deepseek_r1", None, "<think>\nhmm</think>answer", ("hmm", "answer")),
    ("deepseek_r1", None, "cut off mid-thought", ("cut off mid-thought", None)),
    ("deepseek_r1", True, "a</think>", ("a", None)),
    ("deepseek_r1", False, "answer right away", (None, "answer right away")),  # the template closed the block
]


@pytest.mark.parametrize("parser, opened, text, want", CASES)
def test_whole_and_streamed_splits_agree(parser, opened, text, want) -> None:
    assert ReasoningStreamer(parser, opened).split(text) == want
    rng = random.Random(len(text))
    for _ in range(100):  # the same text in random pieces, one character to a few
        s = ReasoningStreamer(parser, opened)
        reasoning = content = ""
        i = 0
        while i < len(text):
            n = rng.randint(1, 5)
            r, c = s.feed(text[i:i + n])
            reasoning, content, i = reasoning + r, content + c, i + n
        r, c = s.finish()
        assert (reasoning + r, content + c) == (want[0] or "", want[1] or "")


def test_prompt_opened_think_block() -> None:
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n") is True
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n") is False  # thinking off
    assert prompt_opens_thinking("<think>old turn</think> answer<|im_start|>assistant\n") is None
    assert prompt_opens_thinking("<|im_start|>assistant\n") is None and prompt_opens_thinking(None) is None


class _Tok:
    def decode(self, ids):
        return ""


def _stream(req_fields: dict, parser: str = "qwen3", opened: Optional[bool] = None):
    from pagedllm.entrypoints.openai.chat_completions import _ChatStream
    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
    from pagedllm.entrypoints.openai.server_state import ServerState
    from pagedllm.entrypoints.openai.streaming import ChunkFramer
    from pagedllm.entrypoints.openai.tool_calling import plan_tools

    req = ChatCompletionRequest(messages=[{"role": "user", "content": "q"}], stream=True, **req_fields)
    state = ServerState(SimpleNamespace(tokenizer=_Tok()), ["m"])
    plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, "hermes", None)
    framer = ChunkFramer("r", "chat.completion.chunk", 0, "m", None)
    reasoning = ChoiceReasoning(parser, opened, bool(req.include_reasoning))
    return _ChatStream(req, state, [1], None, None, None, framer, plan, "r", reasoning), req, state, plan, reasoning


def _events(raw: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.decode().split("\n") if line.startswith("data: {")]


def _run(stream, steps: list[list[tuple[int, str, bool]]]) -> list[dict]:
    """Each step: (choice index, text, finished) per choice with news."""
    events = []
    for step in steps:
        outs = [CompletionOutput(i, text, [7] * max(1, len(text)), None, None, "stop" if done else None)
                for i, text, done in step]
        events += _events(stream.chunks(RequestOutput("r", None, [1], None, outs, False)))
    return events


def _collect(events: list[dict], index: int = 0) -> tuple[str, str, list]:
    reasoning = content = ""
    calls: list = []
    for e in events:
        for ch in e["choices"]:
            if ch["index"] != index:
                continue
            d = ch["delta"]
            assert d.get("reasoning") == d.get("reasoning_content")
            reasoning += d.get("reasoning") or ""
            content += d.get("content") or ""
            calls += d.get("tool_calls") or []
    return reasoning, content, calls


def test_stream_chunks_split_the_answer_as_the_full_message() -> None:
    from pagedllm.entrypoints.openai.chat_completions import _full_response

    pieces = ["<thi", "nk>\nStep one", ". Step two.</", "think>", "\n\nThe answer", " is 4."]
    stream, req, state, plan, reasoning = _stream({"n": 2})
    steps = [[(0, p, k == len(pieces) - 1), (1, "plain " + str(k), k == len(pieces) - 1)]
             for k, p in enumerate(pieces)]
    events = _run(stream, steps)
    assert _collect(events, 0)[:2] == ("Step one. Step two.", "The answer is 4.")
    assert _collect(events, 1)[:2] == ("", "".join("plain " + str(k) for k in range(len(pieces))))
    finals = [e["choices"][0]["finish_reason"] for e in events if e["choices"][0]["finish_reason"]]
    assert finals == ["stop", "stop"]
    final = RequestOutput("r", None, [1], None, [CompletionOutput(0, "".join(pieces), [7], None, None, "stop")], True)
    body = _full_response(req, state, "m", "r", 0, [1], final, plan, reasoning)
    message = body["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"] == "Step one. Step two."
    assert message["content"] == "The answer is 4."


def test_tool_calls_are_read_from_the_content_after_the_reasoning() -> None:
    from pagedllm.entrypoints.openai.chat_completions import _full_response

    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    answer = ('<think>I should call add.</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n'
              '</tool_call>')
    stream, req, state, plan, reasoning = _stream({"tools": tools})
    events = _run(stream, [[(0, answer[i:i + 7], i + 7 >= len(answer))] for i in range(0, len(answer), 7)])
    thought, content, calls = _collect(events)
    assert thought == "I should call add." and content == ""
    assert calls and calls[0]["function"]["name"] == "add" and json.loads(
        "".join(c["function"].get("arguments", "") for c in calls)) == {"a": 1}
    final = RequestOutput("r", None, [1], None, [CompletionOutput(0, answer, [7], None, None, "stop")], True)
    message = _full_response(req, state, "m", "r", 0, [1], final, plan, reasoning)["choices"][0]["message"]
    assert message["reasoning"] == "I should call add." and message["tool_calls"][0]["function"]["name"] == "add"
    assert not message["content"]


def test_include_reasoning_false_leaves_it_out() -> None:
    from pagedllm.entrypoints.openai.chat_completions import _full_response

    stream, req, state, plan, reasoning = _stream({"include_reasoning": False}, parser="deepseek_r1")
    events = _run(stream, [[(0, "secret thoughts</think>", False)], [(0, "Hello", True)]])
    assert _collect(events)[:2] == ("", "Hello")
    final = RequestOutput("r", None, [1], None,
                          [CompletionOutput(0, "secret thoughts</think>Hello", [7], None, None, "stop")], True)
    message = _full_response(req, state, "m", "r", 0, [1], final, plan, reasoning)["choices"][0]["message"]
    assert message["reasoning"] is None and message["content"] == "Hello"


def test_responses_stream_closes_the_reasoning_item_before_the_answer() -> None:
    from pagedllm.entrypoints.openai.responses import _ResponseShell, _ResponsesStream
    from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
    from pagedllm.entrypoints.openai.tool_calling import plan_tools

    req = ResponsesRequest(input="q", stream=True)
    shell = _ResponseShell(req, "m", "resp_1", 0, 3)
    stream = _ResponsesStream(None, None, None, shell, plan_tools(None, None, None, "hermes", None),
                              ChoiceReasoning("deepseek_r1", None))
    pieces = ["Think", "ing...</th", "ink>\n\nThe", " answer."]
    raw = b"".join(stream.frames([RequestOutput("r", None, [1], None, [CompletionOutput(
        0, p, [7], None, None, "stop" if k == len(pieces) - 1 else None)], False)]) for k, p in enumerate(pieces))
    events = [json.loads(line[6:]) for line in raw.decode().split("\n") if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "Thinking..."
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "The answer."
    final = events[-1]["response"]
    assert [(o["type"], o["status"]) for o in final["output"]] == [("reasoning", "completed"), ("message", "completed")]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1]


class _Tok:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [99] if text == "</think>" else [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def _state(**kw):
    return SimpleNamespace(**dict(dict(reasoning_parser="qwen3", tokenizer=_Tok(), grammar_in_reasoning=False), **kw))


def test_a_grammar_request_gets_the_reasoning_end_marker() -> None:
    """Under a grammar the split stays on and the request carries `</think>`'s ids: the grammar starts after them;
    a prompt that closed the block (thinking off) starts it at once; enable_in_reasoning: no split, grammar on all."""
    from pagedllm.entrypoints.openai.reasoning import request_reasoning
    from pagedllm.sampling_params import SamplingParams
    from pagedllm.structured_output import StructuredOutputsParams

    def params():
        return SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True))

    p = params()
    assert request_reasoning(_state(), p, "q\n<think>\n", []) is not None
    assert p.structured_outputs.reasoning_end == [99] and not p.structured_outputs.reasoning_ended
    p = params()
    assert request_reasoning(_state(), p, "q\n<think>\n\n</think>\n\n", []) is not None
    assert p.structured_outputs.reasoning_ended
    p = params()
    assert request_reasoning(_state(grammar_in_reasoning=True), p, "q\n<think>\n", []) is None
    assert p.structured_outputs.reasoning_end is None
    assert p.structured_outputs.key() == params().structured_outputs.key()  # one compiled grammar for both


def test_structured_outputs_config_reasoning_parser_is_checked() -> None:
    import argparse

    from pagedllm.entrypoints.openai.cli_args import check_reasoning_config

    check_reasoning_config(argparse.Namespace(structured_outputs_config={"reasoning_parser": "qwen3"},
                                              reasoning_parser="qwen3"))
    with pytest.raises(ValueError, match="must be one of"):
        check_reasoning_config(argparse.Namespace(structured_outputs_config={"reasoning_parser": "nope"}))
    with pytest.raises(ValueError, match="differs from --reasoning-parser"):
        check_reasoning_config(argparse.Namespace(structured_outputs_config={"reasoning_parser": "qwen3"},
                                                  reasoning_parser="deepseek_r1"))
