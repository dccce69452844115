"""echo + logprobs on /v1/completions: the prompt tokens are scored too (first one null), streaming or not,
and the scores equal the offline engine's prompt_logprobs."""
from __future__ import annotations

import json

import httpx

from e2e_helpers import SERVED_NAME

PROMPT = "The quick brown fox jumps over the lazy dog"


def test_echo_logprobs_full_response(http: httpx.Client, offline_llm) -> None:
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    r = http.post("/v1/completions", json={"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 3,
                                           "temperature": 0, "echo": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(PROMPT)
    n = len(ids) + 3
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) and x <= 0.0 for x in lp["token_logprobs"][1:])
    assert all(1 <= len(t) <= 3 for t in lp["top_logprobs"][1:])
    assert "".join(lp["tokens"][:len(ids)]) == PROMPT
    assert lp["text_offset"] == sorted(lp["text_offset"])
    # the prompt's scores are the offline engine's prompt_logprobs (the chosen token's and the top-2 values)
    from pagedllm import SamplingParams

    (ref,) = offline_llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=2),
                                  use_tqdm=False)
    assert ref.prompt_logprobs[0] is None
    for i in range(1, len(ids)):
        want = ref.prompt_logprobs[i]
        assert abs(lp["token_logprobs"][i] - want[ids[i]].logprob) < 1e-4, i
        top_want = sorted((v.logprob for v in want.values() if v.rank <= 2), reverse=True)
        top_got = sorted(lp["top_logprobs"][i].values(), reverse=True)
        assert len(top_got) >= 2 and all(abs(a - b) < 1e-4 for a, b in zip(top_got, top_want)), i


def test_echo_logprobs_stream_matches_full(http: httpx.Client) -> None:
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1}
    full = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    r = http.post("/v1/completions", json=dict(body, stream=True))
    tokens, values = [], []
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                if choice["logprobs"]:
                    tokens += choice["logprobs"]["tokens"]
                    values += choice["logprobs"]["token_logprobs"]
    assert tokens == full["tokens"]
    assert values[0] is None
    assert all(abs(a - b) < 1e-4 for a, b in zip(values[1:], full["token_logprobs"][1:]))


def test_echo_with_max_tokens_0_scores_the_prompt_alone(http: httpx.Client) -> None:
    """echo + max_tokens 0 (OpenAI's legacy scoring request, served by vLLM): the prompt comes back with its
    logprobs and nothing is generated; streamed the same. Without echo, max_tokens 0 stays a 400."""
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 0, "temperature": 0, "echo": True, "logprobs": 1}
    scored = http.post("/v1/completions", json=dict(body, max_tokens=3)).json()["choices"][0]["logprobs"]
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    num_prompt = r.json()["usage"]["prompt_tokens"]
    assert r.json()["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == PROMPT and len(lp["token_logprobs"]) == num_prompt
    assert lp["token_logprobs"] == scored["token_logprobs"][:num_prompt]
    chunks = [json.loads(line[6:]) for line in http.post("/v1/completions", json=dict(body, stream=True)).text
              .splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    r = http.post("/v1/completions", json=dict(body, echo=False))
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


def test_echo_text_offsets_never_step_back(http: httpx.Client) -> None:
    """A prompt whose tokens' texts are longer than the prompt text (an emoji split into "\\ufffd" pieces): the
    generated tokens' text_offset continue after the prompt tokens', streamed or not."""
    body = {"prompt": "😀😀", "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1}
    full = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["text_offset"]
    r = http.post("/v1/completions", json=dict(body, stream=True))
    streamed = [o for e in r.text.split("\n\n") if e.startswith("data: {")
                for c in json.loads(e[6:])["choices"] if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert full == sorted(full) and streamed == full, (full, streamed)
