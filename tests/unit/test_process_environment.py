"""pagedllm leaves the user's environment alone: `import pagedllm` and a CPU engine do not change os.environ,
so a program the user starts afterwards gets the environment the user had; pagedllm's own OpenMP threads still
spin only briefly between parallel regions (libgomp's verbose report, OMP_DISPLAY_ENV=VERBOSE: GOMP_SPINCOUNT
envs.OWN_SPIN_COUNT, where 300000 is libgomp's default and 0 the passive policy) in each OpenMP runtime loaded
(torch's, which the C++ kernels share, and sentencepiece's); a policy the user chose wins. Each case runs in a
fresh interpreter (libgomp is configured once, when it loads). And no module but envs.py reads or writes
os.environ."""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SRC = os.path.join(REPO_ROOT, "src", "pagedllm")

_SCRIPT = r'''
import json, os, subprocess, sys
model_dir, torch_first = sys.argv[1], sys.argv[2] == "1"
if torch_first:
    import torch
before = dict(os.environ)
import pagedllm
after_import = dict(os.environ)
result = {"import": after_import == before}
if model_dir:
    from pagedllm import LLM, SamplingParams
    llm = LLM(model=model_dir, device="cpu", dtype="float32", num_gpu_blocks_override=16, max_model_len=256)
    out = llm.generate({"prompt_token_ids": [5, 9, 33]}, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)
    result["tokens"] = len(out[0].outputs[0].token_ids)
    result["changed"] = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
    llm.engine.shutdown()
else:
    import torch
    torch.ones(1 << 20).sum()  # a parallel region
with open("/proc/self/maps") as f:
    result["libgomp"] = sorted({line.split()[-1] for line in f if "/libgomp" in line})
result["child"] = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('OMP_WAIT_POLICY'))"],
                                 capture_output=True, text=True).stdout.strip()
print("RESULT " + json.dumps(result))
'''


def run_fresh(model_dir: str = "", torch_first: bool = False, **env_vars: str) -> tuple[dict, list[str]]:
    """The script's result and libgomp's GOMP_SPINCOUNT per OpenMP runtime loaded (one report each)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(OMP_DISPLAY_ENV="VERBOSE", PAGEDLLM_DISABLE_PROGRESS_BARS="1",
               PYTHONPATH=os.pathsep.join([os.path.join(REPO_ROOT, "src"), env.get("PYTHONPATH", "")]), **env_vars)
    out = subprocess.run([sys.executable, "-c", _SCRIPT, model_dir, "1" if torch_first else "0"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    reports = out.stderr.count("OPENMP DISPLAY ENVIRONMENT BEGIN")
    spins = re.findall(r"GOMP_SPINCOUNT = '(\d+)'", out.stderr)
    assert len(spins) == reports, out.stderr[-3000:]
    return json.loads(line[len("RESULT "):]), spins


def test_import_and_a_cpu_engine_leave_os_environ_alone(tiny_llama_dir):
    result, spins = run_fresh(tiny_llama_dir)
    assert result["import"] and result["tokens"] == 3
    assert result["changed"] == []  # nothing set, changed or removed by the engine either
    assert result["child"] == "None"  # a program the user starts gets no OMP_WAIT_POLICY from pagedllm
    # pagedllm's short spin in every OpenMP runtime loaded: torch's, which the C++ kernels share (no copy of their
    # own), and sentencepiece's (its tokenizers).
    from pagedllm.envs import OWN_SPIN_COUNT
    from pagedllm.openmp import OPENMP_PACKAGES, bundled_libgomp

    bundled = {os.path.realpath(p) for p in map(bundled_libgomp, OPENMP_PACKAGES) if p}
    assert {os.path.realpath(p) for p in result["libgomp"]} <= bundled
    assert OWN_SPIN_COUNT not in ("0", "300000")  # neither libgomp default: the check below tells them apart
    assert spins == [OWN_SPIN_COUNT] * len(result["libgomp"]) and spins


def test_the_user_s_policy_wins():
    result, spins = run_fresh(OMP_WAIT_POLICY="ACTIVE")
    assert result["import"] and result["child"] == "ACTIVE" and spins == ["30000000000"] * len(result["libgomp"])
    result, spins = run_fresh(GOMP_SPINCOUNT="1000")
    assert result["import"] and result["child"] == "None" and spins == ["1000"] * len(result["libgomp"])


def test_torch_imported_first_keeps_libgomp_s_default():
    """Too late to choose for torch's libgomp (reported first: loaded with torch): it keeps its spinning default
    (set OMP_WAIT_POLICY yourself there); the copies loaded after pagedllm still get its policy."""
    from pagedllm.envs import OWN_SPIN_COUNT

    result, spins = run_fresh(torch_first=True)
    assert result["import"] and result["child"] == "None"
    assert spins[0] == "300000" and spins[1:] == [OWN_SPIN_COUNT] * (len(result["libgomp"]) - 1)


def _environ_uses(path: str) -> list[str]:
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    names = {"os"} | {a.asname for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names
                      if a.name == "os" and a.asname}
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in names
                and node.attr in ("environ", "environb", "getenv", "putenv", "unsetenv")):
            found.append(f"{os.path.relpath(path, SRC)}:{node.lineno} os.{node.attr}")
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [f"{os.path.relpath(path, SRC)}:{node.lineno} from os import {a.name}" for a in node.names
                      if a.name in ("environ", "environb", "getenv", "putenv", "unsetenv")]
    return found


def test_only_envs_reads_or_writes_the_environment():
    uses = []
    for root, _, files in os.walk(SRC):
        for name in files:
            if name.endswith(".py") and os.path.join(root, name) != os.path.join(SRC, "envs.py"):
                uses += _environ_uses(os.path.join(root, name))
    assert uses == [], "read variables through pagedllm.envs, give children an env (envs.child_env)"
    assert _environ_uses(os.path.join(SRC, "envs.py")), "the scan sees envs.py's own uses"


@pytest.mark.parametrize("preset", [None, "ACTIVE"])
def test_child_env_and_environ_set(monkeypatch, preset):
    from pagedllm import envs

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("PAGEDLLM_DISABLE_PROGRESS_BARS", raising=False)
    if preset is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", preset)
    before = dict(os.environ)
    env = envs.child_env(PAGEDLLM_DISABLE_PROGRESS_BARS="1")
    assert env.get("OMP_WAIT_POLICY") == preset and env["PAGEDLLM_DISABLE_PROGRESS_BARS"] == "1"
    assert env.get("GOMP_SPINCOUNT") == (None if preset else envs.OWN_SPIN_COUNT)  # the user's choice wins
    with envs.environ_set({"OMP_WAIT_POLICY": "X", "PAGEDLLM_NEW_VAR": "1", "PATH": None}):
        assert os.environ.get("OMP_WAIT_POLICY") == "X" and "PATH" not in os.environ
    assert dict(os.environ) == before
