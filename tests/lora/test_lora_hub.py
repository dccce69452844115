"""LoRA adapters given by Hugging Face hub id ("org/name"), resolved offline from a local hub cache laid out as
huggingface_hub writes a download (HF_HUB_OFFLINE=1, no network): the same outputs as the adapter by local path,
one resolution per adapter, and clear errors (ValueError offline, 404 / 400 from /v1/load_lora_adapter)."""
from __future__ import annotations

import os

import pytest
from fastapi import Request  # module level: the route's annotation (a string here) is resolved in this module

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.lora import resolve
from tests.conftest import write_hub_snapshot
from tests.lora.lora_helpers import make_adapter

COMMIT = "c3" * 20
PROMPT = {"prompt_token_ids": [5, 6, 7, 8, 9]}
SP = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
               num_gpu_blocks_override=32)


@pytest.fixture(scope="module")
def adapter(tiny_llama_dir, tmp_path_factory):
    return make_adapter(tiny_llama_dir, str(tmp_path_factory.mktemp("hub-src") / "a"), r=8, alpha=16,
                        targets=["q_proj", "v_proj", "down_proj"], seed=21)


@pytest.fixture()
def hub(adapter, tmp_path, monkeypatch):
    """An offline hub cache holding acme/tiny-lora (the adapter) and acme/not-a-lora (no adapter_config.json)."""
    cache = str(tmp_path / "hub")
    snapshot = write_hub_snapshot(cache, "acme/tiny-lora", COMMIT, adapter, refs=("main",))
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "README.md").write_text("not an adapter\n")
    (plain / "adapter_model.safetensors").write_bytes(b"")
    write_hub_snapshot(cache, "acme/not-a-lora", "d4" * 20, str(plain), refs=("main",))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    # huggingface_hub read HF_HUB_CACHE when it was imported (by transformers, before this test): point it here
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache)
    monkeypatch.setattr(resolve, "_resolved", {})  # each test resolves afresh
    return snapshot


def run(llm: LLM, request: LoRARequest):
    out = llm.generate(PROMPT, SP, lora_request=request, use_tqdm=False)[0].outputs[0]
    return out.token_ids, [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]


def test_hub_id_loads_offline_with_the_local_paths_outputs(llm, adapter, hub):
    want = run(llm, LoRARequest("local", 31, adapter))
    got = run(llm, LoRARequest("hub", 32, "acme/tiny-lora"))
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=1e-5)
    # the engine holds the snapshot directory: re-reading an evicted adapter never asks the hub
    assert llm.engine.loras.requests[32].lora_path == hub


def test_hub_id_is_resolved_once(hub, monkeypatch):
    import huggingface_hub

    calls = []
    real = huggingface_hub.snapshot_download

    def counting(**kwargs):
        calls.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", counting)
    assert resolve.resolve_lora_path("acme/tiny-lora") == hub
    assert resolve.resolve_lora_path("acme/tiny-lora") == hub
    assert len(calls) == 1
    # only what the engine reads of an adapter is fetched
    assert calls[0]["allow_patterns"] == ["adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"]
    assert resolve.resolve_lora_path("acme/tiny-lora", refresh=True) == hub  # load_inplace asks again
    assert len(calls) == 2


def test_local_paths_are_not_hub_ids(adapter, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve.resolve_lora_path(adapter) == adapter
    assert resolve.resolve_lora_path("~/loras/x") == str(tmp_path / "loras" / "x")
    for path in ("/no/such/dir", "./missing", "a/b/c"):  # missing local paths: refused later as "not a directory"
        assert resolve.resolve_lora_path(path) == path


def test_unknown_hub_id_offline_is_a_clear_error(llm, hub):
    with pytest.raises(ValueError, match="'acme/nope' is not a local directory nor in the local Hugging Face "
                                         "cache .*HF_HUB_OFFLINE"):
        llm.generate(PROMPT, SP, lora_request=LoRARequest("nope", 33, "acme/nope"), use_tqdm=False)
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        llm.generate(PROMPT, SP, lora_request=LoRARequest("plain", 34, "acme/not-a-lora"), use_tqdm=False)


def test_unreachable_hub_without_cache_is_a_clear_error(hub, monkeypatch):
    """Online but the hub cannot be reached (this machine has none): an error naming the repo, not a hang."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(resolve.LoRANotFoundError, match="acme/elsewhere"):
        resolve.resolve_lora_path("acme/elsewhere")


class _Engine:
    """The API process's engine client, adding adapters to the offline engine (they are really read)."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.added = []

    async def add_lora(self, request, **_) -> None:
        self.added.append(request)
        self.llm.engine.add_lora(request)

    async def remove_lora(self, lora_int_id: int) -> None:
        self.llm.engine.remove_lora(lora_int_id)


def test_load_lora_adapter_endpoint_with_hub_ids(llm, hub, monkeypatch):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from pagedllm.entrypoints.openai import lora_models
    from pagedllm.entrypoints.openai.app import _install_error_handlers

    monkeypatch.setattr(lora_models, "runtime_updates_allowed", lambda: True)
    engine = _Engine(llm)
    loras = lora_models.LoRAModels(engine, ["tiny"], enabled=True)
    loras._ids = iter(range(40, 50))
    app = FastAPI()
    _install_error_handlers(app)

    @app.post("/v1/load_lora_adapter")
    async def load(request: Request):
        return await lora_models.load_lora_adapter(request, loras)

    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "hub", "lora_path": "acme/tiny-lora"})
        assert r.status_code == 200, r.text
        assert engine.added[-1].lora_path == hub  # the engine is given the cached snapshot, not the id
        assert loras.cards(0, 64)[0]["root"] == "acme/tiny-lora"
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "nope", "lora_path": "acme/nope"})
        assert r.status_code == 404, r.text
        assert "HF_HUB_OFFLINE" in r.json()["error"]["message"]
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "plain", "lora_path": "acme/not-a-lora"})
        assert r.status_code == 400, r.text
        assert "no adapter_config.json" in r.json()["error"]["message"]
        assert set(loras.adapters) == {"hub"}
    assert os.path.isdir(hub)
