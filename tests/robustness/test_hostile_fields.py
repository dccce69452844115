"""Hostile request fields against a real server: huge n / max_tokens / logprobs / stop lists / message and
prompt counts, deep nesting, NaN and overflowing numbers -> a 400 whose message names the limit; the
server keeps serving."""
from __future__ import annotations

import json

import httpx
import pytest

for _dep in ("fastapi", "pydantic", "msgspec", "zmq"):  # absent where only the engine is installed (GPU machine)
    pytest.importorskip(_dep, reason=f"the OpenAI server's modules need {_dep}")

from pagedllm.entrypoints.openai import limits  # noqa: E402

MSG = [{"role": "user", "content": "hi"}]
CASES = [
    ("/v1/completions", {"prompt": "hi", "n": 10 ** 6}, f"at most {limits.MAX_N}"),
    ("/v1/chat/completions", {"messages": MSG, "n": limits.MAX_N + 1}, f"at most {limits.MAX_N}"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10 ** 9}, "maximum context length is 512"),
    ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": 2 ** 62}, "maximum context length"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2 ** 70}, "out of range"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 10 ** 6}, "logprobs"),
    ("/v1/chat/completions", {"messages": MSG, "logprobs": True, "top_logprobs": 10 ** 6}, "top_logprobs"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 10 ** 4}, f"at most {limits.MAX_STOP_STRINGS} strings"),
    ("/v1/completions", {"prompt": "hi", "stop": "x" * 10 ** 4}, f"{limits.MAX_STOP_STRING_CHARS} characters"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [3] * 10 ** 4}, f"{limits.MAX_STOP_TOKEN_IDS} ids"),
    ("/v1/chat/completions", {"messages": MSG * (limits.MAX_MESSAGES + 1)}, f"{limits.MAX_MESSAGES} messages"),
    ("/tokenize", {"messages": MSG * (limits.MAX_MESSAGES + 1)}, f"{limits.MAX_MESSAGES} messages"),
    ("/v1/completions", {"prompt": ["a"] * (limits.MAX_PROMPTS + 1)}, f"{limits.MAX_PROMPTS} prompts"),
    ("/v1/completions", {"prompt": ["a"] * 100, "n": 100}, f"at most {limits.MAX_CHOICES} choices"),
    ("/v1/completions", {"prompt": [10 ** 30]}, "out of vocabulary"),
    ("/v1/completions", {"prompt": "hi", "guided_choice": [f"c{i}" for i in range(12000)]},
     f"'guided_choice' may have at most {limits.MAX_GUIDED_CHOICES} choices (got 12000)"),
    ("/v1/chat/completions", {"messages": MSG,
                              "structured_outputs": {"choice": ["c"] * (limits.MAX_GUIDED_CHOICES + 1)}},
     f"'structured_outputs.choice' may have at most {limits.MAX_GUIDED_CHOICES} choices"),
]


@pytest.mark.parametrize("path,body,fragment", CASES)
def test_huge_values_are_400_naming_the_limit(tiny_server, path: str, body: dict, fragment: str) -> None:
    r = httpx.post(tiny_server.url + path, json=body, headers=tiny_server.extra["headers"], timeout=60)
    assert r.status_code == 400, r.text[:300]
    assert fragment in r.json()["error"]["message"], r.text[:300]


@pytest.mark.parametrize("raw", [
    b"[" * 100_000 + b"]" * 100_000,                                   # deeper than the C parser's recursion
    b'{"prompt": "hi", "x": ' + b"[" * 100 + b"]" * 100 + b"}",        # parses, but deeper than the limit
    b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": '
    + b'{"a": ' * 80 + b"1" + b"}" * 80 + b"}",
])
def test_deep_nesting_is_400(tiny_server, raw: bytes) -> None:
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    r = httpx.post(tiny_server.url + path, content=raw, timeout=60,
                   headers={**tiny_server.extra["headers"], "Content-Type": "application/json"})
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"], r.text[:300]


@pytest.mark.parametrize("number", [b"NaN", b"Infinity", b"-Infinity", b"1e400"])
def test_non_finite_numbers_are_400(tiny_server, number: bytes) -> None:
    raw = b'{"prompt": "hi", "max_tokens": 2, "temperature": ' + number + b"}"
    r = httpx.post(tiny_server.url + "/v1/completions", content=raw, timeout=60,
                   headers={**tiny_server.extra["headers"], "Content-Type": "application/json"})
    assert r.status_code == 400 and "finite" in r.json()["error"]["message"], r.text[:300]


def test_server_still_serves(tiny_server) -> None:
    r = httpx.post(tiny_server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3},
                   headers=tiny_server.extra["headers"], timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert json.loads(httpx.get(tiny_server.url + "/health", timeout=10).text or "{}") == {}
