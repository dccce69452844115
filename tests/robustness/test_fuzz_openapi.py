"""Property-based fuzzing of every operation in the server's own OpenAPI schema (schemathesis; valid and
schema-violating bodies, headers, methods): the server never answers 5xx. The request bodies are declared
in the schema from the pydantic models (openapi_bodies.py), so new fields are fuzzed automatically.

A dedicated server with a 64-token context keeps the generated requests (up to n=256) cheap."""
from __future__ import annotations

import os

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="the fuzzer (pip install -e '.[test]')")
pytest.importorskip("hypothesis", reason="schemathesis generates the cases with it")
for _dep in ("fastapi", "pydantic", "msgspec", "zmq"):  # absent where only the engine is installed (GPU machine)
    pytest.importorskip(_dep, reason=f"the OpenAI server's modules need {_dep}")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis.generation.modes import GenerationMode  # noqa: E402

from robust_helpers import API_KEY  # noqa: E402
from robust_helpers import launch, stop  # noqa: E402

# per operation and generation mode (valid, schema-violating): 2 x 50 cases per operation by default
MAX_EXAMPLES = int(os.environ.get("PAGEDLLM_FUZZ_EXAMPLES", "50"))
TRIED: dict[str, int] = {}
FAILED: dict[str, int] = {}


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama_dir: str, robust_env: dict, tmp_path_factory: pytest.TempPathFactory):
    log_path = str(tmp_path_factory.mktemp("fuzz-server") / "server.log")
    server = launch(tiny_llama_dir, ["--api-key", API_KEY, "--max-model-len", "64", "--max-num-seqs", "256",
                                     "--kv-cache-memory-bytes", str(64 << 20), "--disable-uvicorn-access-log"],
                    robust_env, log_path)
    try:
        yield server
    finally:
        stop(server.proc)


def _schema():
    """The schema exactly as the server publishes it (/openapi.json does not depend on the engine), loaded at
    collection so every operation x generation mode is its own test."""
    from types import SimpleNamespace

    from pagedllm.entrypoints.openai.app import build_app

    app = build_app(SimpleNamespace(api_key=API_KEY, engine=None, metrics=None))
    return schemathesis.openapi.from_dict(app.openapi())


OPERATIONS = [result.ok() for result in _schema().get_all_operations()]
MODES = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("operation", OPERATIONS, ids=lambda op: f"{op.method.upper()} {op.path}")
def test_no_operation_answers_5xx(operation, mode, fuzz_server) -> None:
    key = f"{operation.method.upper()} {operation.path}"
    headers = {"Authorization": f"Bearer {API_KEY}"}

    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        TRIED[key] = TRIED.get(key, 0) + 1
        response = case.call(base_url=fuzz_server.url, headers=headers, timeout=60)
        if response.status_code >= 500:
            FAILED[key] = FAILED.get(key, 0) + 1
        assert response.status_code < 500, (response.status_code, response.text[:500], case.body)

    try:
        run()
    except Unsatisfiable:
        if mode is GenerationMode.NEGATIVE and not operation.body:
            pytest.skip("no body or parameters to send invalid values in")
        raise


def test_fuzzing_covered_the_generating_endpoints(fuzz_server) -> None:
    for op in ("POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize", "POST /detokenize"):
        assert TRIED.get(op, 0) >= min(MAX_EXAMPLES, 20), TRIED
    assert not FAILED, FAILED
    print(f"\nfuzzing: {sum(TRIED.values())} cases, {sum(FAILED.values())} 5xx; per operation {TRIED}")
    assert fuzz_server.proc.poll() is None
