"""POST /v1/embeddings through the real server, with the `openai` SDK (which asks for base64 by default) and raw
HTTP: the vectors are the offline engine's LLM.embed of the same inputs (texts and token ids), and bad requests are
400s that name their field."""
from __future__ import annotations

import base64
import struct

import httpx
import pytest
import torch

openai = pytest.importorskip("openai", reason="the openai SDK against the server")

from e2e_helpers import API_KEY, MAX_MODEL_LEN, SERVED_NAME, Server, metric  # noqa: E402

TEXTS = ["The capital of France is Paris.", "Embeddings turn text into vectors.", "a"]


def _close(got: list[float], want: list[float]) -> None:
    g, w = torch.tensor(got), torch.tensor(want)
    assert g.shape == w.shape
    # the server's batches differ from the offline engine's; bf16 on the CPU rounds differently per batch shape
    assert float(torch.nn.functional.cosine_similarity(g, w, dim=0)) > 0.999
    assert abs(float(g.norm()) - 1.0) < 1e-3


def test_sdk_embeddings_equal_the_offline_engine(server: Server, offline_llm) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)
    r = client.embeddings.create(model=SERVED_NAME, input=TEXTS)  # the SDK asks for base64 and decodes it
    assert r.object == "list" and r.model == SERVED_NAME and [d.index for d in r.data] == [0, 1, 2]
    want = offline_llm.embed(TEXTS, use_tqdm=False)
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(w.prompt_token_ids) for w in want)
    for d, w in zip(r.data, want):
        assert d.object == "embedding"
        _close(d.embedding, w.outputs.embedding)
    floats = client.embeddings.create(model="smol-alias", input=TEXTS[0], encoding_format="float")
    _close(floats.data[0].embedding, want[0].outputs.embedding)


def test_raw_http_formats_and_token_id_inputs(http: httpx.Client, offline_llm) -> None:
    ids = http.post("/tokenize", json={"prompt": TEXTS[1]}).json()["tokens"]
    r = http.post("/v1/embeddings", json={"model": SERVED_NAME, "input": [ids, TEXTS[2]], "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("embd-") and body["usage"]["prompt_tokens"] == len(ids) + len(
        http.post("/tokenize", json={"prompt": TEXTS[2]}).json()["tokens"])
    raw = base64.b64decode(body["data"][0]["embedding"])
    vector = list(struct.unpack(f"<{len(raw) // 4}f", raw))
    (want,) = offline_llm.embed([{"prompt_token_ids": ids}], use_tqdm=False)
    _close(vector, want.outputs.embedding)
    # one id list alone is one input; normalize false (vLLM's extra) gives the raw pooled state
    r = http.post("/v1/embeddings", json={"model": SERVED_NAME, "input": ids, "normalize": False})
    (data,) = r.json()["data"]
    unit = torch.tensor(data["embedding"]) / torch.tensor(data["embedding"]).norm()
    _close(unit.tolist(), want.outputs.embedding)
    assert float(torch.tensor(data["embedding"]).norm()) > 1.5  # not unit length


@pytest.mark.parametrize("body, status, param, message", [
    ({"input": []}, 400, "input", "'input' must not be empty"),
    ({"input": ["ok", ""]}, 400, "input", "'input' must not be an empty string"),
    ({"input": [[1, 2], []]}, 400, "input", "The input is empty"),
    ({"input": [10 ** 9]}, 400, "input", "out of vocabulary"),
    ({"input": "x", "dimensions": 7}, 400, "dimensions", "dimensions=7 is not supported"),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format", None),
    ({"input": [1] * MAX_MODEL_LEN}, 400, "input", f"at most {MAX_MODEL_LEN - 1}"),
    ({"input": ["x"] * 2049}, 400, "input", "at most 2048 inputs"),
    ({"input": "x", "model": "nope"}, 404, "model", "does not exist"),
    ({"input": "x", "priority": 3}, 400, "priority", "priority"),
])
def test_bad_requests_are_4xx_naming_the_field(http: httpx.Client, body: dict, status: int, param: str,
                                                message) -> None:
    r = http.post("/v1/embeddings", json={"model": SERVED_NAME, **body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    if message is not None:
        assert message in err["message"], err


def test_a_conversation_is_embedded_as_its_rendered_prompt(http: httpx.Client, offline_llm) -> None:
    """vLLM's chat-style embeddings request: `messages` rendered by the chat template (no generation prompt unless
    asked), embedded as one input."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris is in France."}]
    r = http.post("/v1/embeddings", json={"model": SERVED_NAME, "messages": messages})
    assert r.status_code == 200, r.text
    ids = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    (want,) = offline_llm.embed([{"prompt_token_ids": ids}], use_tqdm=False)
    _close(r.json()["data"][0]["embedding"], want.outputs.embedding)
    for body in ({"messages": messages, "input": "x"}, {}):
        bad = http.post("/v1/embeddings", json={"model": SERVED_NAME, **body})
        assert bad.status_code == 400 and "exactly one of 'input' or 'messages'" in bad.json()["error"]["message"]
    for name, value in (("add_generation_prompt", True), ("chat_template", "{{ 1 }}")):  # never silently unused
        bad = http.post("/v1/embeddings", json={"model": SERVED_NAME, "input": "x", name: value})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == name, bad.text


def test_pooling_route_gives_the_embeddings(http: httpx.Client, offline_llm) -> None:
    """vLLM's generic POST /pooling: on an embedding-capable model its default task is embed, the data
    /v1/embeddings' vectors (base64 too); token_embed gives every token's; the classify tasks need a classifier."""
    texts = ["Paris is in France.", "hello"]
    want = [d["embedding"] for d in http.post("/v1/embeddings", json={"input": texts}).json()["data"]]
    r = http.post("/pooling", json={"model": SERVED_NAME, "input": texts})
    assert r.status_code == 200, r.text
    assert [d["index"] for d in r.json()["data"]] == [0, 1]
    for got, vector in zip(r.json()["data"], want):  # (equal up to the rounding of the step's batch shape)
        _close(got["data"], vector)
    r = http.post("/pooling", json={"input": texts[:1], "encoding_format": "base64"})
    raw = base64.b64decode(r.json()["data"][0]["data"])
    _close(list(struct.unpack(f"<{len(raw) // 4}f", raw)), want[0])
    r = http.post("/pooling", json={"input": "x", "task": "classify"})
    assert r.status_code == 400 and "sequence classification model" in r.json()["error"]["message"], r.text
    r = http.post("/pooling", json={"input": "x", "activation": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "activation", r.text

    # token_embed: one row per input token, each an embedding, as LLM.encode(pooling_task="token_embed") makes them
    r = http.post("/pooling", json={"input": texts, "task": "token_embed"})
    assert r.status_code == 200, r.text
    want = offline_llm.encode(texts, use_tqdm=False, pooling_task="token_embed")
    for got, w in zip(r.json()["data"], want):
        assert len(got["data"]) == len(w.prompt_token_ids) == w.outputs.data.shape[0]
        for row, want_row in zip(got["data"], w.outputs.data.tolist()):
            _close(row, want_row)
    for body, param in (({"input": "x", "task": "token_classify"}, "task"),
                        ({"input": "x", "task": "token_embed", "use_activation": True}, "use_activation")):
        r = http.post("/pooling", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_truncation_keeps_the_last_tokens(http: httpx.Client, offline_llm) -> None:
    ids = list(range(100, 100 + MAX_MODEL_LEN + 10))  # too long, unless cut
    r = http.post("/v1/embeddings", json={"model": SERVED_NAME, "input": ids, "truncate_prompt_tokens": 20})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 20
    (want,) = offline_llm.embed([{"prompt_token_ids": ids[-20:]}], use_tqdm=False)
    _close(r.json()["data"][0]["embedding"], want.outputs.embedding)


def test_truncation_to_the_context_is_what_an_input_may_hold(http: httpx.Client) -> None:
    """truncate_prompt_tokens=-1 (the model's context) cuts to what an embedding input may hold (one token less
    than max_model_len), not to a length the length check then refuses."""
    ids = list(range(100, 100 + MAX_MODEL_LEN + 10))
    r = http.post("/v1/embeddings", json={"model": SERVED_NAME, "input": ids, "truncate_prompt_tokens": -1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 1


def test_an_embeddings_only_server(tiny_llama_dir: str, e2e_env: dict, tmp_path) -> None:
    """`--task embed` (vLLM's older flag for --runner pooling) and `--override-pooler-config`: /v1/embeddings pools as
    configured, the generating routes answer 400 saying why."""
    from e2e_helpers import serving

    flags = ["--task", "embed", "--override-pooler-config", '{"pooling_type": "CLS", "normalize": false}',
             "--kv-cache-memory-bytes", str(32 << 20)]
    with serving(tiny_llama_dir, flags, str(tmp_path / "server.log"), e2e_env) as url:
        from tests.engine.test_embeddings import check_pooled

        r = httpx.post(url + "/v1/embeddings", json={"input": [[5, 6, 7, 8]]}, timeout=60)
        assert r.status_code == 200, r.text
        check_pooled(tiny_llama_dir, [5, 6, 7, 8], "cls", r.json()["data"][0]["embedding"], normalized=False)
        for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            r = httpx.post(url + path, json=body, timeout=60)
            assert r.status_code == 400 and "embeddings only" in r.json()["error"]["message"], (path, r.text)


def test_score_and_rerank_are_cosines_of_the_embeddings(http: httpx.Client) -> None:
    """vLLM's score / rerank APIs on the embedding model: cosine similarities of /v1/embeddings' vectors; rerank
    orders documents by them (top_n, return_documents); every path of the two routes answers alike."""
    query, docs = "Where is Paris?", ["Paris is the capital of France.", "Bananas are yellow.", "Where is Paris?"]
    vectors = [torch.tensor(d["embedding"]) for d in http.post(
        "/v1/embeddings", json={"model": SERVED_NAME, "input": [query, *docs]}).json()["data"]]
    want = [float(vectors[0] @ v) for v in vectors[1:]]  # (unit vectors: the dot is the cosine)
    for path in ("/v1/score", "/score"):
        r = http.post(path, json={"model": SERVED_NAME, "text_1": query, "text_2": docs})
        assert r.status_code == 200, r.text
        got = [d["score"] for d in r.json()["data"]]
        assert all(abs(a - b) < 2e-3 for a, b in zip(got, want)) and abs(got[2] - 1.0) < 1e-3
    pairs = http.post("/v1/score", json={"text_1": [query, docs[1]], "text_2": [docs[0], docs[1]]}).json()["data"]
    assert abs(pairs[0]["score"] - want[0]) < 2e-3 and abs(pairs[1]["score"] - 1.0) < 1e-3
    order = sorted(range(3), key=lambda i: -want[i])
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        r = http.post(path, json={"model": SERVED_NAME, "query": query, "documents": docs, "top_n": 2})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == order[:2]
        assert results[0]["document"] == {"text": docs[order[0]]} and r.json()["usage"]["total_tokens"] > 0
    bare = http.post("/v1/rerank", json={"query": query, "documents": docs, "return_documents": False}).json()
    assert len(bare["results"]) == 3 and "document" not in bare["results"][0]
    for path, body, param in (("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
                              ("/v1/score", {"text_1": [], "text_2": "x"}, "text_1"),
                              ("/v1/rerank", {"query": "", "documents": ["x"]}, "query"),
                              ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
                              ("/v1/rerank", {"query": "q", "documents": ["x", ""]}, "documents"),
                              ("/v1/rerank", {"query": "q", "documents": ["x"], "top_n": -1}, "top_n"),
                              # (a cross-encoder's: a cosine has no activation, never silently unused)
                              ("/v1/score", {"text_1": "a", "text_2": "b", "activation": False}, "activation"),
                              ("/v1/rerank", {"query": "q", "documents": ["x"], "use_activation": True},
                               "use_activation")):
        r = http.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)



def test_score_and_rerank_too_long_text_is_named_by_its_field_and_index(http: httpx.Client) -> None:
    """A text past the context is named by its own field and its index there: the check ran on the distinct texts
    of both fields together, so a long text_1 was 'text_2 0' and a query's second document 'documents 2'."""
    long = "word " * (MAX_MODEL_LEN + 10)
    for path, body, named in (("/v1/score", {"text_1": long, "text_2": ["a", "b"]}, "text_1 has"),
                              ("/v1/score", {"text_1": "a", "text_2": ["b", long]}, "text_2 1 has"),
                              ("/v1/score", {"text_1": ["a", long], "text_2": ["b", "c"]}, "text_1 1 has"),
                              ("/v1/rerank", {"query": "q", "documents": ["x", long]}, "documents 1 has"),
                              ("/v1/rerank", {"query": "q", "documents": [long]}, "documents has"),
                              ("/v1/rerank", {"query": long, "documents": ["x", "y"]}, "query has")):
        r = http.post(path, json=body)
        error = r.json()["error"]
        assert r.status_code == 400 and f"However, {named} " in error["message"], (body, r.text)
        assert error["param"] == named.split()[0], (body, r.text)


def test_a_too_long_conversation_is_named_messages(http: httpx.Client) -> None:
    """A conversation past the context is a 400 naming 'messages', the field it came in (it named 'input')."""
    messages = [{"role": "user", "content": "word " * (MAX_MODEL_LEN + 10)}]
    for path in ("/v1/embeddings", "/pooling"):
        r = http.post(path, json={"messages": messages})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "messages", (path, r.text)
        assert "However, messages has " in error["message"], (path, r.text)

def test_scoring_routes_outside_v1_need_the_key(server) -> None:
    for path in ("/score", "/rerank", "/v2/rerank", "/classify"):
        r = httpx.post(server.url + path, json={"text_1": "a", "text_2": "b", "query": "q", "documents": ["d"],
                                                "input": "x"},
                       timeout=60)
        assert r.status_code == 401, (path, r.text)


def test_classify_on_a_generative_model_is_a_400(http: httpx.Client) -> None:
    """/classify needs a sequence classifier (tests/e2e/test_classify_api.py serves one); this model is not."""
    for path in ("/classify", "/v1/classify"):
        r = http.post(path, json={"model": SERVED_NAME, "input": "hello"})
        assert r.status_code == 400 and "sequence classification model" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "model"


def test_embedding_requests_in_the_metrics_as_vllm_counts_them(http: httpx.Client) -> None:
    """vLLM finishes a pooling request as "stop" (it stops once pooled), counts its prompt in
    vllm:prompt_tokens_total with a time to first output, no generated token and no max_tokens parameter. Here
    the one sampled token made it "length" (or "stop" when that token was EOS), and its prompt went uncounted
    although the engine prefilled it (vllm:prefix_cache_queries_total counted it)."""
    def sample(text: str, name: str, **labels: str) -> float:
        return metric(text, name, model_name=SERVED_NAME, engine="0", **labels)

    before = http.get("/metrics").text
    r = http.post("/v1/embeddings", json={"model": SERVED_NAME, "input": TEXTS[:2]})
    assert r.status_code == 200, r.text
    after = http.get("/metrics").text

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert delta("vllm:request_success_total", finished_reason="stop") == 2
    assert delta("vllm:request_success_total", finished_reason="length") == 0
    assert delta("vllm:prompt_tokens_total") == r.json()["usage"]["prompt_tokens"]
    assert delta("vllm:time_to_first_token_seconds_count") == 2
    assert delta("vllm:generation_tokens_total") == 0
    assert delta("vllm:request_params_max_tokens_count") == 0
