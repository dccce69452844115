"""The GPU suite (`pytest -m gpu`) split into shards of whole test files that each finish well inside the GPU
machine's ten-minute command limit; tests/gpu/run_shards.sh runs them. Not a test module.

    python3 tests/gpu/shards.py files 2/4         shard 2 of 4: its test files, one per line
    python3 tests/gpu/shards.py plan 4            every shard's files and expected seconds
    python3 tests/gpu/shards.py summary XML LOG SECONDS RC NAME      one summary line for a finished shard
    python3 tests/gpu/shards.py measured DIR      seconds per file from a run's JUnit XML (to update EXPECTED_S)

The gpu test files are found by their marker (any test_*.py under tests/ that says `mark.gpu`), so a new file is
never left out; EXPECTED_S balances the shards (longest first onto the least loaded shard). Its numbers are
estimates from reading the tests (Triton compiles ~1-3 s each on the H200 host, an engine start several seconds,
more for the first in a process); replace them with `measured` output after a run on the GPU machine.
"""
from __future__ import annotations

import os
import re
import sys
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Expected seconds per file on the H200 (setup and teardown included).
EXPECTED_S = {
    # measured on the H200 (2026-12-02, `shards.py measured` over the shard XML of that day's run; compiles
    # included), except where a comment says otherwise
    "tests/gpu/test_attention_kernels.py": 80,
    "tests/gpu/test_cpu_offload_gpu.py": 29,
    "tests/gpu/test_dequant_gemm.py": 94,
    "tests/gpu/test_engine_gpu.py": 23,
    "tests/gpu/test_engine_lifecycle_gpu.py": 25,
    "tests/gpu/test_families_gpu.py": 90,  # 65 s measured for its first 12 tests (3 more added since)
    "tests/gpu/test_fused_moe_gpu.py": 242,
    "tests/gpu/test_kv_fp8_kernels.py": 49,
    "tests/gpu/test_lora_gpu.py": 15,
    "tests/gpu/test_mixed_graphs.py": 48,
    "tests/gpu/test_qkv_prep.py": 11,  # 2026-12-01's measurement (2026-12-02's run was cut inside it)
    "tests/gpu/test_quant_act.py": 2,
    "tests/gpu/test_quant_gpu.py": 64,
    "tests/gpu/test_quant_tiled.py": 148,
    "tests/gpu/test_sliding_window_engine_gpu.py": 60,  # 45 s measured before its fp8 test, cut by the run's budget
    "tests/gpu/test_sliding_window_kernels.py": 49,
    "tests/gpu/test_small_kernels.py": 15,
    "tests/gpu/test_smollm2_gpu.py": 47,  # 2026-12-01
    "tests/gpu/test_soft_cap_kernels.py": 66,
    "tests/gpu/test_spec_decode_gpu.py": 16,
    "tests/gpu/test_structured_outputs_gpu.py": 2,  # 2026-12-01, its jsonschema case skipped then
    "tests/models/test_models_gpu.py": 2,  # 2026-12-01
    "tests/models/test_tensor_parallel.py": 5,  # 2026-12-01; its NCCL test needs 2 GPUs (skips on one)
    "tests/unit/test_sampler.py": 1,
    "tests/unit/test_token_constraints.py": 1,
}
DEFAULT_S = 60  # a gpu test file not in the table yet
# Each shard's own start-up on the H200 host, beyond its files' test times: the interpreter, torch, transformers and
# pagedllm imports, collection (measured 2026-12-02: 359 s of wall time for 273 s of tests in one shard).
SHARD_OVERHEAD_S = 60
SHARD_BUDGET_S = 310  # what `plan` warns above: about half the ten-minute limit, for estimates that are off


def gpu_test_files() -> list[str]:
    """Every test_*.py under tests/ with gpu-marked tests (`pytest.mark.gpu` or `marks=pytest.mark.gpu`)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, "tests")):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__")))
        for name in sorted(filenames):
            if name.startswith("test_") and name.endswith(".py"):
                path = os.path.join(dirpath, name)
                with open(path, encoding="utf-8") as f:
                    if re.search(r"\bmark\.gpu\b", f.read()):
                        found.append(os.path.relpath(path, ROOT).replace(os.sep, "/"))
    return sorted(found)


def plan(n: int) -> list[list[str]]:
    """n shards of whole files, balanced on EXPECTED_S: longest first onto the least loaded shard."""
    if n < 1:
        raise ValueError("the number of shards must be at least 1")
    shards: list[list[str]] = [[] for _ in range(n)]
    load = [0.0] * n
    for path in sorted(gpu_test_files(), key=lambda p: (-EXPECTED_S.get(p, DEFAULT_S), p)):
        i = min(range(n), key=lambda j: (load[j], j))
        shards[i].append(path)
        load[i] += EXPECTED_S.get(path, DEFAULT_S)
    return [sorted(s) for s in shards]


def expected_s(files: list[str]) -> int:
    """Wall seconds of a shard of these files (its start-up included)."""
    return SHARD_OVERHEAD_S + sum(EXPECTED_S.get(p, DEFAULT_S) for p in files)


def parse_shard(spec: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)/(\d+)", spec.strip())
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise ValueError(f"a shard is i/N with 1 <= i <= N (e.g. 2/4), not {spec!r}")
    return int(m.group(1)), int(m.group(2))


def _counts_from_xml(path: str) -> dict[str, int] | None:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    total["passed"] = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return total


def _counts_from_log(path: str) -> dict[str, int]:
    """From `pytest -v` lines (a shard killed by its timeout writes no XML)."""
    counts = {"passed": 0, "failures": 0, "errors": 0, "skipped": 0}
    names = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failures", "ERROR": "errors", "SKIPPED": "skipped",
             "XFAIL": "skipped"}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                m = re.match(r"^\S+::\S.*? (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", line)
                if m:
                    counts[names[m.group(1)]] += 1
    except OSError:
        pass
    return counts


def _last_test(path: str) -> str:
    last = ""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                m = re.match(r"^(\S+::\S+)", line)
                if m:
                    last = m.group(1)
    except OSError:
        pass
    return last


def summary(xml: str, log: str, seconds: float, rc: int, name: str) -> str:
    """rc: pytest's exit status (0 all passed, 1 failures, 5 nothing collected), or timeout's 124 / 137."""
    counts = _counts_from_xml(xml)
    note = ""
    if rc in (124, 137):
        note = f"; stopped by its timeout in or after {_last_test(log) or 'start-up'}"
    elif counts is None:
        note = f"; no JUnit XML (pytest died?), last test {_last_test(log) or 'none'}"
    if counts is None:
        counts = _counts_from_log(log)
    clean = rc in (0, 5) and not counts["failures"] and not counts["errors"]
    return (f"shard {name}: {counts['passed']} passed, {counts['failures']} failed, {counts['skipped']} skipped, "
            f"{counts['errors']} errors in {seconds:.0f} s (rc {rc}) {'ok' if clean else 'FAILED'}{note}")


def measured(directory: str) -> dict[str, float]:
    """Seconds per test file, summed over the testcases of every JUnit XML in directory."""
    per_file: dict[str, float] = {}
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".xml"):
            continue
        try:
            root = ET.parse(os.path.join(directory, name)).getroot()
        except ET.ParseError:
            continue
        for case in root.iter("testcase"):
            path = case.get("classname", "").replace(".", "/")
            while path and not os.path.isfile(os.path.join(ROOT, path + ".py")):
                path = path.rpartition("/")[0]  # classname of a test in a class: module path + class name
            if path:
                per_file[path + ".py"] = per_file.get(path + ".py", 0.0) + float(case.get("time", 0))
    return per_file


def main(argv: list[str]) -> int:
    try:
        return _main(argv)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2


def _main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "files":
        i, n = parse_shard(argv[1])
        print("\n".join(plan(n)[i - 1]))
    elif len(argv) >= 2 and argv[0] == "plan":
        for i, files in enumerate(plan(int(argv[1])), 1):
            warn = "  (over the budget: use more shards)" if expected_s(files) > SHARD_BUDGET_S else ""
            print(f"shard {i}/{argv[1]}: ~{expected_s(files)} s{warn}: {' '.join(files)}")
    elif len(argv) >= 6 and argv[0] == "summary":
        print(summary(argv[1], argv[2], float(argv[3]), int(argv[4]), argv[5]))
    elif len(argv) >= 2 and argv[0] == "measured":
        for path, seconds in sorted(measured(argv[1]).items()):
            print(f'    "{path}": {seconds:.0f},')
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
