"""Model resolution without the network: Hugging Face cache layouts built in the test (refs -> snapshots),
HF_HUB_OFFLINE, --revision and --download-dir through huggingface_hub; what a download passes to the hub client
(HF_TOKEN, revision, file patterns); ModelScope through the `modelscope` library, or a message naming it."""
from __future__ import annotations

import os
import shutil
import sys
import types

import pytest

from pagedllm.models.loader import resolve_model_path
from pagedllm.models.model_resolution import looks_like_repo_id

HASH_A = "a" * 40
HASH_B = "b" * 40


@pytest.fixture()
def hf_cache(tmp_path, tiny_llama_dir):
    """<cache>/models--acme--tiny with refs main -> A and v2 -> B, each snapshot a full model directory."""
    repo = tmp_path / "hub" / "models--acme--tiny"
    for h in (HASH_A, HASH_B):
        shutil.copytree(tiny_llama_dir, repo / "snapshots" / h)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(HASH_A)
    (repo / "refs" / "v2").write_text(HASH_B)
    return str(tmp_path / "hub")


def test_repo_id_shapes():
    assert looks_like_repo_id("Qwen/Qwen3-0.6B") and looks_like_repo_id("gpt2")
    assert not looks_like_repo_id("/abs/path") and not looks_like_repo_id("./rel") and not looks_like_repo_id("a.gguf")
    assert not looks_like_repo_id("a/b/c") and not looks_like_repo_id("~/m")


def test_offline_cache_snapshot_by_ref_and_commit(hf_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snap = os.path.join(hf_cache, "models--acme--tiny", "snapshots")
    assert resolve_model_path("acme/tiny", download_dir=hf_cache) == os.path.join(snap, HASH_A)
    assert resolve_model_path("acme/tiny", revision="v2", download_dir=hf_cache) == os.path.join(snap, HASH_B)
    assert resolve_model_path("acme/tiny", revision=HASH_B, download_dir=hf_cache) == os.path.join(snap, HASH_B)
    with pytest.raises(ValueError, match=r"'acme/missing' is not in the local Hugging Face cache .*HF_HUB_OFFLINE"):
        resolve_model_path("acme/missing", download_dir=hf_cache)
    with pytest.raises(ValueError, match="at revision 'v9'"):
        resolve_model_path("acme/tiny", revision="v9", download_dir=hf_cache)


def test_engine_serves_a_cached_repo_id(hf_cache, monkeypatch, tiny_llama_dir):
    from pagedllm import LLM, SamplingParams
    from tests.engine.test_correctness import hf_greedy

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    llm = LLM(model="acme/tiny", download_dir=hf_cache, revision="v2", dtype="float32", num_gpu_blocks_override=16)
    assert llm.engine.model_dir.endswith(HASH_B) and llm.get_tokenizer() is not None
    out = llm.generate({"prompt_token_ids": [5, 9, 33]}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(tiny_llama_dir, [5, 9, 33], 4)[0]


def test_download_passes_revision_dir_token_and_patterns(monkeypatch, tmp_path):
    import huggingface_hub

    calls = []

    def fake_snapshot_download(**kwargs):  # the network boundary: what the hub client is asked for
        calls.append(kwargs)
        return str(tmp_path)

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert resolve_model_path("acme/tiny", revision="v2", download_dir=str(tmp_path / "dl")) == str(tmp_path)
    (kw,) = calls
    assert (kw["repo_id"], kw["revision"], kw["cache_dir"], kw["token"]) == ("acme/tiny", "v2", str(tmp_path / "dl"),
                                                                           "hf_secret")
    assert not kw.get("local_files_only") and "*.safetensors" in kw["allow_patterns"]
    assert not any(p.endswith((".bin", ".pt", ".gguf")) for p in kw["allow_patterns"])


def test_hub_errors_are_one_sentence(monkeypatch):
    import huggingface_hub
    from huggingface_hub import errors

    import httpx

    def not_found(**kwargs):
        response = httpx.Response(404, request=httpx.Request("GET", "https://huggingface.co/api/models/acme/none"))
        raise errors.RepositoryNotFoundError("404 Client Error", response=response)

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", not_found)
    with pytest.raises(ValueError, match="'acme/none' was not found on the Hugging Face Hub.*HF_TOKEN"):
        resolve_model_path("acme/none")


@pytest.mark.parametrize("var", ["VLLM_USE_MODELSCOPE", "PAGEDLLM_USE_MODELSCOPE"])
def test_modelscope(monkeypatch, tmp_path, var):
    monkeypatch.setenv(var, "True")
    monkeypatch.setitem(sys.modules, "modelscope", None)  # not installed
    with pytest.raises(ValueError, match="the `modelscope` package is not installed: `pip install modelscope`"):
        resolve_model_path("acme/tiny")
    calls = []
    fake = types.ModuleType("modelscope")
    fake.snapshot_download = lambda model_id, **kw: calls.append((model_id, kw)) or str(tmp_path)
    monkeypatch.setitem(sys.modules, "modelscope", fake)
    assert resolve_model_path("acme/tiny", revision="v1", download_dir="/d") == str(tmp_path)
    assert calls[0][0] == "acme/tiny" and calls[0][1]["revision"] == "v1" and calls[0][1]["cache_dir"] == "/d"
