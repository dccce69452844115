"""Hub repo ids as --model, with the real huggingface_hub and no network: a cache laid out as the hub lays it
out (conftest.hf_hub_cache: blobs, refs, snapshots of symlinks), found through HF_HUB_CACHE or HF_HOME, with
HF_HUB_OFFLINE and with an unreachable hub; downloads from a local stand-in for the Hub's HTTP API (FakeHub:
the routes and headers snapshot_download uses, the Hub's error codes), which sees the token, the revision and
the files asked for. Resolution runs in a fresh interpreter, as in an engine process: nothing has imported
huggingface_hub's submodules there yet (what the test process's transformers import hides). ModelScope through
the `modelscope` library, or a message naming it."""
from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import subprocess
import sys
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional
from urllib.parse import unquote, urlsplit

import pytest

from pagedllm.entrypoints.server_process import free_port
from pagedllm.models.loader import resolve_model_path
from pagedllm.models.model_resolution import ALLOW_PATTERNS, looks_like_repo_id

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_RESOLVE = r'''
import json, sys
from pagedllm.models.loader import resolve_model_path
for model, revision, download_dir, *token in json.loads(sys.argv[1]):
    try:
        print(json.dumps(["ok", resolve_model_path(model, revision, download_dir, *token)]))
    except ValueError as e:
        print(json.dumps(["error", str(e)]))
'''


def hub_env(**hub_vars: str) -> dict:
    """This process's environment without any Hugging Face variable, plus `hub_vars`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_")) and k != "XDG_CACHE_HOME"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO_ROOT, "src"), env.get("PYTHONPATH", "")])
    return {**env, **hub_vars}


def resolve_fresh(queries: list, **hub_vars: str) -> list:
    """resolve_model_path(model, revision, download_dir[, token]) for each query, in one new interpreter started with
    hub_env(**hub_vars): ("ok", path) or ("error", the ValueError's message)."""
    out = subprocess.run([sys.executable, "-c", _RESOLVE, json.dumps(queries)], env=hub_env(**hub_vars),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    results = [tuple(json.loads(line)) for line in out.stdout.splitlines() if line.startswith("[")]
    assert len(results) == len(queries), out.stdout + out.stderr[-3000:]
    return results


def unreachable_endpoint() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there: connections are refused


def test_repo_id_shapes():
    assert looks_like_repo_id("Qwen/Qwen3-0.6B") and looks_like_repo_id("gpt2")
    assert not looks_like_repo_id("/abs/path") and not looks_like_repo_id("./rel") and not looks_like_repo_id("a.gguf")
    assert not looks_like_repo_id("a/b/c") and not looks_like_repo_id("~/m")


@pytest.mark.parametrize("where", ["HF_HUB_CACHE", "HF_HOME"])
def test_offline_cache_by_ref_and_commit(hf_hub_cache, where):
    c = hf_hub_cache
    snap = os.path.join(c.cache, "models--acme--tiny", "snapshots")
    location = {"HF_HUB_CACHE": c.cache, "HF_HOME": c.home}[where]
    results = resolve_fresh([["acme/tiny", None, None], ["acme/tiny", "v2", None], ["acme/tiny", c.v2, None],
                             ["acme/missing", None, None], ["acme/tiny", "v9", None]],
                            HF_HUB_OFFLINE="1", **{where: location})
    assert results[:3] == [("ok", os.path.join(snap, c.main)), ("ok", os.path.join(snap, c.v2)),
                           ("ok", os.path.join(snap, c.v2))]
    assert results[3][0] == "error" and results[3][1].startswith(
        f"Model 'acme/missing' is not in the local Hugging Face cache ({c.cache}) and HF_HUB_OFFLINE is set")
    assert results[4][0] == "error" and "'acme/tiny' at revision 'v9' is not in the local" in results[4][1]


def test_unreachable_hub_falls_back_to_the_cache(hf_hub_cache):
    """Not offline, but the hub cannot be reached: what is cached is used, what is not says so."""
    c = hf_hub_cache
    snap = os.path.join(c.cache, "models--acme--tiny", "snapshots")
    results = resolve_fresh([["acme/tiny", None, None], ["acme/tiny", "v2", None], ["acme/missing", None, None]],
                            HF_HOME=c.home, HF_ENDPOINT=unreachable_endpoint())
    assert results[:2] == [("ok", os.path.join(snap, c.main)), ("ok", os.path.join(snap, c.v2))]
    assert results[2][0] == "error"
    assert results[2][1].startswith(f"Could not download 'acme/missing' from the Hugging Face Hub, and it is not "
                                    f"in the local cache ({c.cache})")
    assert "check the network" in results[2][1] and "\n" not in results[2][1]


def test_download_dir_is_the_cache(hf_hub_cache, tmp_path):
    """--download-dir is the cache to read (and download into) instead of the default one."""
    c = hf_hub_cache
    snap = os.path.join(c.cache, "models--acme--tiny", "snapshots")
    (result,) = resolve_fresh([["acme/tiny", "v2", c.cache]], HF_HOME=str(tmp_path / "elsewhere"),
                              HF_HUB_OFFLINE="1")
    assert result == ("ok", os.path.join(snap, c.v2))


def test_engine_serves_a_cached_repo_id(hf_hub_cache, monkeypatch):
    """In this process (huggingface_hub already imported, so its HF_* settings are fixed): --download-dir."""
    from pagedllm import LLM, SamplingParams
    from tests.engine.test_correctness import hf_greedy

    c = hf_hub_cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    llm = LLM(model=c.repo, download_dir=c.cache, revision="v2", dtype="float32", num_gpu_blocks_override=16,
              max_model_len=256)
    try:
        assert llm.engine.model_dir == os.path.join(c.cache, "models--acme--tiny", "snapshots", c.v2)
        out = llm.generate({"prompt_token_ids": [5, 9, 33]},
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert out[0].outputs[0].token_ids == hf_greedy(c.v2_dir, [5, 9, 33], 4)[0]  # v2's model, not main's
    finally:
        llm.engine.shutdown()


# ---- downloads, from a local stand-in for the Hub ---------------------------------------------------------

def _etag(path: str, data: bytes) -> str:
    if path.endswith(".safetensors"):  # LFS: the sha256 of the content
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    """One model repo served over HTTP on 127.0.0.1 the way huggingface.co answers huggingface_hub: repo info
    (/api/models/R/revision/REV), the tree listing, HEAD and GET of /R/resolve/COMMIT/PATH with X-Repo-Commit
    and ETag, and the Hub's error codes (X-Error-Code RepoNotFound / RevisionNotFound / GatedRepo). A repo with
    `token` answers RepoNotFound (401) to requests without that bearer token, as a private repo does."""

    def __init__(self, repo: str, files: dict[str, bytes], revisions: dict[str, str], token: Optional[str] = None,
                 gated: bool = False):
        self.repo, self.files, self.revisions, self.token, self.gated = repo, files, revisions, token, gated
        self.requests: list[tuple[str, str, Optional[str]]] = []  # (method, path, authorization)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                hub._answer(self, body=True)

            def do_HEAD(self):
                hub._answer(self, body=False)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _send(self, h, status: int, payload: bytes = b"", body: bool = True, **headers: str) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k.replace("_", "-"), v)
        h.send_header("Content-Length", str(len(payload)))
        h.end_headers()
        if body:
            h.wfile.write(payload)

    def _error(self, h, status: int, code: str, body: bool) -> None:
        message = json.dumps({"error": code}).encode()
        self._send(h, status, message, body, X_Error_Code=code, X_Error_Message=code,
                   Content_Type="application/json")

    def _answer(self, h, body: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        self.requests.append((h.command, path, h.headers.get("authorization")))
        api, resolve = f"/api/models/{self.repo}/", f"/{self.repo}/resolve/"
        if not (path.startswith(api) or path.startswith(resolve)):
            return self._error(h, 401, "RepoNotFound", body)  # what the Hub says of any repo it will not show
        if self.token is not None and h.headers.get("authorization") != f"Bearer {self.token}":
            return self._error(h, 401, "RepoNotFound", body)
        if path.startswith(api + "revision/") or path.startswith(api + "tree/"):
            kind, _, revision = path[len(api):].partition("/")
            commit = self.revisions.get(revision, revision if revision in self.revisions.values() else None)
            if commit is None:
                return self._error(h, 404, "RevisionNotFound", body)
            if kind == "revision":
                info = {"id": self.repo, "modelId": self.repo, "sha": commit, "private": self.token is not None,
                        "gated": "manual" if self.gated else False,
                        "siblings": [{"rfilename": p} for p in sorted(self.files)]}
                return self._send(h, 200, json.dumps(info).encode(), body, Content_Type="application/json")
            tree = []
            for p, data in sorted(self.files.items()):
                entry = {"type": "file", "path": p, "size": len(data), "oid": _etag("x", data)}
                if p.endswith(".safetensors"):
                    entry["lfs"] = {"oid": _etag(p, data), "size": len(data), "pointerSize": 134}
                tree.append(entry)
            return self._send(h, 200, json.dumps(tree).encode(), body, Content_Type="application/json")
        if path.startswith(resolve):
            revision, _, filename = path[len(resolve):].partition("/")
            commit = self.revisions.get(revision, revision if revision in self.revisions.values() else None)
            if commit is None:
                return self._error(h, 404, "RevisionNotFound", body)
            if self.gated:
                return self._error(h, 403, "GatedRepo", body)
            if filename not in self.files:
                return self._error(h, 404, "EntryNotFound", body)
            data = self.files[filename]
            return self._send(h, 200, data, body, X_Repo_Commit=commit, ETag=f'"{_etag(filename, data)}"',
                              Content_Type="application/octet-stream")
        return self._error(h, 404, "EntryNotFound", body)


def _model_files(model_dir: str) -> dict[str, bytes]:
    files = {}
    for root, _, names in os.walk(model_dir):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                files[os.path.relpath(os.path.join(root, name), model_dir)] = f.read()
    return files


def test_download_with_token_revision_and_only_the_engine_s_files(tmp_path, tiny_llama_dir):
    files = _model_files(tiny_llama_dir)
    extra = {"pytorch_model.bin": b"pickle", "model.Q4_0.gguf": b"GGUF", "README.md": b"# tiny",
             "onnx/model.onnx": b"onnx"}
    commit = "c3" * 20
    cache = str(tmp_path / "home" / "hub")
    with FakeHub("acme/private", {**files, **extra}, {"v2": commit}, token="hf_secret") as hub:
        (result,) = resolve_fresh([["acme/private", "v2", None]], HF_HOME=str(tmp_path / "home"),
                                  HF_ENDPOINT=hub.url, HF_TOKEN="hf_secret", PAGEDLLM_DISABLE_PROGRESS_BARS="1")
        requests = [r for r in hub.requests if "acme/private" in r[1]]  # (2.x also asks the Hub other things)
        (no_token,) = resolve_fresh([["acme/private", "v2", None]], HF_HOME=str(tmp_path / "other"),
                                    HF_ENDPOINT=hub.url)
    snapshot = os.path.join(cache, "models--acme--private", "snapshots", commit)
    assert result == ("ok", snapshot)
    assert requests and all(auth == "Bearer hf_secret" for _, _, auth in requests)
    assert "/api/models/acme/private/revision/v2" in {p for _, p, _ in requests}
    fetched = {p.rsplit(f"/resolve/{commit}/", 1)[1] for m, p, _ in requests if m == "GET" and "/resolve/" in p}
    assert fetched == set(files), "exactly the engine's files (configs, tokenizer, safetensors) are downloaded"
    assert all(any(fnmatch.fnmatch(p, pat) for pat in ALLOW_PATTERNS) for p in fetched)
    for p, data in files.items():  # stored as the hub stores a download: blobs and symlinks
        link = os.path.join(snapshot, p)
        assert os.path.islink(link) and open(link, "rb").read() == data
    with open(os.path.join(cache, "models--acme--private", "refs", "v2")) as f:
        assert f.read() == commit
    assert no_token[0] == "error" and no_token[1].startswith(
        "Model 'acme/private' was not found on the Hugging Face Hub (nor as a local path); if it is private, "
        "set HF_TOKEN.")
    # what was downloaded is then found offline, by its ref
    assert resolve_fresh([["acme/private", "v2", None]], HF_HOME=str(tmp_path / "home"),
                         HF_HUB_OFFLINE="1") == [("ok", snapshot)]


def test_hf_token_argument(tmp_path, tiny_llama_dir):
    """vLLM's hf_token: the token itself, or True for the one `hf auth login` stored (HF_HOME/token); True with none
    stored is one sentence, not a failed download."""
    files = _model_files(tiny_llama_dir)
    commit = "f6" * 20
    stored = tmp_path / "logged-in"
    stored.mkdir()
    (stored / "token").write_text("hf_secret")
    with FakeHub("acme/private", files, {"main": commit}, token="hf_secret") as hub:
        queries = [["acme/private", None, None, "hf_secret"], ["acme/private", None, None, True]]
        given, none_stored = resolve_fresh(queries, HF_HOME=str(tmp_path / "plain"), HF_ENDPOINT=hub.url,
                                           PAGEDLLM_DISABLE_PROGRESS_BARS="1")
        (from_store,) = resolve_fresh([["acme/private", None, None, True]], HF_HOME=str(stored), HF_ENDPOINT=hub.url,
                                      PAGEDLLM_DISABLE_PROGRESS_BARS="1")
    assert given == ("ok", str(tmp_path / "plain" / "hub" / "models--acme--private" / "snapshots" / commit))
    assert from_store == ("ok", str(stored / "hub" / "models--acme--private" / "snapshots" / commit))
    assert none_stored == ("error", "hf_token=True uses the Hugging Face token stored by `hf auth login` (or "
                                    "HF_TOKEN), but there is none: log in, or pass the token itself.")
    assert {auth for _, path, auth in hub.requests if "acme/private" in path} == {"Bearer hf_secret"}


def test_hub_errors_are_one_sentence(tmp_path, tiny_llama_dir):
    files = _model_files(tiny_llama_dir)
    with FakeHub("acme/gated", files, {"main": "d4" * 20}, gated=True) as gated, \
            FakeHub("acme/tiny", files, {"main": "e5" * 20}) as plain:
        (gated_result,) = resolve_fresh([["acme/gated", None, None]], HF_HOME=str(tmp_path / "g"),
                                        HF_ENDPOINT=gated.url, PAGEDLLM_DISABLE_PROGRESS_BARS="1")
        results = resolve_fresh([["acme/tiny", "v9", None], ["acme/none", None, None]],
                                HF_HOME=str(tmp_path / "p"), HF_ENDPOINT=plain.url)
    assert gated_result == ("error", "Model 'acme/gated' is gated on the Hugging Face Hub: accept its terms on its "
                                     "page and set HF_TOKEN to a token of that account.")
    assert results == [("error", "Model 'acme/tiny' has no revision 'v9' on the Hugging Face Hub."),
                       ("error", "Model 'acme/none' was not found on the Hugging Face Hub (nor as a local path); "
                                 "if it is private, set HF_TOKEN.")]


@pytest.mark.parametrize("var", ["VLLM_USE_MODELSCOPE", "PAGEDLLM_USE_MODELSCOPE"])
def test_modelscope(monkeypatch, tmp_path, var):
    monkeypatch.setenv(var, "True")
    monkeypatch.setitem(sys.modules, "modelscope", None)  # not installed
    with pytest.raises(ValueError, match="the `modelscope` package is not installed: `pip install modelscope`"):
        resolve_model_path("acme/tiny")
    calls = []
    fake = types.ModuleType("modelscope")  # modelscope is not a test dependency: its API as the boundary
    fake.snapshot_download = lambda model_id, **kw: calls.append((model_id, kw)) or str(tmp_path)
    monkeypatch.setitem(sys.modules, "modelscope", fake)
    assert resolve_model_path("acme/tiny", revision="v1", download_dir="/d") == str(tmp_path)
    assert calls[0][0] == "acme/tiny" and calls[0][1]["revision"] == "v1" and calls[0][1]["cache_dir"] == "/d"
