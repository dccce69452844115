#!/usr/bin/env bash
# Batch-1 decode A/Bs on the lent GPU, in device calls (carry .whl: ../shared/device/fetch-wheels.sh):
#
#   bash benchmarks/gpu_decode.sh norm-gemv-tests  # the GEMV that computes the RMSNorm before it (PAGEDLLM_NORM_GEMV):
#                                                  # its kernel tests, then the GPU engine tests with it on
#   bash benchmarks/gpu_decode.sh norm-gemv        # batch-1 decode ms/step with it off / on, alternating, one
#                                                  # process each: SmolLM2-135M and Qwen3-0.6B shapes (dummy, bf16)
#   bash benchmarks/gpu_decode.sh norm-gemv-8b     # the same for the Llama-3-8B shape
#   bash benchmarks/gpu_decode.sh decode-prep-tests  # qkv_prep's work inside the decode kernel (PAGEDLLM_DECODE_PREP):
#                                                  # its kernel tests, then the GPU engine tests with it on
#   bash benchmarks/gpu_decode.sh decode-prep      # batch-1 decode with it off / on, alternating: SmolLM2 and
#                                                  # Qwen3-0.6B (q / k norms) shapes
#   bash benchmarks/gpu_decode.sh decode-prep-8b   # the same for the Llama-3-8B shape
#
# Several modes run in order in one call: `bash benchmarks/gpu_decode.sh decode-prep-tests decode-prep`.
# Each step has its own timeout; logs and JSON go to $OUT (or /tmp/decode-out), the summary lines to stdout.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
[ $# -gt 0 ] || { echo "usage: $0 MODE... (norm-gemv-tests, norm-gemv, norm-gemv-8b, decode-prep-tests," \
    "decode-prep, decode-prep-8b)" >&2; exit 2; }
source tests/gpu/device_prepare.sh
out=${OUT:-/tmp/decode-out}
mkdir -p "$out"
STEP_SUMMARY="pagedllm: startup|hardware bound|\[verify"
source benchmarks/gpu_step.sh
ab() {  # ab NAME CONFIG TIMEOUT [SWITCH [BATCH]]: latency.py with the switch off and on, twice, alternating
    local name=$1 config=$2 limit=$3 switch=${4:-PAGEDLLM_NORM_GEMV} batch=${5:-1}
    for round in 1 2; do
        for on in 0 1; do
            export "$switch=$on"
            step "$name-$on-$round" "$limit" python benchmarks/latency.py \
                --model "benchmarks/configs/$config" --load-format dummy --dtype bfloat16 --batch-size "$batch" \
                --input-len 128 --output-len 256 --iters 3 --hf none --json "$out/$name-$on-$round.json"
        done
    done
    unset "$switch"
}
ab_verify() {  # ab_verify NAME CONFIG TIMEOUT SWITCH: a k=4 verify step vs a plain step, the switch off and on
    local name=$1 config=$2 limit=$3 switch=$4
    for round in 1 2; do
        for on in 0 1; do
            export "$switch=$on"
            step "$name-$on-$round" "$limit" python benchmarks/spec_decode.py verify \
                --model "benchmarks/configs/$config" --load-format dummy --dtype bfloat16 --k 4 --iters 3 \
                --steps 100 --json "$out/$name-$on-$round.json"
        done
    done
    unset "$switch"
}
for what in "$@"; do
case $what in
norm-gemv-tests)
    step kernels 150 python -m pytest -m gpu -q -x -p no:cacheprovider tests/gpu/test_small_kernels.py
    PAGEDLLM_NORM_GEMV=1 step engine-on 300 python -m pytest -m gpu -q -p no:cacheprovider \
        tests/gpu/test_engine_gpu.py tests/gpu/test_families_gpu.py
    ;;
norm-gemv)
    ab smollm2 smollm2-135m 90
    ab qwen3 qwen3-0.6b 100
    ;;
norm-gemv-8b)
    ab llama8b llama3-8b 140
    ;;
decode-prep-tests)
    step kernels 200 python -m pytest -m gpu -q -x -p no:cacheprovider tests/gpu/test_qkv_prep.py \
        tests/gpu/test_attention_kernels.py
    PAGEDLLM_DECODE_PREP=1 step engine-on 300 python -m pytest -m gpu -q -p no:cacheprovider \
        tests/gpu/test_engine_gpu.py tests/gpu/test_families_gpu.py tests/gpu/test_sliding_window_engine_gpu.py
    ;;
decode-prep)
    ab smollm2-prep smollm2-135m 90 PAGEDLLM_DECODE_PREP
    ab qwen3-prep qwen3-0.6b 100 PAGEDLLM_DECODE_PREP
    ;;
decode-prep-8b)
    ab llama8b-prep llama3-8b 140 PAGEDLLM_DECODE_PREP
    ;;
*)
    echo "unknown step: $what" >&2
    exit 2
    ;;
esac
done
