#!/usr/bin/env bash
# The GPU suite (`pytest -m gpu`) in shards of whole test files (tests/gpu/shards.py balances them), each in its
# own pytest process under its own timeout, so a hang ends that shard and not the run. One summary line per shard;
# JUnit XML and the full log per shard in the output directory.
#
#   bash tests/gpu/run_shards.sh                  all shards in sequence (GPU_SHARDS of them, default 6)
#   bash tests/gpu/run_shards.sh 2/4              one shard (a later command runs 3/4: shards are stable)
#   bash tests/gpu/run_shards.sh 1/4 2/4 -- -x    several; what follows -- goes to pytest
#   make test-gpu SHARD=2/4                       the same through the venv
#
# Environment: GPU_TEST_OUT  output directory (default .cache/gpu-tests): shard-<i>-of-<N>.xml/.log, summary.txt
#              GPU_SHARD_TIMEOUT  seconds per shard (default 540: inside the GPU machine's 10-minute commands)
#              GPU_RUN_BUDGET  seconds for the whole call (default none): a shard starts only with >= 120 s left
#                and gets at most what is left, so `GPU_RUN_BUDGET=570 ... 1/4 2/4 3/4 4/4` runs what fits in one
#                device command and names the shards left for the next
#              GPU_SHARDS  shard count when none is named;  PYTHON  interpreter (default python3)
#              GPU_SITE  extra site directory put on PYTHONPATH (default /tmp/site, where the device's wheels go)
# It needs no install: the project runs from src/ (PYTHONPATH), with the wheels the GPU machine lacks in GPU_SITE.
# Triton's compiled kernels are cached in .cache/triton (unless TRITON_CACHE_DIR is set), so a later shard on the
# same machine does not compile them again. Exit status: 0 when every shard ran clean, else 1.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"

python=${PYTHON:-python3}
out=${GPU_TEST_OUT:-$root/.cache/gpu-tests}
shard_timeout=${GPU_SHARD_TIMEOUT:-540}
budget=${GPU_RUN_BUDGET:-}
t0=$(date +%s)
site=${GPU_SITE:-/tmp/site}
specs=()
pytest_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --) shift; pytest_args=("$@"); break ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) specs+=("$1"); shift ;;
    esac
done
if [ ${#specs[@]} -eq 0 ]; then
    n=${GPU_SHARDS:-6}
    for i in $(seq 1 "$n"); do specs+=("$i/$n"); done
fi

pypath="$root/src:$root"
[ -d "$site" ] && pypath="$pypath:$site"
export PYTHONPATH="$pypath${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$root/.cache/triton}
mkdir -p "$out" "$TRITON_CACHE_DIR"

# The C++ CPU kernels (the CPU paths some GPU tests compare with) are built once per machine, before any shard's
# clock starts; a build failure only leaves the plain-torch CPU path (logged).
timeout 300 "$python" -c "from pagedllm.kernels.cpu_ops import cpu_ops; cpu_ops()" >"$out/cpu-kernels.log" 2>&1 \
    || echo "warning: building the CPU kernels failed or timed out (see $out/cpu-kernels.log)"

status=0
for spec in "${specs[@]}"; do
    if ! files=$("$python" tests/gpu/shards.py files "$spec"); then
        echo "shard $spec: not a shard (i/N with 1 <= i <= N)"; status=1; continue
    fi
    name=${spec/\//-of-}
    xml="$out/shard-$name.xml"
    log="$out/shard-$name.log"
    rm -f "$xml"
    if [ -z "$files" ]; then
        echo "shard $spec: no files" | tee -a "$out/summary.txt"; continue
    fi
    start=$(date +%s)
    limit=$shard_timeout
    if [ -n "$budget" ]; then
        left=$(( budget - (start - t0) ))
        if [ "$left" -lt 120 ]; then
            echo "shard $spec: not started ($left s of the run budget left)" | tee -a "$out/summary.txt"
            status=1; continue
        fi
        [ "$left" -lt "$limit" ] && limit=$left
    fi
    # SIGINT first: pytest then stops and still writes its XML; SIGKILL 20 s later for a hang in native code.
    # shellcheck disable=SC2086
    timeout -s INT -k 20 "$limit" "$python" -m pytest -m gpu -v -p no:cacheprovider --durations=10 \
        -o junit_family=xunit2 --junitxml="$xml" $files ${pytest_args[@]+"${pytest_args[@]}"} >"$log" 2>&1
    rc=$?  # 124 (137 after the KILL): its timeout stopped it
    seconds=$(( $(date +%s) - start ))
    line=$("$python" tests/gpu/shards.py summary "$xml" "$log" "$seconds" "$rc" "$spec")
    echo "$line" | tee -a "$out/summary.txt"
    case "$line" in *FAILED*) status=1 ;; esac
done
exit $status
