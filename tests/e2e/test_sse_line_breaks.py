"""Text holding U+0085, U+2028 or U+2029 streams as escapes: SSE breaks lines at CR / LF only, but clients that
split an event stream like str.splitlines (httpx's iter_lines) would cut a raw one's event in two."""
from __future__ import annotations

import json

import httpx

from e2e_helpers import SERVED_NAME

SEPARATORS = "a\u2028b\x85c\u2029d"


def _streamed_events(http: httpx.Client, path: str, body: dict) -> list[dict]:
    events = []
    with http.stream("POST", path, json=dict(body, model=SERVED_NAME, stream=True)) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():  # splits at U+2028 and friends too
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
    return events


def test_echoed_separators_arrive_whole(http: httpx.Client) -> None:
    prompt = "Lines " + SEPARATORS + " end"
    events = _streamed_events(http, "/v1/completions",
                              {"prompt": prompt, "echo": True, "max_tokens": 2, "temperature": 0})
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text.startswith(prompt), text


def test_generated_separators_arrive_whole(http: httpx.Client) -> None:
    """Forced by a choice: the model writes the separators itself (a plain stream, the engine's direct path)."""
    for path, body, piece in (
            ("/v1/completions", {"prompt": "Say it:"}, lambda c: c["text"]),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say it"}]},
             lambda c: c["delta"].get("content") or "")):
        events = _streamed_events(http, path, dict(body, guided_choice=[SEPARATORS], max_tokens=32))
        assert "".join(piece(c) for e in events for c in e["choices"]) == SEPARATORS, path
