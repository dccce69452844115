"""The real `openai` SDK (sync, async, streaming) against `pagedllm serve`."""
from __future__ import annotations

import asyncio

import pytest

openai = pytest.importorskip("openai", reason="these tests are of the openai SDK against the server")

from e2e_helpers import API_KEY, SERVED_NAME, Server  # noqa: E402

MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture()
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)


def test_models(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids == [SERVED_NAME, "smol-alias"]
    card = client.models.retrieve("smol-alias")
    assert card.id == "smol-alias" and card.object == "model" and card.owned_by == "pagedllm"
    # vLLM's card carries the permission list (it was missing)
    (perm,) = card.model_extra["permission"]
    assert perm["object"] == "model_permission" and perm["allow_sampling"] is True
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no/such-model")
    assert "does not exist" in str(e.value)


def test_completion_sync(client: openai.OpenAI) -> None:
    r = client.completions.create(model=SERVED_NAME, prompt="The capital of France is", max_tokens=8,
                                  temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == SERVED_NAME
    choice = r.choices[0]
    assert choice.index == 0 and choice.finish_reason in ("stop", "length") and "Paris" in choice.text
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_sync_alias_and_max_completion_tokens(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="smol-alias", messages=MESSAGES, max_completion_tokens=6,
                                       temperature=0)
    assert r.object == "chat.completion" and r.model == SERVED_NAME
    msg = r.choices[0].message
    assert msg.role == "assistant" and "Paris" in msg.content
    assert r.usage.completion_tokens <= 6


def test_chat_stream_matches_non_stream(client: openai.OpenAI) -> None:
    kw = dict(model=SERVED_NAME, messages=MESSAGES, max_tokens=12, temperature=0)
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_completion_stream(client: openai.OpenAI) -> None:
    pieces = []
    for chunk in client.completions.create(model=SERVED_NAME, prompt="One, two, three,", max_tokens=10,
                                           temperature=0, stream=True):
        pieces.append(chunk.choices[0].text)
    full = client.completions.create(model=SERVED_NAME, prompt="One, two, three,", max_tokens=10, temperature=0)
    assert "".join(pieces) == full.choices[0].text and len(pieces) > 1


def test_n_seed_stop_and_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model=SERVED_NAME, prompt="Once upon a time", max_tokens=6, n=2,
                                  temperature=1.0, seed=7, logprobs=2)
    assert sorted(c.index for c in r.choices) == [0, 1]
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens // 2
    assert all(x <= 0 for x in lp.token_logprobs) and all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    again = client.completions.create(model=SERVED_NAME, prompt="Once upon a time", max_tokens=6, n=2,
                                      temperature=1.0, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    stop = client.completions.create(model=SERVED_NAME, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0,
                                     stop=[","])
    assert "," not in stop.choices[0].text and stop.choices[0].finish_reason == "stop"


def test_chat_logprobs_and_echo(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 for t in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[-1].logprob
    e = client.completions.create(model=SERVED_NAME, prompt="Hello there", max_tokens=3, temperature=0, echo=True)
    assert e.choices[0].text.startswith("Hello there")


def test_tokens_as_token_ids_through_extra_body(client: openai.OpenAI) -> None:
    """vLLM's return_tokens_as_token_ids, as an SDK user passes it (extra_body): chat and completions, streamed
    and not, name every logprobs token "token_id:<id>", the greedy answer's ids."""
    extra = {"return_tokens_as_token_ids": True}
    chat = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body=extra)
    tokens = [t.token for t in chat.choices[0].logprobs.content]
    assert len(tokens) == 4 and all(t.startswith("token_id:") for t in tokens)
    assert tokens == [t.top_logprobs[0].token for t in chat.choices[0].logprobs.content]  # greedy: the top one
    streamed = [t.token for chunk in client.chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, stream=True,
        extra_body=extra) for c in chunk.choices if c.logprobs for t in c.logprobs.content or []]
    assert streamed == tokens
    cmpl = client.completions.create(model=SERVED_NAME, prompt="Once upon a time", max_tokens=4, temperature=0,
                                     logprobs=1, extra_body=extra)
    lp = cmpl.choices[0].logprobs
    assert all(t.startswith("token_id:") for t in lp.tokens) and len(lp.tokens) == 4
    assert all(set(top) == {tok} for top, tok in zip(lp.top_logprobs, lp.tokens))
    streamed = [t for chunk in client.completions.create(
        model=SERVED_NAME, prompt="Once upon a time", max_tokens=4, temperature=0, logprobs=1, stream=True,
        extra_body=extra) for c in chunk.choices if c.logprobs for t in c.logprobs.tokens]
    assert streamed == lp.tokens


def test_async_client_concurrent(server: Server) -> None:
    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0) as client:
            async def one(i: int) -> str:
                r = await client.chat.completions.create(
                    model=SERVED_NAME, messages=[{"role": "user", "content": f"Count to {i + 2}."}], max_tokens=8,
                    temperature=0)
                return r.choices[0].message.content

            async def streamed() -> str:
                out = []
                stream = await client.completions.create(model=SERVED_NAME, prompt="Hi", max_tokens=5, stream=True,
                                                         temperature=0)
                async for chunk in stream:
                    out.append(chunk.choices[0].text)
                return "".join(out)

            return await asyncio.gather(*(one(i) for i in range(4)), streamed())

    results = asyncio.run(main())
    assert len(results) == 5 and all(isinstance(r, str) and r for r in results)


def test_sdk_errors(client: openai.OpenAI, server: Server) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, temperature=-1)
    assert "temperature" in str(e.value)
    bad = openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
