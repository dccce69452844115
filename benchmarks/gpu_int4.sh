#!/usr/bin/env bash
# Issue 27's int4 rows on the lent H200, in device calls (carry .whl: ../shared/device/fetch-wheels.sh):
#
#   bash benchmarks/gpu_int4.sh mma       # the tensor-core GEMV (benchmarks/qgemv_mma.py: checks, sweep, vs bf16 / tiled; its tests)
#   bash benchmarks/gpu_int4.sh kernels   # per-layer kernels (quant.py)
#   bash benchmarks/gpu_int4.sh tests     # the quantization GPU tests (tiled kernels, library checkpoints)
#   bash benchmarks/gpu_int4.sh e2e       # 8B batch-1 decode (latency.py): bf16, GPTQ int4, AWQ int4
#
# Each step has its own timeout; logs go to $OUT (or /tmp/int4-out) and the summary lines to stdout.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
what=${1:?kernels or e2e}
source tests/gpu/device_prepare.sh
out=${OUT:-/tmp/int4-out}
mkdir -p "$out"
STEP_SUMMARY="one layer|best|check.*BAD|correctness|qkv|o |gate_up|down|pagedllm:|  [a-z_]+ +rows=1 mma|hardware"
source benchmarks/gpu_step.sh
lat() {  # lat NAME CONFIG DTYPE
    step "lat-$1" 170 python benchmarks/latency.py --model "benchmarks/configs/$2" --load-format dummy --dtype "$3" \
        --batch-size 1 --input-len 128 --output-len 256 --hf none
}
case $what in
mma)
    step mma 330 python benchmarks/qgemv_mma.py ${SWEEP:+--sweep}
    step mma-tests 200 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_qgemv_mma_gpu.py
    ;;
kernels)
    step layers 240 python benchmarks/quant.py --model 8b --rows 1 2 4 16 64
    ;;
tests)
    step tests 240 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_quant_tiled.py tests/gpu/test_quant_gpu.py
    ;;
e2e)
    lat bf16 llama3-8b bfloat16
    lat gptq llama3-8b-gptq-int4 bfloat16
    lat awq llama3-8b-awq-int4 float16
    ;;
esac
