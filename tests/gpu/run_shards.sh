#!/usr/bin/env bash
# The GPU suite (`pytest -m gpu`) in shards of whole test files (tests/gpu/shards.py balances them), each shard under
# its own timeout, so a hang ends that shard and not the run. A shard runs in up to two steps: the files that may
# share the GPU (CONCURRENCY in shards.py) in one pytest-xdist process, GPU_TEST_WORKERS workers taking a whole file
# at a time (--dist loadfile: module fixtures stay in one process), longest first; then the others in a plain pytest
# process, alone on the GPU. One summary line per shard (its steps' counts summed); JUnit XML and the full log per step.
#
#   bash tests/gpu/run_shards.sh                  all shards in sequence (GPU_SHARDS of them; default: the fewest
#                                                 within ~6 min each with xdist workers, 2 on the H200; 6 with one)
#   bash tests/gpu/run_shards.sh 2/4              one shard (a later command runs 3/4: shards are stable)
#   bash tests/gpu/run_shards.sh 1/4 2/4 -- -x    several; what follows -- goes to pytest (to both steps)
#   make test-gpu SHARD=2/4                       the same through the venv
#   python3 tests/gpu/shards.py plan 2 8          what each of 2 shards runs with 8 workers, expected seconds
#
# The whole suite on the H200 (16 cores: 8 workers) in two device commands of one shard each, 215 s (xdist) and
# 201 s (the serial files) on 2026-12-02, where one shard per call at GPU_SHARD_TIMEOUT's 540 s fits the 10-minute limit:
#   GPU_TEST_OUT=$OUT GPU_RUN_BUDGET=570 bash tests/gpu/run_shards.sh 1/2      (carry .whl .carry_a .carry_q)
#   GPU_TEST_OUT=$OUT GPU_RUN_BUDGET=570 bash tests/gpu/run_shards.sh 2/2      (carry .carry_b .carry_q)
# On the device (no PYTHON given, not a dry run) it sources tests/gpu/device_prepare.sh first, which installs the
# carried wheels and quantizer archives. The SmolLM2 GGUF travels in two pieces, so it is whole only from the second
# command on: shard 1's GGUF tests skip (GPU_ALLOW_MISSING=1) and a third command runs them, e.g.
#   source tests/gpu/device_prepare.sh; python -m pytest -m gpu -q tests/gpu/test_smollm2_gpu.py \
#       tests/gpu/test_spec_grammar_gpu.py tests/models/test_models_gpu.py -k "smollm2 or grammar"
#
# Environment: GPU_TEST_OUT  output directory (default .cache/gpu-tests): shard-<i>-of-<N>.xml/.log (the plain
#                step), shard-<i>-of-<N>-xdist.xml/.log (the xdist step), summary.txt
#              GPU_TEST_WORKERS  xdist workers (default min(8, cores / 2)); 1 = no xdist: each shard is one plain
#                pytest process and the plan is the one of before xdist. Where pytest-xdist cannot be imported or
#                the GPU is in an exclusive compute mode, 1 with a note. The plan depends on it: keep it (and the
#                machine kind) the same for every call of one run
#              GPU_SHARD_TIMEOUT  seconds per shard, its steps together (default 540: inside the 10-minute commands)
#              GPU_RUN_BUDGET  seconds for the whole call (default none): a shard starts only with >= 120 s left
#                and gets at most what is left, so `GPU_RUN_BUDGET=570 ... 1/4 2/4 3/4 4/4` runs what fits in one
#                device command and names the shards left for the next
#              GPU_SHARDS  shard count when none is named;  PYTHON  interpreter (default python3)
#              GPU_SITE  extra site directory put on PYTHONPATH (default /tmp/site, where the device's wheels go)
#              GPU_DRY_RUN=1  print each step's command instead of running it (no build, no output files)
#              GPU_ALLOW_MISSING=1  run although `shards.py preflight` finds a package, the SmolLM2 GGUF or a quantizer
#                archive missing (otherwise: exit 3 before any shard)
# It needs no install: the project runs from src/ (PYTHONPATH), with the wheels the GPU machine lacks in GPU_SITE.
# Triton's compiled kernels are cached in .cache/triton (unless TRITON_CACHE_DIR is set), so a later shard on the
# same machine does not compile them again; concurrent workers share it (Triton writes each file under a temporary
# name and renames it into place). Exit status: 0 when every shard ran clean, else 1 (2: bad GPU_TEST_WORKERS; 3: preflight found something missing).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"

# The lent machine has no venv: its wheels, the GGUF pieces and the quantizer archives travel with the call.
if [ -z "${PYTHON:-}" ] && [ "${GPU_DRY_RUN:-0}" = 0 ]; then
    source tests/gpu/device_prepare.sh
fi
python=${PYTHON:-python3}
out=${GPU_TEST_OUT:-$root/.cache/gpu-tests}
shard_timeout=${GPU_SHARD_TIMEOUT:-540}
budget=${GPU_RUN_BUDGET:-}
dry=${GPU_DRY_RUN:-}
[ "$dry" = 0 ] && dry=
t0=$(date +%s)
site=${GPU_SITE:-/tmp/site}
specs=()
pytest_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --) shift; pytest_args=("$@"); break ;;
        -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0"; exit 0 ;;  # the header above
        *) specs+=("$1"); shift ;;
    esac
done

pypath="$root/src:$root"
[ -d "$site" ] && pypath="$pypath:$site"
export PYTHONPATH="$pypath${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$root/.cache/triton}
# Where tests/conftest.py has every pytest process load the CPU kernels from, so the build below is the one they use.
export PAGEDLLM_KERNEL_CACHE_DIR=${PAGEDLLM_KERNEL_CACHE_DIR:-$root/.cache/pagedllm-kernels}

# Workers and the xdist option that keeps shards.py's file order (pytest-xdist >= 3.8); a note where it falls back.
workers_line=$("$python" tests/gpu/shards.py workers) || exit 2
read -r workers keep_order <<<"$workers_line"
if [ "$workers" -gt 1 ] && command -v nvidia-smi >/dev/null 2>&1 \
        && nvidia-smi --query-gpu=compute_mode --format=csv,noheader 2>/dev/null | grep -qi exclusive; then
    echo "note: the GPU takes one process at a time (exclusive compute mode), so every file runs serially"
    workers=1
    keep_order=
fi
if [ ${#specs[@]} -eq 0 ]; then
    n=${GPU_SHARDS:-$("$python" tests/gpu/shards.py default-shards "$workers")}
    for i in $(seq 1 "$n"); do specs+=("$i/$n"); done
fi
cores=$(nproc 2>/dev/null || echo 1)

record() {
    if [ -n "$dry" ]; then echo "$1"; else echo "$1" | tee -a "$out/summary.txt"; fi
}

if [ -n "$dry" ]; then
    echo "dry run: $workers worker(s)${keep_order:+ ($keep_order)}, shards ${specs[*]}"
else
    mkdir -p "$out" "$TRITON_CACHE_DIR"
    # A machine without the wheels, the model or the quantizer archives would fail hundreds of tests for it, after
    # minutes: stop here instead (GPU_ALLOW_MISSING=1 runs anyway).
    if ! missing=$("$python" tests/gpu/shards.py preflight) && [ "${GPU_ALLOW_MISSING:-0}" != 1 ]; then
        echo "$missing" | tee "$out/summary.txt"
        echo "not running: carry what is missing (tests/gpu/device_prepare.sh says how), or GPU_ALLOW_MISSING=1" \
            | tee -a "$out/summary.txt"
        exit 3
    fi
    # The C++ CPU kernels (the CPU paths some GPU tests compare with) are built once per machine, before any
    # shard's clock starts; a build failure only leaves the plain-torch CPU path (logged).
    timeout 300 "$python" -c "from pagedllm.kernels.cpu_ops import cpu_ops; cpu_ops()" >"$out/cpu-kernels.log" 2>&1 \
        || echo "warning: building the CPU kernels failed or timed out (see $out/cpu-kernels.log)"
fi

status=0
for spec in "${specs[@]}"; do
    if ! plan=$("$python" tests/gpu/shards.py steps "$spec" "$workers"); then
        echo "shard $spec: not a shard (i/N with 1 <= i <= N)"; status=1; continue
    fi
    name=${spec/\//-of-}
    [ -z "$dry" ] && rm -f "$out/shard-$name.xml" "$out/shard-$name-xdist.xml"
    if [ -z "$plan" ]; then
        record "shard $spec: no files"; continue
    fi
    start=$(date +%s)
    limit=$shard_timeout
    if [ -n "$budget" ]; then
        left=$(( budget - (start - t0) ))
        if [ "$left" -lt 120 ]; then
            record "shard $spec: not started ($left s of the run budget left)"
            status=1; continue
        fi
        [ "$left" -lt "$limit" ] && limit=$left
    fi
    mapfile -t step_lines <<<"$plan"
    parts=()  # JUnit XML, log, rc ("-": not started) per step
    for step in "${step_lines[@]}"; do
        read -r kind rest <<<"$step"
        opts=()
        run_env=()
        suffix=
        files=$rest
        if [ "$kind" = xdist ]; then
            procs=${rest%% *}
            files=${rest#* }
            suffix=-xdist
            opts=(-n "$procs" --dist loadfile ${keep_order:+"$keep_order"})
            # torch's CPU thread pool (the tests' CPU references) takes every core by default: share them out.
            threads=$(( cores / procs > 0 ? cores / procs : 1 ))
            run_env=(env "OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads}")
        fi
        xml="$out/shard-$name$suffix.xml"
        log="$out/shard-$name$suffix.log"
        left=$(( limit - ($(date +%s) - start) ))  # what the shard's earlier step left of its time
        if [ "$left" -lt 1 ]; then
            parts+=("$xml" "$log" -); continue
        fi
        # SIGINT first: pytest (and xdist's workers, in timeout's process group) then stop and still write the XML;
        # SIGKILL 20 s later for a hang in native code.
        # shellcheck disable=SC2086
        cmd=(${run_env[@]+"${run_env[@]}"} timeout -s INT -k 20 "$left" "$python" -m pytest -m gpu -v
             -p no:cacheprovider --durations=10 -o junit_family=xunit2 --junitxml="$xml" ${opts[@]+"${opts[@]}"}
             $files ${pytest_args[@]+"${pytest_args[@]}"})
        if [ -n "$dry" ]; then
            printf -v shown '%q ' "${cmd[@]}"
            echo "shard $spec $kind: ${shown% }"; continue
        fi
        "${cmd[@]}" >"$log" 2>&1 </dev/null
        parts+=("$xml" "$log" "$?")  # rc 124 (137 after the KILL): its timeout stopped it
    done
    [ -n "$dry" ] && continue
    seconds=$(( $(date +%s) - start ))
    line=$("$python" tests/gpu/shards.py summary "${parts[0]}" "${parts[1]}" "$seconds" "${parts[2]}" "$spec" \
           "${parts[@]:3}")
    record "$line"
    case "$line" in *FAILED*) status=1 ;; esac
done
exit $status
