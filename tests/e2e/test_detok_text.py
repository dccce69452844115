"""The text of an output that ends in the middle of a character: offline, served, streamed and not, the same."""
from __future__ import annotations

import json

from e2e_helpers import SERVED_NAME, Server

from pagedllm import SamplingParams


def _streamed(client, path: str, body: dict, content) -> str:
    pieces = []
    with client.stream("POST", path, json=dict(body, stream=True)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces += [content(c) or "" for c in json.loads(line[6:])["choices"]]
    return "".join(pieces)


def test_length_finish_mid_character_keeps_its_end(server: Server, offline_llm) -> None:
    """max_tokens reached on the first byte token of an emoji: the text is decode(token ids), its partial character a
    U+FFFD, everywhere (was: the held-back bytes were dropped, the text one character short of decode's)."""
    tok = offline_llm.get_tokenizer()
    prompt = "🎉🎉🎉"
    ids = list(offline_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8),
                                    use_tqdm=False)[0].outputs[0].token_ids)
    cut = next(k for k in range(1, len(ids) + 1) if tok.decode(ids[:k]).endswith("\ufffd"))
    expected = tok.decode(ids[:cut])
    offline = offline_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=cut), use_tqdm=False)
    assert offline[0].outputs[0].text == expected
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": cut, "temperature": 0}
    with server.client() as http:
        full = http.post("/v1/completions", json=body).json()["choices"][0]
        assert (full["text"], full["finish_reason"]) == (expected, "length")
        assert _streamed(http, "/v1/completions", body, lambda c: c["text"]) == expected
        chat = {"model": SERVED_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8,
                "temperature": 0, "return_token_ids": True}
        answer = http.post("/v1/chat/completions", json=chat).json()["choices"][0]
        chat_ids = answer["token_ids"]
        # The answer (emoji too) cut where a character is split across tokens.
        k = next(k for k in range(1, len(chat_ids) + 1) if tok.decode(chat_ids[:k]).endswith("\ufffd"))
        chat = dict(chat, max_tokens=k, return_token_ids=False)
        want = tok.decode(chat_ids[:k])
        assert http.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"] == want
        assert _streamed(http, "/v1/chat/completions", chat, lambda c: c["delta"].get("content")) == want


def test_token_prompt_ending_mid_character(server: Server, offline_llm) -> None:
    """A token-id prompt whose last tokens are the first bytes of an emoji: the text is decode(output ids), streamed
    and not, offline and served (was: the output's bytes finished the prompt's character, or its U+FFFD led it)."""
    tok = offline_llm.get_tokenizer()
    ids = tok.encode("Count: one two three 🎉", add_special_tokens=False)
    cut = next(k for k in range(1, len(ids) + 1) if tok.decode(ids[:k]).endswith("\ufffd"))
    prompt = ids[:cut]
    params = SamplingParams(temperature=0, max_tokens=6)
    out = offline_llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    expected = tok.decode(out.token_ids)
    assert out.text == expected
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    with server.client() as http:
        assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == expected
        assert _streamed(http, "/v1/completions", body, lambda c: c["text"]) == expected
