#!/usr/bin/env bash
# Issue 26's served workload on the lent H200 beside real vLLM (benchmarks/serve_vs_vllm.py), in device calls:
#
#   1. here: ../shared/device/vllm-peer.sh (-> .vpeer1..8), and .carry_srv/ = SmolLM2's tokenizer files
#      (benchmarks/api_tier_cost.py's tiny_smollm2_dir writes them); `vllm serve` (0.24) also imports three
#      packages vllm-peer.sh does not fetch: `pip download --no-deps --only-binary=:all: --python-version 3.12
#      --platform any -d .carry_v model-hosting-container-standards jmespath supervisor` (carry .carry_v with .whl);
#   2. on the device, one call per piece, back to back: mkdir -p /tmp/vc && cp .vpeerN/* /tmp/vc/
#   3. on the device: bash benchmarks/gpu_serve_peer.sh pagedllm   (carry .whl and .carry_srv; installs vLLM too)
#      then at once:  bash benchmarks/gpu_serve_peer.sh vllm
#
# Each part writes its logs and JSON as one archive under $OUT and prints the table.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
what=${1:?pagedllm or vllm}
workloads=${WORKLOADS:-"--workload 1024x256 --workload 4096x1024"}
source tests/gpu/device_prepare.sh  # (it uses $part: ours is $what)
model=/tmp/serve-model
if [ ! -f $model/config.json ]; then
    mkdir -p $model && cp benchmarks/configs/qwen3-0.6b/config.json $model/ && cp .carry_srv/* $model/
fi
source tests/gpu/vllm_install.sh
if [ -d /tmp/vsite/vllm ] && [ -d .carry_v ] && [ ! -d /tmp/vsite/model_hosting_container_standards ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vsite .carry_v/*.whl
fi
work=/tmp/serve-$what
rm -rf $work
case $what in
    pagedllm)
        timeout ${PART_TIMEOUT:-540} python3 benchmarks/serve_vs_vllm.py --model $model $workloads \
            --servers ${SERVERS:-pagedllm,pagedllm:1} --offline ${KV_BYTES:+--kv-cache-memory-bytes $KV_BYTES} --start-timeout 240 --step-timeout 150 --out $work ;;
    vllm)
        timeout ${PART_TIMEOUT:-540} python3 benchmarks/serve_vs_vllm.py --model $model $workloads --servers vllm \
            --vllm-python "env PYTHONPATH=/tmp/vsite VLLM_CACHE_ROOT=/tmp/vcache python3" --start-timeout 300 \
            --step-timeout 150 --out $work ;;
    *) echo "unknown part $what"; exit 2 ;;
esac
rc=$?
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
tar czf "$OUT/serve-$what.tgz" -C /tmp "serve-$what" 2>/dev/null
exit $rc
