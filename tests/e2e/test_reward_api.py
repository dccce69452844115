"""A process reward model (Qwen2ForProcessRewardModel) through the real server with raw HTTP: POST /pooling gives
its STEP-pooled rewards (pooler_config's step tag and column), against transformers' Qwen2Model with the head in
torch; what the model does not serve is a 400 naming it."""
from __future__ import annotations

import json

import httpx
import torch


def test_process_reward_model_through_pooling(tiny_reward_dir, e2e_env: dict, tmp_path) -> None:
    from e2e_helpers import serving

    from tests.engine.test_reward_models import TAG, reference_logits, tagged_prompts

    model_dir = tiny_reward_dir("Qwen2ForProcessRewardModel")
    step = {"pooling_type": "STEP", "step_tag_id": TAG, "returned_token_ids": [1, 0]}
    flags = ["--served-model-name", "prm", "--pooler-config", json.dumps(step), "--kv-cache-memory-bytes",
             str(16 << 20)]
    with serving(model_dir, flags, str(tmp_path / "server.log"), e2e_env) as url:
        http = httpx.Client(base_url=url, timeout=60)
        prompts = tagged_prompts([23, 12], seed=9) + [[3, 4, 5]]  # (the last has no step tag)
        r = http.post("/pooling", json={"model": "prm", "input": prompts})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["prompt_tokens"] == sum(map(len, prompts)) and len(body["data"]) == 3
        for item, ids in zip(body["data"], prompts):
            mask = torch.tensor([t == TAG for t in ids])
            want = reference_logits(model_dir, ids)[mask][:, [1, 0]]
            assert item["object"] == "pooling" and len(item["data"]) == int(mask.sum())
            if item["data"]:
                torch.testing.assert_close(torch.tensor(item["data"]), want.softmax(-1), atol=2e-5, rtol=1e-4)
        r = http.post("/pooling", json={"input": prompts[:1], "task": "token_classify", "use_activation": False})
        assert r.status_code == 200, r.text
        mask = torch.tensor([t == TAG for t in prompts[0]])
        torch.testing.assert_close(torch.tensor(r.json()["data"][0]["data"]),
                                   reference_logits(model_dir, prompts[0])[mask][:, [1, 0]], atol=1e-4, rtol=1e-4)
        for path, body, param, words in (
                ("/pooling", {"input": "x", "task": "embed"}, "model", "is a reward model"),
                ("/pooling", {"input": "x", "task": "token_embed"}, "task", "serves token_classify"),
                ("/pooling", {"input": "x", "task": "classify"}, "model", "needs a sequence classification model"),
                ("/v1/embeddings", {"input": "x"}, "model", "is a reward model"),
                ("/classify", {"input": "x"}, "model", "needs a sequence classification model"),
                ("/v1/completions", {"prompt": "x", "max_tokens": 2}, None, "not generation")):
            r = http.post(path, json=body)
            assert 400 <= r.status_code < 500, (path, r.text)
            error = r.json()["error"]
            assert words in error["message"] and (param is None or error["param"] == param), (path, error)
