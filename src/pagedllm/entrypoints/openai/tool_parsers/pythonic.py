"""Pythonic format (Llama 3.2 / 4, ToolACE): `[get_weather(city="Paris"), get_time()]`, a Python list of calls
whose arguments are literals (JSON's true / false / null are accepted too)."""
from __future__ import annotations

import ast
import json
from typing import Any, Optional

from pagedllm.entrypoints.openai.tool_parsers.base import ToolCall, ToolParser

_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.AST) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Tuple):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


class PythonicToolParser(ToolParser):
    name = "pythonic"
    start_markers = ("[", "<|python_start|>")
    markers_at_start_only = True
    # No stream_reader: the calls go out whole at the end. Whether the text is calls at all is known only once the
    # whole list parses as Python (ast), and arguments are Python literals ('x', (1, 2), True) whose JSON text is
    # not known piece by piece as they are written (vLLM re-parses the list with guessed closing brackets).

    def _extract(self, text: str) -> tuple[Optional[list[ToolCall]], Optional[str]]:
        body = text.strip()
        if body.startswith("<|python_start|>"):
            body = body[len("<|python_start|>"):].strip()
        if body.endswith("<|python_end|>"):
            body = body[:-len("<|python_end|>")].strip()
        if not (body.startswith("[") and body.endswith("]")):
            return None, text
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None, text
        calls = []
        for node in tree.elts:
            # (positional arguments and ** unpacking have no parameter names to map to: not a call in this format)
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args \
                    or any(kw.arg is None for kw in node.keywords):
                return None, text
            args = {kw.arg: _literal(kw.value) for kw in node.keywords}
            calls.append(ToolCall(name=node.func.id, arguments=json.dumps(args, ensure_ascii=False)))
        return calls, None
