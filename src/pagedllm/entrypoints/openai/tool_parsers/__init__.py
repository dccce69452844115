"""Tool-call parsers (vLLM's names for --tool-call-parser): hermes, llama3_json, mistral, pythonic, qwen3_coder,
or auto (picked from the chat template)."""
from __future__ import annotations

from typing import Optional

from pagedllm.entrypoints.openai.tool_parsers.base import (ExtractedToolCalls, ToolCall, ToolParser, make_call_id,
                                                         make_mistral_call_id)
from pagedllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedllm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedllm.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from pagedllm.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from pagedllm.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    # vLLM's names for the same formats (its docs give them for Llama 4): accepted as --tool-call-parser too
    "llama4_json": Llama3JsonToolParser,
    "llama4_pythonic": PythonicToolParser,
}
TOOL_PARSER_NAMES = ("auto",) + tuple(TOOL_PARSERS)


def detect_tool_parser(chat_template: Optional[str]) -> str:
    """The parser a chat template's tool format calls for; hermes when it shows none (then pagedllm describes
    the tools in the hermes format itself, see tool_prompt.py)."""
    t = chat_template or ""
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<function=" in t and "<parameter=" in t:  # Qwen3-Coder's XML calls (hermes would read them as JSON, fail)
        return "qwen3_coder"
    # Pythonic templates (Llama 3.2 / 4 pythonic, ToolACE, Gemma 3's) spell the format out as "[func_name1(...)]"
    # and may also have an ipython role and the word "parameters": checked before the llama3 JSON rule, which took them.
    if "[func_name1(" in t:
        return "pythonic"
    if "<|python_tag|>" in t or ("ipython" in t and "parameters" in t):
        return "llama3_json"
    if "<|python_start|>" in t:
        return "pythonic"
    return "hermes"


def get_tool_parser(name: str, tools: Optional[list[dict]] = None,
                    chat_template: Optional[str] = None) -> ToolParser:
    if name == "auto":
        name = detect_tool_parser(chat_template)
    if name not in TOOL_PARSERS:
        raise ValueError(f"Unknown tool call parser {name!r}; choose one of {', '.join(TOOL_PARSER_NAMES)}.")
    return TOOL_PARSERS[name](tools)


__all__ = ["ExtractedToolCalls", "ToolCall", "ToolParser", "TOOL_PARSERS", "TOOL_PARSER_NAMES", "detect_tool_parser",
           "get_tool_parser", "make_call_id", "make_mistral_call_id"]
