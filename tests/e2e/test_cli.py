"""The command line: bench serve, chat/complete -q, --version, start-up failures, and the `vllm` shim."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from e2e_helpers import API_KEY, SERVED_NAME, Server, cli

from pagedllm.entrypoints.server_process import free_port, wait_healthy


def run(args: list[str], env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)


def test_version_and_help(e2e_env: dict) -> None:
    import pagedllm

    r = run([cli("pagedllm"), "--version"], e2e_env)
    assert r.returncode == 0 and pagedllm.__version__ in r.stdout
    r = run([cli("pagedllm"), "--help"], e2e_env)
    assert r.returncode == 0 and all(w in r.stdout for w in ("serve", "chat", "complete", "bench"))
    # `python -m pagedllm` was "No module named pagedllm.__main__"
    r = run([sys.executable, "-m", "pagedllm", "--help"], e2e_env)
    assert r.returncode == 0 and r.stdout.startswith("usage: pagedllm ") and "serve" in r.stdout
    r = run([sys.executable, "-m", "pagedllm", "no-such-command"], e2e_env)
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_bench_serve_prints_result_block(server: Server, e2e_env: dict, tmp_path) -> None:
    out = tmp_path / "result.json"
    r = run([cli("pagedllm"), "bench", "serve", "--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "6",
             "--max-concurrency", "3", "--random-input-len", "16", "--random-output-len", "6", "--ignore-eos",
             "--seed", "1", "--save-result", "--result-filename", str(out)], e2e_env)
    assert r.returncode == 0, r.stderr[-2000:]
    for line in ("Serving Benchmark Result", "Successful requests:                     6",
                 "Benchmark duration (s):", "Request throughput (req/s):", "Output token throughput (tok/s):",
                 "Total Token throughput (tok/s):", "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):",
                 "Mean TPOT (ms):", "P99 ITL (ms):", "Total generated tokens:                  36"):
        assert line in r.stdout, (line, r.stdout)
    saved = json.loads(out.read_text())
    assert saved["completed"] == 6 and saved["total_output_tokens"] == 36 and saved["output_throughput"] > 0
    # tokens per chunk: every engine step is its own chunk of one token (counts, the same on any machine; a token
    # whose text is empty, e.g. half a UTF-8 character, is credited to the next chunk with text)
    for line in ("Tokens per Chunk", "Mean tokens per chunk:", "Median tokens per chunk:", "P99 tokens per chunk:",
                 "Max tokens per chunk:"):
        assert line in r.stdout, (line, r.stdout)
    assert saved["chunk_tokens_measured"] and saved["median_tokens_per_chunk"] == 1
    assert 1 <= saved["mean_tokens_per_chunk"] <= 1.5 and saved["max_tokens_per_chunk"] <= 2, saved


def test_bench_serve_takes_the_key_from_openai_api_key(server: Server, e2e_env: dict) -> None:
    """Without --api-key, `bench serve` sends $OPENAI_API_KEY, as vLLM's bench serve does (it sent none: every
    request of a keyed server was a 401)."""
    r = run([cli("pagedllm"), "bench", "serve", "--base-url", server.url, "--num-prompts", "2", "--random-input-len",
             "8", "--random-output-len", "2", "--ignore-eos", "--disable-tqdm"], dict(e2e_env, OPENAI_API_KEY=API_KEY))
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    assert "Successful requests:                     2" in r.stdout, r.stdout


def test_bench_serve_in_two_client_processes(server: Server, e2e_env: dict, tmp_path) -> None:
    out = tmp_path / "result.json"
    r = run([cli("pagedllm"), "bench", "serve", "--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "8",
             "--max-concurrency", "4", "--random-input-len", "16", "--random-output-len", "5", "--ignore-eos",
             "--seed", "2", "--client-processes", "2", "--save-result", "--result-filename", str(out)], e2e_env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Client: 2 client processes, the busiest at" in r.stdout, r.stdout
    saved = json.loads(out.read_text())
    assert saved["completed"] == 8 and saved["failed"] == 0 and saved["total_output_tokens"] == 40
    assert saved["client_processes"] == 2 and saved["median_tokens_per_chunk"] == 1
    # several processes need the raw plain-HTTP client: an https server is refused up front, not half-run
    r = run([cli("pagedllm"), "bench", "serve", "--base-url", "https://127.0.0.1:1", "--num-prompts", "1",
             "--client-processes", "2"], e2e_env)
    assert r.returncode == 2 and "--client-processes > 1 needs a plain http:// server URL" in r.stderr
    r = run([cli("pagedllm"), "bench", "serve", "--base-url", server.url, "--client-processes", "0"], e2e_env)
    assert r.returncode == 2 and "must be >= 1" in r.stderr


def test_chat_and_complete_quick(server: Server, e2e_env: dict) -> None:
    r = run([cli("pagedllm"), "chat", "--url", server.base_url, "--api-key", API_KEY, "--max-tokens", "8",
             "--temperature", "0", "-q", "What is the capital of France?"], e2e_env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Paris" in r.stdout
    r = run([cli("pagedllm"), "chat", "--url", server.base_url, "--api-key", API_KEY, "--system-prompt",
             "You are a pirate.", "--max-tokens", "4", "--no-stream", "-q", "Hello!"], e2e_env)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr[-2000:]
    r = run([cli("pagedllm"), "complete", "--url", server.base_url, "--api-key", API_KEY, "--model-name", SERVED_NAME,
             "--max-tokens", "5", "-q", "One, two, three,"], e2e_env)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr[-2000:]


class _RecordingProxy:
    """A pass-through HTTP proxy in front of the real server that keeps every request body it forwards."""

    def __init__(self, upstream: str) -> None:
        import http.server
        import threading

        import httpx

        self.bodies: list[dict] = []
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _forward(self, method: str) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if raw:
                    proxy.bodies.append(json.loads(raw))
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("authorization", "content-type")}
                with httpx.stream(method, upstream + self.path, content=raw, headers=headers, timeout=120) as r:
                    self.send_response(r.status_code)
                    self.send_header("Content-Type", r.headers.get("content-type", "application/json"))
                    self.send_header("Connection", "close")
                    self.end_headers()
                    for chunk in r.iter_raw():
                        self.wfile.write(chunk)
                        self.wfile.flush()

            def do_GET(self) -> None:
                self._forward("GET")

            def do_POST(self) -> None:
                self._forward("POST")

            def log_message(self, *args) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_chat_interactive_keeps_history(server: Server, e2e_env: dict) -> None:
    """The second turn sends the whole conversation: the first question, the answer the user saw, the new one."""
    proxy = _RecordingProxy(server.url)
    try:
        p = subprocess.run([cli("pagedllm"), "chat", "--url", proxy.url + "/v1", "--api-key", API_KEY,
                            "--max-tokens", "6", "--temperature", "0", "--system-prompt", "Be brief."],
                           input="My name is Ada.\nWhat is my name?\n", capture_output=True, text=True, timeout=240,
                           env=e2e_env)
    finally:
        proxy.close()
    assert p.returncode == 0, p.stderr[-2000:]
    chats = [b for b in proxy.bodies if "messages" in b]
    assert len(chats) == 2, proxy.bodies
    first, second = chats[0]["messages"], chats[1]["messages"]
    assert first == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "My name is Ada."}]
    assert second[:2] == first and second[3] == {"role": "user", "content": "What is my name?"}
    assert len(second) == 4 and second[2]["role"] == "assistant" and second[2]["content"]
    assert second[2]["content"] in p.stdout  # the history holds exactly the answer that was shown


def test_client_errors_are_one_line(e2e_env: dict) -> None:
    r = run([cli("pagedllm"), "chat", "--url", f"http://127.0.0.1:{free_port()}/v1", "-q", "hi"], e2e_env, timeout=60)
    assert r.returncode == 1 and "cannot reach a server" in r.stderr


@pytest.mark.parametrize("flags,fragment", [
    (["--quantization", "gptq"], "needs a gptq-quantized checkpoint"),
    (["--tensor-parallel-size", "2"], "does not divide the model's 9 attention heads"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}', "--distributed-executor-backend", "mp"],
     "not supported yet"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}',
      "--pipeline-parallel-size", "2"], "not supported yet"),
    (["--cpu-offload-gb", "4", "--device", "cpu"], "meaningless on the CPU"),
    (["--lora-modules", "sql=/tmp/sql"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "sql"], "must be name=path or a JSON object"),
    (["--enable-lora", "--lora-modules", '{"name": "sql"}'], 'needs "name" and "path"'),
    (["--enable-lora", "--max-loras", "0"], "max_loras must be >= 1"),
    (["--enable-lora", "--max-lora-rank", "16", "--lora-modules", "sql=/no/such/dir"],
     "--lora-modules sql: LoRA adapter path '/no/such/dir' is not a directory"),
    (["--tokenizer", "/no/such/tokenizer"], "Could not load a tokenizer: the path '/no/such/tokenizer' does not exist"),
    (["--chat-template", "/no/such/chat.jinja"], "The chat template '/no/such/chat.jinja' looks like a file path"),
    (["--chat-template", "{% if messages %}"], "The chat template does not parse as a Jinja template"),
    (["--h11-max-header-count", "64"], "--h11-max-header-count is not supported: the installed uvicorn"),
    (["--tokens-only"], "--tokens-only is not supported yet"),
    (["--middleware", "no_such_module.Thing"], "--middleware no_such_module.Thing: cannot import it"),
    (["--middleware", "json.decoder"], "Invalid middleware json.decoder. Must be a function or a class."),
])
def test_unsupported_flags_fail_at_start(e2e_env: dict, flags: list[str], fragment: str) -> None:
    r = run([cli("pagedllm"), "serve", "--port", str(free_port()), *flags], e2e_env, timeout=60)
    assert r.returncode != 0 and fragment in r.stderr, r.stderr


def test_config_file_errors(e2e_env: dict, tmp_path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("no-such-flag: 3\n")
    r = run([cli("pagedllm"), "serve", "--config", str(cfg)], e2e_env, timeout=60)
    assert r.returncode != 0 and "unknown key 'no-such-flag'" in r.stderr
    cfg.write_text("quantization: gptq\n")
    r = run([cli("pagedllm"), "serve", "--config", str(cfg), "--port", str(free_port())], e2e_env, timeout=60)
    assert r.returncode != 0 and "needs a gptq-quantized checkpoint" in r.stderr


def test_bad_model_path_is_one_clear_line(e2e_env: dict, tmp_path) -> None:
    r = run([cli("pagedllm"), "serve", str(tmp_path / "missing-model"), "--port", str(free_port())], e2e_env,
            timeout=180)
    assert r.returncode == 1
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "missing-model" in errors[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_unreadable_tokenizer_dir_is_one_clear_line(smollm2_hf_dir: str, e2e_env: dict, tmp_path) -> None:
    """A --tokenizer directory that exists but holds no tokenizer fails in the front end, after the engine
    started: one error line and exit 2, not the traceback of transformers' hub lookup."""
    r = run([cli("pagedllm"), "serve", smollm2_hf_dir, "--tokenizer", str(tmp_path), "--port", str(free_port())],
            e2e_env, timeout=180)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "Could not load a tokenizer" in errors[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def _vllm_is_shim() -> bool:
    try:
        import vllm
    except ImportError:
        return False
    return "vllm_compat" in (getattr(vllm, "__file__", "") or "")


shim = pytest.mark.skipif(not _vllm_is_shim(), reason="the pagedllm-vllm-compat shim is not installed "
                          "(VLLM_COMPAT=0, or a real vLLM is installed)")


@shim
def test_vllm_shim_commands(server: Server, e2e_env: dict) -> None:
    r = run([sys.executable, "-c", "from vllm import LLM, SamplingParams; from vllm.lora.request import LoRARequest; "
             "from vllm import PoolingParams; from vllm.pooling_params import PoolingParams as P2; "
             "from vllm.outputs import EmbeddingRequestOutput; "
             "import pagedllm; assert SamplingParams is pagedllm.SamplingParams and LLM is pagedllm.LLM; "
             "assert PoolingParams is P2 is pagedllm.PoolingParams; "
             "print(LoRARequest('a', 1, '/x').lora_name)"], e2e_env)
    assert r.returncode == 0 and r.stdout.strip() == "a", r.stderr
    r = run([cli("vllm"), "--version"], e2e_env)
    assert r.returncode == 0
    r = run([cli("vllm"), "serve", "--quantization", "gptq", "--port", str(free_port())], e2e_env, timeout=60)
    assert r.returncode != 0 and "needs a gptq-quantized checkpoint" in r.stderr
    r = run([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--enable-lora", "--max-loras", "0"],
            e2e_env, timeout=60)
    assert r.returncode != 0 and "max_loras must be >= 1" in r.stderr
    r = run([cli("vllm"), "chat", "--url", server.base_url, "--api-key", API_KEY, "--max-tokens", "4", "-q", "Hi"],
            e2e_env)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr[-2000:]
    r = run([cli("vllm"), "complete", "--url", server.base_url, "--api-key", API_KEY, "--max-tokens", "4", "-q", "Hi"],
            e2e_env)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr[-2000:]
    r = run([cli("vllm"), "bench", "serve", "--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "2",
             "--random-input-len", "8", "--random-output-len", "3", "--disable-tqdm"], e2e_env)
    assert r.returncode == 0 and "Serving Benchmark Result" in r.stdout, r.stderr[-2000:]


@shim
def test_vllm_api_server_module_serves(smollm2_hf_dir: str, e2e_env: dict, tmp_path) -> None:
    """`python -m vllm.entrypoints.openai.api_server --model M` starts a working server (no --config)."""
    import httpx

    from e2e_helpers import stop

    port = free_port()
    log_path = str(tmp_path / "vllm_server.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", smollm2_hf_dir,
                                 "--port", str(port), "--max-model-len", "256", "--kv-cache-memory-bytes",
                                 str(32 << 20)], stdout=log, stderr=subprocess.STDOUT, env=e2e_env)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", log_path=log_path)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"]
        assert models[0]["id"] == smollm2_hf_dir and models[0]["max_model_len"] == 256
        text = open(log_path).read()
        assert f"http://127.0.0.1:{port}/v1" in text and "KV" in text
    finally:
        stop(proc)
    assert proc.returncode == 0, open(log_path).read()[-2000:]


def test_bench_throughput_and_latency_offline(smollm2_hf_dir: str, e2e_env: dict, tmp_path) -> None:
    # (serve's engine flags and their size suffixes: bench took a subset, as plain integers)
    small = ["--model", smollm2_hf_dir, "--max-model-len", "256", "--kv-cache-memory-bytes", "32M"]
    out = tmp_path / "tp.json"
    r = run([cli("pagedllm"), "bench", "throughput", *small, "--num-prompts", "4", "--input-len", "16",
             "--output-len", "8", "--output-json", str(out)], e2e_env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Throughput:" in r.stdout and "output tokens/s" in r.stdout
    assert json.loads(out.read_text())["total_output_tokens"] == 32
    r = run([cli("pagedllm"), "bench", "latency", *small, "--batch-size", "2", "--input-len", "8", "--output-len", "4",
             "--num-iters-warmup", "1", "--num-iters", "2",
             "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'], e2e_env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Avg latency:" in r.stdout and "time per step" in r.stdout
    # the flag reaches the engine (it was an unrecognized argument)
    r = run([cli("pagedllm"), "bench", "throughput", *small, "--speculative-config", '{"method": "nope"}'], e2e_env)
    assert r.returncode == 1 and "speculative_config needs 'method'" in r.stderr, r.stderr[-2000:]


def test_bench_throughput_refuses_outputs_past_the_context(tiny_llama_dir: str, e2e_env: dict, tmp_path) -> None:
    """--output-len past the context's room was cut at its end without a word (100 asked, 56 counted); it is
    refused as bench latency refuses it, and a request that fits still runs."""
    small = ["--model", tiny_llama_dir, "--dtype", "float32", "--max-model-len", "64", "--num-prompts", "2"]
    r = run([cli("pagedllm"), "bench", "throughput", *small, "--input-len", "8", "--output-len", "100"], e2e_env)
    assert r.returncode == 1 and "a request of 8 prompt + 100 output tokens" in r.stderr, r.stderr[-2000:]
    assert "more than the model's context (64 tokens, --max-model-len)" in r.stderr and "Throughput" not in r.stdout
    out = tmp_path / "tp.json"
    r = run([cli("pagedllm"), "bench", "throughput", *small, "--input-len", "8", "--output-len", "56",
             "--output-json", str(out)], e2e_env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(out.read_text())["total_output_tokens"] == 112


def test_bench_prompts_via_tokenize_when_tokenizer_is_not_local(server: Server) -> None:
    import argparse

    from pagedllm.entrypoints.cli.bench_serve import _token_pool, sample_random_requests

    pool, tok = _token_pool(argparse.Namespace(tokenizer=None, api_key=API_KEY), server.url, "/not/on/this/machine")
    assert tok is None and len(pool) > 20
    reqs = sample_random_requests(pool, 3, 10, 4, 0.0, seed=0)
    assert [len(r.prompt_token_ids) for r in reqs] == [10, 10, 10]
