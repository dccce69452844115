"""The README's first five minutes, as a new user runs them: the server `make serve` starts (the Makefile's own
`serve` recipe with its defaults, a free port in place of 8000), then the README's curl, its Python streaming
snippet and its `pagedllm chat` / `pagedllm complete` commands, copied out of README.md when the test runs (so the
test follows the README when it changes) and run as written, with only the port substituted (and `--url` added to
the commands that rely on the default port). The answers must be sensible: France -> "Paris"; the haiku streams
English text over several chunks.

The README's examples do not fix a seed, so their sampling is what a user gets. The deterministic tests below
check, per seed, that the server samples with the default model's recommended defaults and that a request's own
values win.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from e2e_helpers import stop

from pagedllm import SamplingParams
from pagedllm.entrypoints.server_process import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAKEFILE = ROOT / "Makefile"
README_PORT = "8000"


# ------------------------------------------------------------------------------------------------ the README

def _code_blocks(text: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)]


def first_minutes_blocks() -> list[tuple[str, str]]:
    """The code blocks of the README's top (before the first section marker) and of its Serving section."""
    text = README.read_text()
    start = text.index("<!-- BEGIN serving")
    end = text.index("<!-- END serving -->")
    return _code_blocks(text[:start]) + _code_blocks(text[start:end])


def _one(blocks: list[tuple[str, str]], lang: str, marker: str) -> str:
    found = [body for kind, body in blocks if kind == lang and marker in body]
    assert len(found) == 1, f"expected one {lang} block with {marker!r} in README.md's Serving section, found " \
                            f"{len(found)}"
    return found[0]


def _with_port(code: str, port: int) -> str:
    assert f"127.0.0.1:{README_PORT}" in code, code
    return code.replace(f"127.0.0.1:{README_PORT}", f"127.0.0.1:{port}")


def client_commands(blocks: list[tuple[str, str]]) -> list[list[str]]:
    """`pagedllm chat` / `pagedllm complete` lines of the clients block: comments and `[optional]` parts dropped."""
    body = _one(blocks, "bash", "pagedllm bench serve")
    commands = []
    for line in body.splitlines():
        line = re.sub(r"\s+#.*$", "", line)
        line = re.sub(r"\s*\[[^\]]*\]", "", line).strip()
        if line.startswith(("pagedllm chat", "pagedllm complete")):
            commands.append(shlex.split(line))
    return commands


def make_serve_command(port: int) -> list[str]:
    """The Makefile's `serve` recipe with the Makefile's own defaults, this venv for $(VENV) and `port` for PORT."""
    text = MAKEFILE.read_text()
    values = dict(re.findall(r"^(\w+)\s*\?=[ \t]*(.*?)[ \t]*$", text, re.M))
    values.update(VENV=sys.prefix, PORT=str(port))
    recipe = re.search(r"^serve:.*\n((?:\t.*\n)+)", text, re.M)
    assert recipe, "no serve: target in the Makefile"
    lines = [line.strip() for line in recipe.group(1).splitlines()]
    assert len(lines) == 1, f"the serve recipe is expected to be one command: {lines}"
    command = re.sub(r"\$\((\w+)\)", lambda m: values.get(m.group(1), ""), lines[0])
    return shlex.split(command)


# ------------------------------------------------------------------------------------------------ the server

@pytest.fixture(scope="module")
def make_serve(smollm2_hf_dir: str, e2e_env: dict, tmp_path_factory):
    """`make serve` without the setup step (this venv is set up): the default model, the Makefile's flags."""
    tmp = tmp_path_factory.mktemp("readme")
    port = free_port()
    command = make_serve_command(port)
    assert command[0].endswith("/bin/pagedllm") and command[1] == "serve", command
    assert os.path.exists(command[0]), f"{command[0]} (the Makefile's $(VENV)/bin/pagedllm) is not installed"
    log_path = str(tmp / "server.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=e2e_env, cwd=str(ROOT))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log_path=log_path)
        yield port, log_path
    finally:
        stop(proc)


def _run(args: list[str], env: dict, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env, cwd=str(ROOT), **kw)
    assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


def _english(text: str) -> bool:
    """Plain English prose: a few words, nearly all letters ASCII, at least one of the commonest words."""
    words = re.findall(r"[A-Za-z']+", text)
    letters = [c for c in text if c.isalpha()]
    common = {"the", "a", "an", "of", "in", "and", "is", "to", "on", "with", "my", "its", "it", "are", "as"}
    return (len(words) >= 3 and sum(c.isascii() for c in letters) >= 0.95 * len(letters)
            and any(w.lower() in common for w in words))


def test_start_log_names_the_recommended_defaults(make_serve) -> None:
    _, log_path = make_serve
    log = Path(log_path).read_text()
    assert ("Sampling defaults from the model's generation config, as recommended by the SmolLM2-Instruct model "
            "card (HuggingFaceTB)") in log, log
    assert "{'temperature': 0.2, 'top_p': 0.9}" in log


def test_readme_curl(make_serve, e2e_env) -> None:
    port, _ = make_serve
    curl = _with_port(_one(first_minutes_blocks(), "bash", "curl "), port)
    done = _run(["bash", "-c", curl], e2e_env)
    answer = json.loads(done.stdout)["choices"][0]["message"]["content"]
    assert "Paris" in answer, answer


def test_readme_python_streaming(make_serve, e2e_env, tmp_path) -> None:
    """The snippet as written; a wrapper around sys.stdout records each write, to count the streamed pieces."""
    port, _ = make_serve
    snippet = _with_port(_one(first_minutes_blocks(), "python", "stream=True"), port)
    writes = tmp_path / "writes.jsonl"
    runner = tmp_path / "readme_snippet.py"
    runner.write_text(
        "import json, sys\n"
        "class Recorder:\n"
        "    def __init__(self, out, path):\n"
        "        self.out, self.log = out, open(path, 'w')\n"
        "    def write(self, text):\n"
        "        self.log.write(json.dumps(text) + '\\n'); self.log.flush()\n"
        "        return self.out.write(text)\n"
        "    def __getattr__(self, name):\n"
        "        return getattr(self.out, name)\n"
        f"sys.stdout = Recorder(sys.stdout, {str(writes)!r})\n"
        f"exec(compile({snippet!r}, 'README.md (python streaming snippet)', 'exec'))\n")
    done = _run([sys.executable, str(runner)], e2e_env)
    pieces = [json.loads(line) for line in writes.read_text().splitlines()]
    content = [p for p in pieces if p.strip()]
    assert len(content) >= 3, pieces  # streamed: several pieces, not one block at the end
    assert _english(done.stdout), done.stdout


def test_readme_cli_clients(make_serve, e2e_env) -> None:
    port, _ = make_serve
    url = f"http://127.0.0.1:{port}/v1"
    commands = client_commands(first_minutes_blocks())
    names = [c[1] for c in commands]
    assert names.count("chat") == 2 and names.count("complete") == 1, commands
    pagedllm = os.path.join(os.path.dirname(sys.executable), "pagedllm")
    for command in commands:
        if "--url" in command:
            i = command.index("--url") + 1
            assert command[i] == f"http://127.0.0.1:{README_PORT}/v1", command
            command[i] = url
        else:  # the README relies on the default URL (port 8000)
            command += ["--url", url]
        command[0] = pagedllm
        if "-q" in command:
            question = command[command.index("-q") + 1]
            out = _run(command, e2e_env).stdout
        else:  # interactive: one question on stdin, then end of input
            question = "What is the capital of France? Answer in one sentence."
            out = _run(command, e2e_env, input=question + "\n").stdout
        if "France" in question:
            assert "Paris" in out, (command, out)
        else:
            assert _english(out), (command, out)


# ----------------------------------------------------------------------- the defaults, seed by seed

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def default_llm(smollm2_cache_dir: str):
    """The offline engine on the same default model as `make serve` (the bundled GGUF, kept quantized on CPU)."""
    from pagedllm import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_CACHE_DIR", smollm2_cache_dir)
        llm = LLM(max_model_len=1024, kv_cache_memory_bytes=64 << 20)
    try:
        yield llm
    finally:
        llm.shutdown()


def test_default_sampling_is_the_recommended_one(make_serve, default_llm) -> None:
    """A request that leaves temperature/top_p out samples at 0.2 / 0.9 (seed by seed equal to the offline engine
    given them, one request at a time on both), says Paris for every seed, and a request's own values win."""
    port, _ = make_serve
    assert default_llm.get_default_sampling_params().temperature == 0.2  # offline, LLM() has them too

    def offline(**params) -> str:
        out = default_llm.chat(QUESTION, SamplingParams(max_tokens=32, **params), use_tqdm=False)
        return out[0].outputs[0].text

    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
        def ask(**fields) -> str:
            r = http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 32, **fields})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]

        seeds = range(6)
        served = [ask(seed=s) for s in seeds]
        assert served == [offline(temperature=0.2, top_p=0.9, seed=s) for s in seeds]
        assert all("Paris" in answer for answer in served), served
        # A request's own values win: at temperature 2 the 135M model wanders off, seed by seed as offline.
        hot = [ask(seed=s, temperature=2.0, top_p=1.0) for s in seeds]
        assert hot == [offline(temperature=2.0, top_p=1.0, seed=s) for s in seeds] and hot != served
        assert ask(temperature=0) == offline(temperature=0)


def test_readme_parsers_find_what_they_run() -> None:
    """The pieces above come from README.md and the Makefile; a change there that hides them fails here."""
    blocks = first_minutes_blocks()
    assert any("make serve" in body for _, body in blocks)
    command = make_serve_command(12345)
    assert command[1] == "serve" and command[command.index("--port") + 1] == "12345", command
    assert not any("$(" in part for part in command), command
