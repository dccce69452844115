"""use_beam_search on the real server: n / best_of on /v1/completions and /v1/chat/completions, the same beams as
the offline LLM.beam_search, beams batched next to ordinary requests, and 400s for what beam search cannot do."""
from __future__ import annotations

import concurrent.futures

import pytest

openai = pytest.importorskip("openai", reason="these tests call the server with the openai SDK")

from e2e_helpers import API_KEY, SERVED_NAME, Server  # noqa: E402

PROMPT = "The capital of France is"


def _complete(http, **body):
    return http.post("/v1/completions", json={"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 5, **body})


def test_completions_beam_search_matches_offline(http, server: Server):
    r = _complete(http, use_beam_search=True, n=2, best_of=3)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert all(c["finish_reason"] in ("stop", "length") for c in choices)
    from pagedllm import LLM, BeamSearchParams

    llm = LLM(server.model_dir, kv_cache_memory_bytes=64 << 20, max_model_len=256)
    offline = llm.beam_search([PROMPT], BeamSearchParams(beam_width=3, max_tokens=5))[0].sequences
    assert [c["text"] for c in choices] == [s.text for s in offline[:2]]
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == sum(len(s.tokens) for s in offline[:2]) - 2 * usage["prompt_tokens"]


def test_chat_beam_search_with_openai_client(server: Server):
    client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)
    out = client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "Say hi."}],
                                         n=2, max_tokens=6, extra_body={"use_beam_search": True})
    assert len(out.choices) == 2 and all(isinstance(c.message.content, str) for c in out.choices)
    assert out.choices[0].message.content != out.choices[1].message.content


def test_beams_ended_by_eos_name_it_as_stop_reason(http, server: Server):
    import json
    import os

    with open(os.path.join(server.model_dir, "generation_config.json")) as f:
        eos = json.load(f)["eos_token_id"]
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Say hi."}], "n": 2, "max_tokens": 60,
            "use_beam_search": True}
    r = http.post("/v1/chat/completions", json=body)
    choices = r.json()["choices"]
    assert [c["finish_reason"] for c in choices] == ["stop", "stop"], choices
    assert [c["stop_reason"] for c in choices] == [eos, eos]  # vLLM's beams: the EOS id (it was null)


def test_beams_run_next_to_ordinary_requests(http):
    plain = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    alone = _complete(http, **plain).json()["choices"][0]["text"]
    beam_alone = _complete(http, use_beam_search=True, n=2).json()["choices"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        beam = pool.submit(_complete, http, use_beam_search=True, n=2)
        other = pool.submit(_complete, http, **plain)
        assert beam.result().json()["choices"] == beam_alone
        assert other.result().json()["choices"][0]["text"] == alone


@pytest.mark.parametrize("body, param", [
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"n": 0}, "n"),
    ({"n": 65}, "n"),  # the beam width's bound names the field the client sent
    ({"n": 2, "best_of": 65}, "best_of"),
    ({"stream": True}, "stream"),
    ({"temperature": 0.7}, "temperature"),
    ({"logprobs": 1}, "logprobs"),
    ({"length_penalty": "long"}, None),
    ({"max_tokens": 0}, "max_tokens"),  # (param was null)
    ({"early_stopping": "sometimes"}, None),
    ({"guided_choice": ["yes", "no"]}, "guided_choice"),  # (beams are neither constrained nor parsed)
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"skip_special_tokens": False}, "skip_special_tokens"),
])
def test_invalid_beam_requests_are_400(http, body, param):
    r = _complete(http, use_beam_search=True, **body)
    assert r.status_code == 400, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("penalty", [1e308, -1e308])
def test_extreme_length_penalty_is_answered(http, penalty):
    # generated_len ** length_penalty leaves the float range: the score is 0 or infinite, not an OverflowError (500)
    r = _complete(http, use_beam_search=True, n=2, length_penalty=penalty)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2


def test_best_of_without_beam_search_is_400(http):
    r = http.post("/v1/chat/completions", json={"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}],
                                                "n": 1, "best_of": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"



def test_beam_width_beyond_max_logprobs_is_400(http):
    r = _complete(http, use_beam_search=True, n=11)  # 2 x 11 logprobs per step > the default --max-logprobs 20
    assert r.status_code == 400 and "max-logprobs" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "n"
    # the width came from best_of: the 400 names it (it named n, which the client had set to 2)
    r = _complete(http, use_beam_search=True, n=2, best_of=11)
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text
