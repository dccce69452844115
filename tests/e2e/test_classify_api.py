"""A cross-encoder (a one-label Qwen3ForSequenceClassification) through the real server with raw HTTP: POST /classify
gives transformers' sigmoid per input, /v1/score and /v1/rerank score each pair's pair encoding with it, the routes
need the API key, and what the model cannot serve is a 400 saying why."""
from __future__ import annotations

import httpx
import pytest
import torch


def test_classify_score_and_rerank_on_a_cross_encoder(tiny_classifier_dir, e2e_env: dict, tmp_path) -> None:
    from e2e_helpers import serving
    from transformers import AutoTokenizer

    from tests.engine.test_classify import hf_logits

    model_dir = tiny_classifier_dir("qwen3", num_labels=1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    flags = ["--convert", "classify", "--api-key", "k", "--served-model-name", "rr",
             "--kv-cache-memory-bytes", str(16 << 20)]
    with serving(model_dir, flags, str(tmp_path / "server.log"), e2e_env) as url:
        http = httpx.Client(base_url=url, headers={"Authorization": "Bearer k"}, timeout=60)
        texts = ["Paris is the capital of France.", "Bananas are yellow."]
        r = http.post("/classify", json={"model": "rr", "input": texts + [[5, 6, 7]]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and body["model"] == "rr" and body["id"]
        wants = [tok(t)["input_ids"] for t in texts] + [[5, 6, 7]]
        assert body["usage"]["prompt_tokens"] == sum(map(len, wants))
        for i, (item, ids) in enumerate(zip(body["data"], wants)):
            assert item["index"] == i and item["num_classes"] == 1 and item["label"] == "relevance"
            assert item["probs"][0] == pytest.approx(torch.sigmoid(hf_logits(model_dir, ids))[0].item(), abs=1e-4)

        query, docs = "Where is Paris?", texts + ["a"]
        want = [torch.sigmoid(hf_logits(model_dir, tok(text=query, text_pair=d)["input_ids"]))[0].item()
                for d in docs]
        r = http.post("/v1/score", json={"model": "rr", "text_1": query, "text_2": docs})
        assert r.status_code == 200, r.text
        assert [d["score"] for d in r.json()["data"]] == pytest.approx(want, abs=1e-4)
        r = http.post("/v1/rerank", json={"query": query, "documents": docs, "top_n": 2})
        assert r.status_code == 200, r.text
        order = sorted(range(3), key=lambda i: -want[i])
        results = r.json()["results"]
        assert [x["index"] for x in results] == order[:2]
        assert results[0]["relevance_score"] == pytest.approx(want[order[0]], abs=1e-4)
        assert results[0]["document"] == {"text": docs[order[0]]}
        # activation false (use_activation: its newer name): the raw logits score (they were ignored: sigmoids)
        logits = [hf_logits(model_dir, tok(text=query, text_pair=d)["input_ids"])[0].item() for d in docs]
        for name in ("activation", "use_activation"):
            r = http.post("/v1/score", json={"text_1": query, "text_2": docs, name: False})
            assert [d["score"] for d in r.json()["data"]] == pytest.approx(logits, abs=1e-4), (name, r.text)
            r = http.post("/v1/rerank", json={"query": query, "documents": docs, name: False})
            got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
            assert [got[i] for i in range(3)] == pytest.approx(logits, abs=1e-4), (name, r.text)

        # vLLM's chat-style request: one conversation rendered by the chat template (as /tokenize renders it)
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Is Paris in France?"}]
        r = http.post("/classify", json={"messages": messages})
        assert r.status_code == 200, r.text
        ids = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()["tokens"]
        assert r.json()["usage"]["prompt_tokens"] == len(ids) and len(r.json()["data"]) == 1
        want = torch.sigmoid(hf_logits(model_dir, ids))[0].item()
        assert r.json()["data"][0]["probs"][0] == pytest.approx(want, abs=1e-4)
        for body, param in (({"messages": messages, "input": "x"}, "input"), ({}, "input"),
                            ({"input": "x", "add_generation_prompt": True}, "add_generation_prompt")):
            r = http.post("/classify", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)

        # vLLM's generic /pooling: a classifier's default task is classify, its data /classify's probabilities
        classes = http.post("/classify", json={"input": texts}).json()["data"]
        r = http.post("/pooling", json={"input": texts})
        assert r.status_code == 200, r.text
        assert [d["object"] for d in r.json()["data"]] == ["pooling"] * 2
        for got, c in zip(r.json()["data"], classes):  # (equal up to the rounding of the step's batch shape)
            assert got["data"] == pytest.approx(c["probs"], abs=1e-5)
        # activation false: the raw label logits (/classify's "probs" then holds them, as vLLM's)
        want = [hf_logits(model_dir, ids)[0].item() for ids in wants[:2]]
        # (use_activation, vLLM's newer name, too: /classify ignored it and answered probabilities)
        for path in ("/classify", "/pooling"):
            for name in ("activation", "use_activation"):
                r = http.post(path, json={"input": texts, name: False})
                got = [d["probs" if path == "/classify" else "data"][0] for d in r.json()["data"]]
                assert got == pytest.approx(want, abs=1e-4), (path, name, r.text)
            r = http.post(path, json={"input": texts, "activation": True, "use_activation": False})
            assert r.status_code == 400 and r.json()["error"]["param"] == "activation", (path, r.text)
        # token_classify through the same head: every token's logit (transformers' score over each hidden state)
        from tests.engine.test_classify import hf_classifier

        hf = hf_classifier(model_dir)
        r = http.post("/pooling", json={"input": [wants[2], texts[0]], "task": "token_classify", "activation": False})
        assert r.status_code == 200, r.text
        for got, ids in zip(r.json()["data"], [wants[2], wants[0]]):
            with torch.inference_mode():
                want = hf.score(hf.model(torch.tensor([ids])).last_hidden_state[0])
            torch.testing.assert_close(torch.tensor(got["data"]), want, atol=1e-4, rtol=1e-4)
        r = http.post("/pooling", json={"input": [wants[2]], "task": "token_classify"})
        assert r.status_code == 200 and len(r.json()["data"][0]["data"]) == 3, r.text  # (sigmoids: one label)
        for body, param in (({"input": "x", "task": "embed"}, "model"), ({"input": "x", "dimensions": 2}, "dimensions"),
                            ({"input": "x", "task": "reward"}, "task"),
                            ({"input": "x", "task": "token_embed"}, "task")):
            r = http.post("/pooling", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        assert httpx.post(url + "/pooling", json={"input": "x"}, timeout=60).status_code == 401

        # truncate_prompt_tokens=max_model_len is accepted and keeps what a classification input may hold (as -1)
        r = http.post("/classify", json={"input": [[5] * 600], "truncate_prompt_tokens": 512})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 511, r.text
        assert httpx.post(url + "/classify", json={"input": "x"}, timeout=60).status_code == 401
        for path, body, param, words in (
                ("/classify", {"input": []}, "input", "must not be empty"),
                ("/classify", {"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "-1"),
                # (a pair's truncation went to the tokenizer unchecked: past its integer type, a 500)
                ("/v1/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 10 ** 20},
                 "truncate_prompt_tokens", "greater than max_model_len"),
                ("/v1/rerank", {"query": "a", "documents": ["b"], "truncate_prompt_tokens": -2},
                 "truncate_prompt_tokens", "-1"),
                # a pair past the context is named as the pair (it was 'text_2', though text_1 was the long one)
                ("/v1/score", {"text_1": "word " * 600, "text_2": "b"}, "text_1", "the pair of text_1 and text_2 has"),
                ("/v1/rerank", {"query": "q", "documents": ["b", "c " * 600]}, "documents",
                 "the pair of query and documents 1 has"),
                ("/v1/embeddings", {"input": "x"}, "model", "sequence classifier"),
                ("/v1/completions", {"prompt": "x", "max_tokens": 2}, None, "not generation")):
            r = http.post(path, json=body)
            assert r.status_code == 400, (path, r.text)
            error = r.json()["error"]
            assert words in error["message"] and (param is None or error["param"] == param), (path, error)
