"""`pagedllm serve ORG/NAME` as a new user runs it with the model in the Hugging Face cache: HF_HOME set, no
HF_HUB_OFFLINE, the hub unreachable (this machine has no network to count on); the real `openai` client gets
the greedy tokens and logprobs transformers computes for the repo's main revision."""
from __future__ import annotations

import math
import os
import subprocess

import openai
import pytest

from e2e_helpers import cli, stop

from pagedllm.entrypoints.server_process import free_port, wait_healthy
from tests.engine.test_correctness import hf_greedy

PROMPT = [5, 9, 33, 70]


@pytest.fixture()
def hub_server(hf_hub_cache, tmp_path):
    c = hf_hub_cache
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.update(HF_HOME=c.home, HF_ENDPOINT=f"http://127.0.0.1:{free_port()}", PAGEDLLM_DISABLE_PROGRESS_BARS="1",
               PYTHONUNBUFFERED="1")
    port = free_port()
    log_path = str(tmp_path / "server.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([cli("pagedllm"), "serve", c.repo, "--port", str(port), "--dtype", "float32",
                                 "--max-model-len", "256", "--kv-cache-memory-bytes", str(16 << 20)],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", log_path=log_path)
        yield f"http://127.0.0.1:{port}/v1", c
    finally:
        stop(proc)


def test_serve_repo_id_from_the_cache(hub_server):
    from transformers import AutoTokenizer

    base_url, c = hub_server
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [c.repo]
    r = client.completions.create(model=c.repo, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True})
    tokens, logprobs = hf_greedy(c.main_dir, PROMPT, 5)  # main's model (the tiny llama), not v2's
    tokenizer = AutoTokenizer.from_pretrained(c.main_dir)
    choice = r.choices[0]
    assert r.usage.completion_tokens == 5 and choice.finish_reason == "length"
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in tokens]
    assert all(math.isclose(a, b, abs_tol=1e-3) for a, b in zip(choice.logprobs.token_logprobs, logprobs))
