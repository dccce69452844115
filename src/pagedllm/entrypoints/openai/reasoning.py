"""Reasoning parsers (vLLM's --reasoning-parser): a thinking model's `<think> ... </think>` part of the answer goes to
the message's `reasoning` (vLLM's field; `reasoning_content` too, the DeepSeek name many clients read), the rest to
`content`, whole or streamed.

Where the reasoning starts is read from the prompt as well as the output: templates that open the think block in the
generation prompt (DeepSeek-R1's, Qwen3's thinking models) leave `<think>` unclosed at the prompt's end, so the answer
starts inside it; otherwise the answer opens it itself. `deepseek_r1` always starts inside (R1 always thinks);
`qwen3` only when the prompt or the output's first text opens it (thinking off: no tags, all content). An answer cut
off before `</think>` is all reasoning, streamed or not; a prompt that ends with a closed block (thinking off) starts
the answer outside it, for both parsers. A request under a grammar (response_format, structured
outputs, a required or named tool_choice) is split too: its grammar starts after the reasoning (vLLM's), the request
carrying the token ids of `</think>` (StructuredOutputsParams.reasoning_end) and whether the prompt already closed the
block (reasoning_ended); --structured-outputs-config '{"enable_in_reasoning": true}' keeps the grammar on the whole
answer instead (not split).
"""
from __future__ import annotations

from typing import Any, Optional

REASONING_PARSERS = ("deepseek_r1", "qwen3")
THINK_START, THINK_END = "<think>", "</think>"


def check_parser(name: Optional[str]) -> Optional[str]:
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, got {name!r}.")
    return name


def prompt_opens_thinking(prompt_text: Optional[str]) -> Optional[bool]:
    """True: the rendered prompt ends inside a think block (the template opened it for the answer); False: it ends
    with one closed (the template skipped the thinking, as Qwen3's and R1's do with thinking off); None: neither."""
    if not prompt_text:
        return None
    if prompt_text.rfind(THINK_START) > prompt_text.rfind(THINK_END):
        return True
    return False if prompt_text.rstrip().endswith(THINK_END) else None


def _holds_prefix(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (held back until the next delta)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStreamer:
    """One choice's text deltas -> (reasoning delta, content delta); finish() flushes what was held back. split() of
    the whole text gives what the deltas add up to."""

    def __init__(self, parser: str, prompt_opened: Optional[bool]) -> None:
        """prompt_opened: prompt_opens_thinking of the rendered prompt (deepseek_r1 starts inside the block unless
        the prompt closed it)."""
        self.parser = parser
        # "start": not decided (the output may open the block), "think": inside it, "content": after or without it
        inside = prompt_opened is True or (parser == "deepseek_r1" and prompt_opened is None)
        self.state = "think" if inside else "start"
        self.held = ""
        self.strip_start = True  # the reasoning's start: leading whitespace and the output's own <think> dropped
        self.strip_newlines = False  # after </think>: the newlines before the answer are dropped
        self.saw_reasoning = False

    def feed(self, text: str) -> tuple[str, str]:
        text = self.held + text
        self.held = ""
        reasoning = content = ""
        while text:
            if self.state == "start":
                stripped = text.lstrip()
                if stripped.startswith(THINK_START):
                    self.state, self.saw_reasoning = "think", True
                    text = stripped[len(THINK_START):]
                    continue
                if THINK_START.startswith(stripped):  # maybe the tag, not all of it here yet
                    self.held = text
                    break
                self.state = "content"
                continue
            if self.state == "think":
                self.saw_reasoning = True
                if self.strip_start:  # the reasoning's first text: whitespace and the output's own <think> dropped
                    stripped = text.lstrip()
                    if not stripped or (THINK_START.startswith(stripped) and stripped != THINK_START):
                        self.held = text  # whitespace, or a partial <think>: wait for more
                        break
                    if stripped.startswith(THINK_START):
                        text = stripped[len(THINK_START):]
                        continue
                    text, self.strip_start = stripped, False
                end = text.find(THINK_END)
                if end < 0:
                    keep = _holds_prefix(text, THINK_END)
                    reasoning += text[:len(text) - keep]
                    self.held = text[len(text) - keep:]
                    break
                reasoning += text[:end]
                text = text[end + len(THINK_END):]
                self.state, self.strip_newlines = "content", True
                continue
            if self.strip_newlines:
                text = text.lstrip("\n")
                if not text:
                    break
                self.strip_newlines = False
            content += text
            break
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        held, self.held = self.held, ""
        if self.state == "think":
            return held, ""
        return "", held

    def split(self, text: str) -> tuple[Optional[str], Optional[str]]:
        """(reasoning or None, content or None) of a whole answer."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        reasoning, content = r1 + r2, c1 + c2
        return (reasoning if self.saw_reasoning else None), (content if content or not self.saw_reasoning else None)


class ChoiceReasoning:
    """The reasoning split of a response's choices (one ReasoningStreamer per choice index)."""

    def __init__(self, parser: str, prompt_opened: Optional[bool], include: bool = True) -> None:
        self.parser, self.prompt_opened, self.include = parser, prompt_opened, include
        self.streamers: dict[int, ReasoningStreamer] = {}

    def feed(self, index: int, text: str, last: bool) -> tuple[str, str]:
        """(reasoning delta, content delta) of one choice's new text; `last`: its final delta (flushes)."""
        s = self.streamers.get(index)
        if s is None:
            s = self.streamers[index] = ReasoningStreamer(self.parser, self.prompt_opened)
        thought, content = s.feed(text)
        if last:
            more_thought, more_content = s.finish()
            thought, content = thought + more_thought, content + more_content
        return thought, content

    def split(self, text: str) -> tuple[Optional[str], Optional[str]]:
        return ReasoningStreamer(self.parser, self.prompt_opened).split(text)

    @staticmethod
    def fields(reasoning: Optional[str]) -> dict:
        """The message's (or delta's) reasoning: vLLM's `reasoning` and the DeepSeek name `reasoning_content`."""
        return {"reasoning": reasoning, "reasoning_content": reasoning}


def reasoning_end_ids(state: Any) -> Optional[list[int]]:
    """The token ids of THINK_END in the tokenizer of `state` (the server's state, an offline LLM; cached on it);
    None if it has none."""
    ids = getattr(state, "_reasoning_end_ids", False)
    if ids is False:
        try:
            ids = list(state.tokenizer.encode(THINK_END, add_special_tokens=False)) or None
        except Exception:  # noqa: BLE001 - a tokenizer that cannot say: the grammar covers the whole answer
            ids = None
        state._reasoning_end_ids = ids
    return ids


def prompt_thinking(tokenizer: Any, prompt_text: Optional[str], prompt_ids: list[int]) -> Optional[bool]:
    """prompt_opens_thinking of a prompt; without its text (token ids given, a truncated prompt), of its end's."""
    if prompt_text is None:  # its end, where an opened think block would be
        prompt_text = tokenizer.decode(prompt_ids[-64:])
    return prompt_opens_thinking(prompt_text)


def request_reasoning(state: Any, params: Any, prompt_text: Optional[str], prompt_ids: list[int],
                      include: bool = True) -> Optional[ChoiceReasoning]:
    """The reasoning split of a chat / responses request's answer (--reasoning-parser), or None: no parser, or a
    grammar shapes the whole answer (enable_in_reasoning). A request under a grammar gets its reasoning end marker
    here, so that its grammar starts after the reasoning. params None: no grammar (beam search)."""
    parser = getattr(state, "reasoning_parser", None)
    if parser is None:
        return None
    opened = prompt_thinking(state.tokenizer, prompt_text, prompt_ids)
    so = params.structured_outputs if params is not None else None
    if so is not None:
        end = None if getattr(state, "grammar_in_reasoning", False) else reasoning_end_ids(state)
        if end is None:
            return None
        # Thinking unless the prompt closed the block: R1 starts inside it, qwen3 may open it (as vLLM, the grammar
        # waits for the end marker either way).
        so.reasoning_end, so.reasoning_ended = end, opened is False
    return ChoiceReasoning(parser, opened, include)
