#!/usr/bin/env bash
# Issue 28's LoRA rows on the lent H200, in device calls (carry .whl: ../shared/device/fetch-wheels.sh):
#
#   bash benchmarks/gpu_lora.sh tests       # tests/gpu/test_lora_gpu.py, the kernels of a layer (lora_parts.py), then
#                                           # 8B batch-1 latency rank 16, fused vs not
#   bash benchmarks/gpu_lora.sh latency64   # 8B batch-1 latency rank 64, fused vs not
#   bash benchmarks/gpu_lora.sh throughput  # Qwen3-0.6B rank 16 and 64: base, 1 / 4 / 16 adapters
#   bash benchmarks/gpu_lora.sh throughput8b  # Llama-3-8B rank 16: 4 and 16 adapters (128 requests)
#   bash benchmarks/gpu_lora.sh breakdown   # Qwen3-0.6B, 256 x 512/512 greedy: device time by kernel kind, base and
#                                           # 4 adapters rank 16 (kernel_breakdown.py), then the throughput rows
#   bash benchmarks/gpu_lora.sh general     # the general kernels' GPU tests, Qwen3-0.6B throughput rank 16, the
#                                           # breakdown with 4 adapters, 8B throughput rank 16, 0.6B rank 64
#   bash benchmarks/gpu_lora.sh slots       # the general kernels' GPU tests and the engine's, Qwen3-0.6B and 8B
#                                           # throughput rank 16 (4 and 16 adapters)
#   bash benchmarks/gpu_lora.sh fold        # the o fold's GPU tests, then 8B batch-1 latency rank 16 with o_proj's
#                                           # shrink separate vs folded into the attention's reduce
#   bash benchmarks/gpu_lora.sh gemv        # the GEMV + expand GEMV tests, then 8B batch-1 latency rank 16 with the expands
#                                           # separate vs in the base GEMVs' epilogues (lora.layers.GEMV_EXPAND)
#   bash benchmarks/gpu_lora.sh normshrink  # Qwen3-0.6B / 8B throughput rank 16 with the norm computing the qkv / gate_up
#                                           # shrink up to 256 rows (the A/B of lora.layers.NORM_SHRINK_MAX_ROWS, now 8)
#   bash benchmarks/gpu_lora.sh breakdown16 # the breakdown with 16 adapters: Qwen3-0.6B, then Llama-3-8B (128 x 512/512)
#
# Each step has its own timeout; logs and JSON go to $OUT (or /tmp/lora-out), the summary lines to stdout.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
what=${1:?tests, latency64, throughput, throughput8b or breakdown}
source tests/gpu/device_prepare.sh
out=${OUT:-/tmp/lora-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
STEP_SUMMARY="batch-1|LoRA|base|chain|gemv|norm|shrink|expand|silu|regs|[ 0-9]+ adapters"
source benchmarks/gpu_step.sh
case $what in
tests)
    step tests 330 python -m pytest -m gpu -q -x -p no:cacheprovider tests/gpu/test_lora_gpu.py tests/gpu/test_small_kernels.py
    step parts 150 python benchmarks/lora_parts.py --json "$out/parts16.json"
    step latency16 330 python benchmarks/lora.py latency --model benchmarks/configs/llama3-8b --rank 16 --ab \
        --json "$out/latency16.json"
    ;;
latency64)
    step latency64 280 python benchmarks/lora.py latency --model benchmarks/configs/llama3-8b --rank 64 --ab \
        --json "$out/latency64.json"
    ;;
throughput)
    step tput16 250 python benchmarks/lora.py throughput --model benchmarks/configs/qwen3-0.6b --rank 16 \
        --json "$out/tput16.json"
    step tput64 250 python benchmarks/lora.py throughput --model benchmarks/configs/qwen3-0.6b --rank 64 \
        --json "$out/tput64.json"
    ;;
throughput8b)
    step tput8b 500 python benchmarks/lora.py throughput --model benchmarks/configs/llama3-8b --rank 16 \
        --num-adapters 4 16 --num-prompts 128 --json "$out/tput8b.json"
    ;;
slots)
    step tests 150 python -m pytest -m gpu -q -x -p no:cacheprovider tests/gpu/test_lora_gpu.py \
        -k "kernels_match or fp32_exact or graph_follow_new or engine_lora"
    step tput16 200 python benchmarks/lora.py throughput --model benchmarks/configs/qwen3-0.6b --rank 16 \
        --num-adapters 4 16 --json "$out/tput16.json"
    step tput8b 240 python benchmarks/lora.py throughput --model benchmarks/configs/llama3-8b --rank 16 \
        --num-adapters 4 16 --num-prompts 128 --json "$out/tput8b.json"
    ;;
fold)
    step fold-tests 200 python -m pytest -m gpu -q -x -p no:cacheprovider tests/gpu/test_lora_gpu.py \
        -k "output_shrink"
    step fold-latency 450 python benchmarks/lora.py latency --model benchmarks/configs/llama3-8b --rank 16 --ab-fold \
        --json "$out/fold-latency.json"
    ;;
gemv)
    step gemv-tests 200 python -m pytest -m gpu -q -x -p no:cacheprovider tests/gpu/test_lora_gpu.py \
        -k "gemv_lora or gemv_expand"
    step gemv-latency 300 python benchmarks/lora.py latency --model benchmarks/configs/llama3-8b --rank 16 --ab-gemv \
        --json "$out/gemv-latency.json"
    ;;
normshrink)
    for rows in 8 256; do
        step "tput16-ns$rows" 200 python benchmarks/lora.py throughput --model benchmarks/configs/qwen3-0.6b \
            --rank 16 --num-adapters 4 16 --norm-shrink-max-rows $rows --json "$out/tput16-ns$rows.json"
    done
    ;;
breakdown16)
    kb=(python benchmarks/kernel_breakdown.py --load-format dummy --input-len 512 --output-len 512 --temperature 0
        --max-model-len 1100 --top 40 --lora-adapters 16 --lora-rank 16)
    step kb-lora16 200 "${kb[@]}" --model benchmarks/configs/qwen3-0.6b --num-prompts 256 --max-num-seqs 256 \
        --json "$out/kb-lora16.json"
    step kb8b-lora16 240 "${kb[@]}" --model benchmarks/configs/llama3-8b --num-prompts 128 --max-num-seqs 256 \
        --json "$out/kb8b-lora16.json"
    ;;
breakdown|general)
    kb=(python benchmarks/kernel_breakdown.py --model benchmarks/configs/qwen3-0.6b --load-format dummy
        --num-prompts 256 --input-len 512 --output-len 512 --temperature 0 --max-model-len 1100 --max-num-seqs 256
        --top 40)
    if [ "$what" = general ]; then
        step tests 200 python -m pytest -m gpu -q -x -p no:cacheprovider tests/gpu/test_lora_gpu.py
        step tput16 200 python benchmarks/lora.py throughput --model benchmarks/configs/qwen3-0.6b --rank 16 \
            --num-adapters 4 16 --json "$out/tput16.json"
        step kb-lora4 240 "${kb[@]}" --lora-adapters 4 --lora-rank 16 --json "$out/kb-lora4.json"
        step tput8b 240 python benchmarks/lora.py throughput --model benchmarks/configs/llama3-8b --rank 16 \
            --num-adapters 4 16 --num-prompts 128 --json "$out/tput8b.json"
        step tput64 150 python benchmarks/lora.py throughput --model benchmarks/configs/qwen3-0.6b --rank 64 \
            --num-adapters 4 16 --json "$out/tput64.json"
    else
        step kb-base 200 "${kb[@]}" --json "$out/kb-base.json"
        step kb-lora4 240 "${kb[@]}" --lora-adapters 4 --lora-rank 16 --json "$out/kb-lora4.json"
        step tput16 200 python benchmarks/lora.py throughput --model benchmarks/configs/qwen3-0.6b --rank 16 \
            --num-adapters 4 16 --json "$out/tput16.json"
    fi
    ;;
esac
