"""tests/gpu/shards.py, which splits the GPU suite for tests/gpu/run_shards.sh: every gpu test file in exactly one
shard for any shard count, an estimate for each (none stale), the default six shards inside the budget, and the
summary line read from JUnit XML or, for a shard its timeout stopped, from the log."""
from __future__ import annotations

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 30])
def test_every_file_in_exactly_one_shard(n):
    shards = _shards()
    plan = shards.plan(n)
    assert len(plan) == n
    flat = [f for s in plan for f in s]
    assert sorted(flat) == shards.gpu_test_files()
    assert all(shards.main(["files", f"{i}/{n}"]) == 0 for i in (1, n))


def test_default_shards_balanced_within_budget():
    shards = _shards()
    loads = [shards.expected_s(s) for s in shards.plan(6)]
    assert max(loads) <= shards.SHARD_BUDGET_S and max(loads) - min(loads) <= max(shards.EXPECTED_S.values())
    with pytest.raises(ValueError):
        shards.parse_shard("5/4")
    assert shards.main(["files", "0/4"]) == 2


def test_summary_from_xml_and_from_a_stopped_shards_log(tmp_path):
    shards = _shards()
    xml = tmp_path / "s.xml"
    xml.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest" errors="1" failures="2" '
                   'skipped="3" tests="10" time="12.5"></testsuite></testsuites>')
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


def test_measured_seconds_per_file(tmp_path):
    shards = _shards()
    (tmp_path / "shard-1-of-2.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.gpu.test_quant_tiled" name="a" time="1.5"/>'
        '<testcase classname="tests.gpu.test_quant_tiled" name="b" time="2"/>'
        '<testcase classname="tests.unit.test_sampler" name="c" time="0.25"/></testsuite></testsuites>')
    assert shards.measured(str(tmp_path)) == {"tests/gpu/test_quant_tiled.py": 3.5, "tests/unit/test_sampler.py": 0.25}
