"""Request fields the server honours, each checked against the offline engine (the same model and settings) or
against what it promises: logit_bias, bad_words, allowed_token_ids, prompt_logprobs, chat echo, seed on chat,
stream_options.continuous_usage_stats, truncate_prompt_tokens; the top_logprobs range; unknown fields named in a warning; features of
other issues refused with a 400 until their field lands."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from e2e_helpers import SERVED_NAME, Server, metric

from pagedllm import SamplingParams

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
PROMPT = "The capital of France is"


def _offline(llm, ids: list[int], **kw):
    (out,) = llm.generate([{"prompt_token_ids": ids}], SamplingParams(**kw), use_tqdm=False)
    return out


def _ids(http: httpx.Client, text: str) -> list[int]:
    return http.post("/tokenize", json={"prompt": text}).json()["tokens"]


def test_logit_bias_moves_the_greedy_token(http: httpx.Client, offline_llm) -> None:
    ids = _ids(http, PROMPT)
    greedy = _offline(offline_llm, ids, temperature=0, max_tokens=1).outputs[0].token_ids[0]
    biased = _offline(offline_llm, ids, temperature=0, max_tokens=4, logit_bias={greedy: -100})
    assert biased.outputs[0].token_ids[0] != greedy
    r = http.post(CMPL, json={"prompt": ids, "max_tokens": 4, "temperature": 0, "logit_bias": {str(greedy): -100}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == biased.outputs[0].text


def test_bad_words_never_appear(http: httpx.Client, offline_llm) -> None:
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 8, "temperature": 0}
    plain = http.post(CHAT, json=body).json()["choices"][0]["message"]["content"]
    assert "Paris" in plain  # the word to ban is really what the model says
    r = http.post(CHAT, json=dict(body, bad_words=["Paris"]))
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    assert "Paris" not in text and text != plain


def test_allowed_token_ids_only(http: httpx.Client, offline_llm) -> None:
    ids = _ids(http, PROMPT)
    allowed = sorted(set(_ids(http, " one two three four")))
    ref = _offline(offline_llm, ids, temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed)
    assert set(ref.outputs[0].token_ids) <= set(allowed)
    r = http.post(CMPL, json={"prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                              "allowed_token_ids": allowed})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == ref.outputs[0].text


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "top_p": 0.9}])
def test_constraints_leaving_no_token_are_a_400(http: httpx.Client, sampling: dict) -> None:
    """allowed_token_ids = a stop token, with min_tokens not reached: no token may follow. The request fails with a
    400 saying so (it crashed the engine with top-p, and greedy emitted a forbidden token); the server goes on."""
    (t,) = _ids(http, " one")[:1]
    r = http.post(CMPL, json={"prompt": PROMPT, "max_tokens": 4, "allowed_token_ids": [t], "stop_token_ids": [t],
                              "min_tokens": 2, **sampling})
    assert r.status_code == 400, r.text
    assert "no token satisfies" in r.json()["error"]["message"]
    ok = http.post(CMPL, json={"prompt": PROMPT, "max_tokens": 2, **sampling})
    assert ok.status_code == 200, ok.text


def test_stop_strings_wait_for_min_tokens(http: httpx.Client, offline_llm) -> None:
    """As vLLM: a stop string in the text of the first min_tokens tokens does not end the request; the first match
    that ends in a later token does, offline and over HTTP alike (was: it ended at the min_tokens-th token)."""
    ids, tokenizer = _ids(http, PROMPT), offline_llm.get_tokenizer()
    free = _offline(offline_llm, ids, temperature=0, max_tokens=16, ignore_eos=True).outputs[0]
    pieces = [tokenizer.decode([t]) for t in free.token_ids]
    # min_tokens = the position of a token (not the first) holding a space that a later token holds too: the case
    # in question is a match in the min_tokens-th token's own text, which was searched.
    m = next(k for k in range(2, len(pieces)) if " " in pieces[k - 1] and any(" " in p for p in pieces[k:]))
    head = tokenizer.decode(free.token_ids[:m])
    expected = free.text[:free.text.index(" ", len(head))]
    got = _offline(offline_llm, ids, temperature=0, max_tokens=16, ignore_eos=True, stop=[" "], min_tokens=m)
    assert (got.outputs[0].text, got.outputs[0].stop_reason) == (expected, " ")
    r = http.post(CMPL, json={"prompt": ids, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stop": [" "],
                              "min_tokens": m})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (expected, "stop", " ")


@pytest.mark.parametrize("first,second,expected_id",
                         [({"request_id": "rq", "n": 2}, {"request_id": "rq"}, "rq"),
                          ({"request_id": "rs", "n": 2}, {"request_id": "0_rs"}, "rs"),
                          ({"prompt": [PROMPT, "Hi"], "request_id": "rt"}, {"request_id": "rt-0"}, "rt"),
                          ({"headers": {"X-Request-Id": "tr-1"}}, {"headers": {"X-Request-Id": "tr-1"}}, "tr-1")],
                         ids=["same id", "a child's id", "a prompt's id", "same X-Request-Id"])
def test_a_running_requests_id_can_be_used_again(http: httpx.Client, first: dict, second: dict,
                                                 expected_id: str) -> None:
    """As vLLM: the answer's id is "cmpl-<id>" (<id>: the X-Request-Id header, else the request_id field) and the
    engine's own id adds random characters to it, so a request whose id (or whose samples' or prompts' ids) a
    running request holds runs too (it was a 400 'already running')."""
    body = {"prompt": PROMPT, "max_tokens": 48, "ignore_eos": True, "temperature": 0.5, "stream": True}
    first, second = dict(first), dict(second)
    with http.stream("POST", CMPL, json=dict(body, **first), headers=first.pop("headers", {})) as running:
        assert running.status_code == 200
        lines = running.iter_lines()
        chunk = json.loads(next(line for line in lines if line.startswith("data: "))[6:])  # it runs
        assert chunk["id"] == f"cmpl-{expected_id}"
        headers = second.pop("headers", {})
        r = http.post(CMPL, json={"prompt": PROMPT, "max_tokens": 2, **second}, headers=headers)
        assert r.status_code == 200, r.text
        assert r.json()["id"] == f"cmpl-{second.get('request_id', headers.get('X-Request-Id'))}"
        r = http.post(CHAT, json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **second},
                      headers=headers)
        assert r.status_code == 200, r.text
        assert r.json()["id"] == f"chatcmpl-{second.get('request_id', headers.get('X-Request-Id'))}"
        for _ in lines:  # let it finish
            pass


def test_the_x_request_id_header_names_the_answer_over_the_field(http: httpx.Client) -> None:
    """vLLM's id: "chatcmpl-" + the X-Request-Id header, which wins over the body's request_id."""
    r = http.post(CHAT, json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "request_id": "body",
                              "stream": True}, headers={"X-Request-Id": "hdr"})
    ids = {json.loads(line[6:])["id"] for line in r.text.splitlines() if line.startswith("data: {")}
    assert ids == {"chatcmpl-hdr"}, r.text


@pytest.mark.parametrize("penalty", [1e-300, 1e-40, 1e300])
def test_an_extreme_repetition_penalty_keeps_the_engine_serving(http: httpx.Client, penalty: float) -> None:
    """Any positive repetition_penalty is valid (vLLM's rule), but in float32 a tiny one made the penalized logits
    inf / NaN and top-p's search then stopped the engine core: every later request got a 503."""
    body = {"messages": [{"role": "user", "content": "Say hello, hello, hello"}], "max_tokens": 4,
            "temperature": 1.0, "top_p": 0.9, "seed": 0}
    r = http.post(CHAT, json=dict(body, repetition_penalty=penalty))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    r = http.post(CHAT, json=body)  # the engine still serves
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_top_logprobs_zero_without_logprobs_asks_for_nothing(http: httpx.Client, stream: bool) -> None:
    """vLLM refuses top_logprobs without logprobs only when it asks for some (> 0); 0 parses, and no logprobs come.
    A count does still need the flag."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "top_logprobs": 0, "stream": stream}
    r = http.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    choices = [c for chunk in _sse(r) for c in chunk["choices"]] if stream else r.json()["choices"]
    assert choices and all(c.get("logprobs") is None for c in choices), choices
    r = http.post(CHAT, json=dict(body, top_logprobs=1))
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text


def test_a_huge_temperature_keeps_the_request_constraints(http: httpx.Client) -> None:
    """temperature 1e300 is inf in float32: a masked token's logit became -inf / inf = NaN, and the draw took
    tokens outside allowed_token_ids and broke a JSON grammar (finish_reason "abort"). It samples uniformly now."""
    allowed = sorted(set(_ids(http, " one two three four")))
    r = http.post(CMPL, json={"prompt": PROMPT, "max_tokens": 6, "temperature": 1e300, "ignore_eos": True,
                              "allowed_token_ids": allowed, "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert set(r.json()["choices"][0]["token_ids"]) <= set(allowed), (allowed, r.text)
    r = http.post(CHAT, json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 1e300,
                              "response_format": {"type": "json_object"}, "logprobs": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop"), r.text  # not "abort"


@pytest.mark.parametrize("given", [{"json": {"request_id": ""}}, {"headers": {"X-Request-Id": ""}}],
                         ids=["field", "header"])
def test_an_empty_request_id_gets_a_new_one(http: httpx.Client, given: dict) -> None:
    """An empty request_id / X-Request-Id names nothing: the answer gets a fresh id, not a bare "cmpl-"."""
    ids = set()
    for _ in range(2):
        r = http.post(CMPL, json={"prompt": "Hi", "max_tokens": 1, **given.get("json", {})},
                      headers=given.get("headers", {}))
        assert r.status_code == 200, r.text
        ids.add(r.json()["id"])
    assert len(ids) == 2 and all(i.startswith("cmpl-") and len(i) > len("cmpl-") for i in ids), ids


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_is_left_out(http: httpx.Client, offline_llm, include: bool) -> None:
    """A request that stops on a stop_token_id (or EOS) does not show that token's text unless
    include_stop_str_in_output, as vLLM (the id is still the output's last token, offline)."""
    ids = _ids(http, PROMPT)
    first = _offline(offline_llm, ids, temperature=0, max_tokens=1).outputs[0]
    second = _offline(offline_llm, ids, temperature=0, max_tokens=2, ignore_eos=True).outputs[0]
    stop = second.token_ids[1]
    body = {"prompt": ids, "max_tokens": 6, "temperature": 0, "stop_token_ids": [stop], "skip_special_tokens": False,
            "include_stop_str_in_output": include}
    want = second.text if include else first.text
    for stream in (False, True):
        r = http.post(CMPL, json=dict(body, stream=stream))
        assert r.status_code == 200, r.text
        if stream:
            chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: {")]
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            reason = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
        else:
            text, reason = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
        assert (text, reason) == (want, "stop"), (stream, text, want)
    out = _offline(offline_llm, ids, temperature=0, max_tokens=6, stop_token_ids=[stop],
                   include_stop_str_in_output=include).outputs[0]
    assert out.token_ids == second.token_ids and out.text == want


def test_prompt_logprobs_equal_offline(http: httpx.Client, offline_llm) -> None:
    ids = _ids(http, PROMPT)
    ref = _offline(offline_llm, ids, max_tokens=1, prompt_logprobs=2).prompt_logprobs
    r = http.post(CMPL, json={"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids) == len(ref)
    for i in range(1, len(ids)):
        assert set(got[i]) == {str(t) for t in ref[i]}
        for t, lp in ref[i].items():
            entry = got[i][str(t)]
            assert abs(entry["logprob"] - lp.logprob) < 1e-4 and entry["rank"] == lp.rank
            assert entry["decoded_token"] == lp.decoded_token
    chat = http.post(CHAT, json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                                 "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    r = http.post(CMPL, json={"prompt": "x", "max_tokens": 1, "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and "not available when stream" in r.json()["error"]["message"]


def test_chat_echo_prefixes_the_continued_message(http: httpx.Client) -> None:
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is"}]
    body = {"messages": messages, "max_tokens": 3, "temperature": 0, "add_generation_prompt": False,
            "continue_final_message": True}
    plain = http.post(CHAT, json=body).json()["choices"][0]["message"]["content"]
    echoed = http.post(CHAT, json=dict(body, echo=True)).json()["choices"][0]["message"]["content"]
    assert echoed == "My favourite is" + plain
    r = http.post(CHAT, json=dict(body, echo=True, stream=True))
    deltas = [c["delta"].get("content", "") for e in r.text.split("\n\n") if e.startswith("data: {")
              for c in json.loads(e[6:])["choices"]]
    assert "".join(deltas) == echoed
    # nothing to echo when the last message is the user's
    user_only = {"messages": messages[:1], "max_tokens": 2, "temperature": 0}
    assert http.post(CHAT, json=dict(user_only, echo=True)).json()["choices"][0]["message"]["content"] == \
        http.post(CHAT, json=user_only).json()["choices"][0]["message"]["content"]


def test_chat_template_kwargs_win_over_the_named_fields(http: httpx.Client) -> None:
    """As vLLM's: add_generation_prompt / continue_final_message in chat_template_kwargs override the request's own
    fields (they were a 400, "got multiple values"); the call's own switches and a template are refused by name."""
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is"}]
    named = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False,
                                         "continue_final_message": True})
    in_kwargs = http.post("/tokenize", json={"messages": messages, "chat_template_kwargs": {
        "add_generation_prompt": False, "continue_final_message": True}})
    assert named.status_code == in_kwargs.status_code == 200, in_kwargs.text
    assert in_kwargs.json()["tokens"] == named.json()["tokens"]
    for key, value in (("tokenize", False), ("chat_template", "{{ messages }}")):
        r = http.post(CHAT, json={"messages": messages[:1], "max_tokens": 1, "chat_template_kwargs": {key: value}})
        assert r.status_code == 400 and key in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "chat_template_kwargs"


def test_seed_on_chat_is_reproducible(http: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 8, "temperature": 1.0}
    texts = [http.post(CHAT, json=dict(body, seed=s)).json()["choices"][0]["message"]["content"] for s in (7, 7, 8)]
    assert texts[0] == texts[1] and texts[0] != texts[2]


@pytest.mark.parametrize("path,body", [
    (CHAT, {"messages": [{"role": "user", "content": "Hi"}]}),
    (CMPL, {"prompt": "Hi"}),
])
def test_continuous_usage_stats_on_every_chunk(http: httpx.Client, path: str, body: dict) -> None:
    r = http.post(path, json=dict(body, max_tokens=5, temperature=0, ignore_eos=True, stream=True,
                                  stream_options={"include_usage": True, "continuous_usage_stats": True}))
    chunks = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages)
    prompt = usages[0]["prompt_tokens"]
    completion = [u["completion_tokens"] for u in usages]
    assert completion == sorted(completion) and completion[-1] == 5 and chunks[-1]["choices"] == []
    assert all(u["prompt_tokens"] == prompt and u["total_tokens"] == prompt + u["completion_tokens"] for u in usages)


@pytest.mark.parametrize("path,body", [
    (CHAT, {"messages": [{"role": "user", "content": "Hi"}], "n": 2}),
    (CMPL, {"prompt": ["Hi", "The capital of France is"], "n": 2}),
])
def test_continuous_usage_is_each_choices_own(http: httpx.Client, path: str, body: dict) -> None:
    """As vLLM: with n > 1 (and several prompts) a chunk's usage is its choice's: its prompt's tokens and the
    tokens of that choice so far (it was the sum over every choice and prompt); the last chunk sums them all."""
    r = http.post(path, json=dict(body, max_tokens=4, temperature=1, ignore_eos=True, stream=True,
                                  stream_options={"include_usage": True, "continuous_usage_stats": True}))
    chunks = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    seen: dict[int, list[int]] = {}
    prompts: dict[int, int] = {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        seen.setdefault(choice["index"], []).append(c["usage"]["completion_tokens"])
        prompts.setdefault(choice["index"], c["usage"]["prompt_tokens"])
    assert len(seen) == len(body.get("prompt", [0])) * 2 and all(s[-1] == 4 and s == sorted(s) for s in seen.values())
    total = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and total["completion_tokens"] == 4 * len(seen)
    per_prompt = {i // 2: p for i, p in prompts.items()}
    assert total["prompt_tokens"] == sum(per_prompt.values()), (prompts, total)


@pytest.mark.parametrize("stream", [False, True])
def test_truncate_prompt_tokens_keeps_the_last_tokens(http: httpx.Client, offline_llm, stream: bool) -> None:
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens, generated from exactly as if they were the
    prompt (the offline engine on those tokens), echoed and counted as the prompt; -1 (the context length) and a
    k longer than the prompt keep it whole."""
    ids = _ids(http, "Once upon a time there was a little fox who lived in the woods. " + PROMPT)
    k = 6
    ref = _offline(offline_llm, ids[-k:], temperature=0, max_tokens=5, ignore_eos=True)
    whole = _offline(offline_llm, ids, temperature=0, max_tokens=5, ignore_eos=True)
    assert ref.outputs[0].token_ids != whole.outputs[0].token_ids  # the truncation shows in the answer

    def completion(**kw) -> tuple[str, dict]:
        body = {"prompt": ids, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "echo": True, **kw}
        if not stream:
            r = http.post(CMPL, json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"], r.json()["usage"]
        text, usage = "", None
        with http.stream("POST", CMPL, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    text += "".join(c["text"] for c in chunk["choices"])
                    usage = chunk["usage"] or usage
        return text, usage

    kept_text = offline_llm.get_tokenizer().decode(ids[-k:])
    text, usage = completion(truncate_prompt_tokens=k)
    assert text == kept_text + ref.outputs[0].text
    assert usage["prompt_tokens"] == k
    for whole_k in (-1, len(ids), len(ids) + 10):
        text, usage = completion(truncate_prompt_tokens=whole_k)
        assert usage["prompt_tokens"] == len(ids) and text.endswith(whole.outputs[0].text), whole_k
    chat = {"messages": [{"role": "user", "content": "Tell me everything about the capital of France."}],
            "max_tokens": 3, "temperature": 0, "truncate_prompt_tokens": 4}
    r = http.post(CHAT, json=chat)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 4


@pytest.mark.parametrize("path,body,fragment", [
    (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs must be between 0 and 20"),
    (CHAT, {"logprobs": True, "top_logprobs": -1}, "top_logprobs must be between 0 and 20"),
    (CMPL, {"logprobs": 21}, "logprobs must be between 0 and 20"),
    (CMPL, {"prompt_logprobs": 21}, "prompt_logprobs must be between 0 and 20"),
    (CHAT, {"best_of": 2}, "'best_of' other than n is only supported with use_beam_search"),
    (CMPL, {"logit_bias": {"999999": 5}}, "logit_bias has token id(s) out of vocabulary"),
    (CMPL, {"logit_bias": {"1": 500}}, "logit_bias values must be in [-100, 100]"),
    (CMPL, {"allowed_token_ids": [10 ** 9]}, "allowed_token_ids has token id(s) out of vocabulary"),
    (CMPL, {"bad_words": ["x"] * 2000}, "'bad_words' may have at most 1024 words"),
    (CHAT, {"bad_words": ["x" * 2000]}, "'bad_words' entries may have at most 1024 characters"),
    (CHAT, {"stream_options": {"include_usage": True}}, "stream_options can only be given when stream is true"),
    (CMPL, {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be -1 (the model's context length) or >= 1"),
    (CHAT, {"truncate_prompt_tokens": -2}, "truncate_prompt_tokens must be -1 (the model's context length) or >= 1"),
    (CMPL, {"truncate_prompt_tokens": 10 ** 30}, "truncate_prompt_tokens (10000000000"),  # once kept all silently
    (CHAT, {"truncate_prompt_tokens": 1025}, "truncate_prompt_tokens (1025) is greater than max_model_len (1024)"),
    # vLLM's extras pagedllm does not implement: once accepted and ignored (a warning in the log only)
    (CMPL, {"priority": 5}, "priority=5 needs priority scheduling: start the server with --scheduling-policy "
                            "priority"),
    (CHAT, {"priority": -1}, "priority=-1 needs priority scheduling: start the server with --scheduling-policy "
                             "priority"),
    (CHAT, {"cache_salt": ""}, "'cache_salt' must be a non-empty string if given"),
    (CMPL, {"logits_processors": ["my.module:Processor"]}, "'logits_processors' is not supported yet by pagedllm."),
    (CMPL, {"prompt_embeds": "AAAA"}, "You must set `--enable-prompt-embeds` to input `prompt_embeds`."),
    (CHAT, {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}},
     "'modalities' is not supported yet by pagedllm."),
    (CHAT, {"web_search_options": {}}, "'web_search_options' is not supported yet by pagedllm."),
    # OpenAI's deprecated function calling: refused pointing at its replacement
    (CHAT, {"functions": [{"name": "f", "parameters": {"type": "object"}}], "function_call": "auto"},
     "'functions' is not supported yet by pagedllm (OpenAI deprecated it): describe them in 'tools'."),
    (CHAT, {"function_call": {"name": "f"}}, "'function_call' is not supported yet by pagedllm (OpenAI deprecated "
                                             "it): use 'tool_choice' with 'tools'."),
    # (once the conversation went twice to the template: a bare "got multiple values for keyword argument")
    (CHAT, {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs may not set ['messages']: the template "
                                                        "gets the conversation from the request's 'messages'."),
    (CHAT, {"messages": [{"role": "user", "content": [{"text": "Hi"}]}]},
     "A message content part needs a 'type' ('text' for text), got an object with keys ['text']."),  # once "type None"
])
def test_refused_with_a_message(http: httpx.Client, path: str, body: dict, fragment: str) -> None:
    base = {"messages": [{"role": "user", "content": "Hi"}]} if path == CHAT else {"prompt": "Hi"}
    r = http.post(path, json={**base, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]
    if "out of vocabulary" in fragment:  # (checked in the engine process: the field still named)
        assert r.json()["error"]["param"] == next(iter(body))


def test_cache_salt_isolates_prefix_hits(http: httpx.Client) -> None:
    """vLLM's cache_salt: a request reuses only blocks computed under its own salt (the prefix-hit counter moves
    for a repeat of the same salt, not for another salt); the answer is the same under any salt."""
    prompt = f"Salted prompt {time.time_ns()}: " + "the quick brown fox jumps over the lazy dog " * 12

    def hits() -> float:
        return metric(http.get("/metrics").text, "vllm:prefix_cache_hits_total", model_name=SERVED_NAME)

    def ask(salt: str, path: str = CMPL) -> str:
        base = {"messages": [{"role": "user", "content": prompt}]} if path == CHAT else {"prompt": prompt}
        r = http.post(path, json={**base, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "cache_salt": salt})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"] if path == CHAT else choice["text"]

    start = hits()
    answer = ask("tenant-a")
    after_first = hits()
    assert ask("tenant-a") == answer
    repeat = hits() - after_first
    assert repeat >= 64, repeat  # the prompt's full blocks came from the cache
    assert ask("tenant-b") == answer  # another tenant: a miss
    assert ask("tenant-a") == answer
    # the counter is cumulative and in order: tenant-b's request added nothing
    assert hits() - after_first == 2 * repeat, (start, after_first, hits(), repeat)
    ask("tenant-c", CHAT)
    chat_first = hits()
    ask("tenant-c", CHAT)
    assert hits() > chat_first  # chat requests honour it too
    r = http.post(CMPL, json={"prompt": prompt, "max_tokens": 1, "cache_salt": 7})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_unimplemented_vllm_extras_asking_for_nothing_are_accepted(http: httpx.Client, path: str) -> None:
    base = {"messages": [{"role": "user", "content": "Hi"}]} if path == CHAT else {"prompt": "Hi"}
    r = http.post(path, json={**base, "max_tokens": 1, "priority": 0, "return_tokens_as_token_ids": False,
                              "logits_processors": [], "cache_salt": None, "modalities": ["text"], "audio": None})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_n_null_is_the_default_one(http: httpx.Client, path: str, stream: bool) -> None:
    """OpenAI's n is "integer or null": clients that send every parameter, unset ones as null, get one choice."""
    base = {"messages": [{"role": "user", "content": "Hi"}]} if path == CHAT else {"prompt": "Hi"}
    r = http.post(path, json={**base, "max_tokens": 2, "n": None, "stream": stream})
    assert r.status_code == 200, r.text
    choices = [c for chunk in _sse(r) for c in chunk["choices"]] if stream else r.json()["choices"]
    assert choices and {c["index"] for c in choices} == {0}, choices


@pytest.mark.parametrize("path, body, names", [
    (CMPL, {"max_token": 3, "temprature": 0.2, "user": "u1"}, "['max_token', 'temprature']"),
    # a refused field whose value asks for nothing: once dropped without a word
    (CHAT, {"function_call": "auto"}, "['function_call']"),
])
def test_unknown_fields_are_named_in_a_warning(server: Server, http: httpx.Client, path: str, body: dict,
                                               names: str) -> None:
    base = {"messages": [{"role": "user", "content": "Hi"}]} if path == CHAT else {"prompt": "Hi"}
    r = http.post(path, json={**base, "max_tokens": 1, **body})
    assert r.status_code == 200
    deadline = time.monotonic() + 60  # a hang guard
    while names not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    line = [x for x in server.log().splitlines() if names in x]
    assert line and "WARNING" in line[0] and "ignored" in line[0], server.log()[-2000:]


def _sse(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def _ids_of(labels: list[str]) -> list[int]:
    assert all(t.startswith("token_id:") for t in labels), labels
    return [int(t[len("token_id:"):]) for t in labels]


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_completion_tokens_as_token_ids(http: httpx.Client, stream: bool) -> None:
    """vLLM's return_tokens_as_token_ids (refused before): every logprobs token string, chosen and top-k, echoed
    prompt's too, is "token_id:<id>"; the same logprobs as without it, text_offset still counting the text."""
    ids = _ids(http, PROMPT)
    body = {"prompt": ids, "max_tokens": 5, "temperature": 0, "logprobs": 3, "echo": True, "stream": stream}
    plain, as_ids = (http.post(CMPL, json={**body, "return_tokens_as_token_ids": flag}) for flag in (False, True))
    assert plain.status_code == as_ids.status_code == 200, as_ids.text

    def merged(r):
        if not stream:
            return r.json()["choices"][0]["logprobs"]
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for chunk in _sse(r):
            for choice in chunk["choices"]:
                for key in out:
                    out[key] += (choice.get("logprobs") or {}).get(key, [])
        return out

    ref, got = merged(plain), merged(as_ids)
    got_ids = _ids_of(got["tokens"])
    assert got_ids[:len(ids)] == ids  # the echoed prompt
    assert len(got_ids) == len(ids) + 5
    assert "".join(http.post("/detokenize", json={"tokens": [i]}).json()["prompt"] for i in got_ids) == \
        "".join(ref["tokens"])
    assert got["token_logprobs"] == ref["token_logprobs"] and got["text_offset"] == ref["text_offset"]
    for top_ref, top_got in zip(ref["top_logprobs"], got["top_logprobs"]):
        if top_ref is None:
            assert top_got is None
            continue
        assert sorted(top_got.values()) == sorted(top_ref.values())
        _ids_of(list(top_got))


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_chat_tokens_as_token_ids(http: httpx.Client, stream: bool) -> None:
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 5,
            "temperature": 0, "logprobs": True, "top_logprobs": 2, "stream": stream}
    plain, as_ids = (http.post(CHAT, json={**body, "return_tokens_as_token_ids": flag}) for flag in (False, True))
    assert plain.status_code == as_ids.status_code == 200, as_ids.text

    def content(r):
        if not stream:
            return r.json()["choices"][0]["logprobs"]["content"]
        return [e for chunk in _sse(r) for c in chunk["choices"] for e in ((c.get("logprobs") or {}).get("content")
                                                                            or [])]

    ref, got = content(plain), content(as_ids)
    assert len(got) == len(ref) == 5
    got_ids = _ids_of([e["token"] for e in got])
    text = "".join(http.post("/detokenize", json={"tokens": [i]}).json()["prompt"] for i in got_ids)
    assert text == "".join(e["token"] for e in ref)
    for e, r in zip(got, ref):
        assert e["logprob"] == r["logprob"] and e["bytes"] == list(e["token"].encode())
        assert [t["logprob"] for t in e["top_logprobs"]] == [t["logprob"] for t in r["top_logprobs"]]
        assert _ids_of([t["token"] for t in e["top_logprobs"]])


def test_answer_role_is_the_continued_messages(http: httpx.Client) -> None:
    """As vLLM: without a generation prompt the answer continues the last message, so it has that message's role
    (and echo repeats that message); it was always 'assistant', and echo only an assistant's message."""
    msgs = [{"role": "user", "content": "Write a haiku about"}]
    body = {"messages": msgs, "max_tokens": 2, "add_generation_prompt": False, "echo": True}
    full = http.post(CHAT, json=body).json()["choices"][0]["message"]
    assert full["role"] == "user" and full["content"].startswith("Write a haiku about"), full
    stream = http.post(CHAT, json=dict(body, stream=True)).text
    first = json.loads(next(line for line in stream.splitlines() if line.startswith("data: {"))[6:])
    assert first["choices"][0]["delta"]["role"] == "user", stream
    r = http.post(CHAT, json={"messages": msgs, "max_tokens": 1})
    assert r.json()["choices"][0]["message"]["role"] == "assistant"

