#!/usr/bin/env bash
# Issue 27's int4 rows on the lent H200, in device calls (carry .whl: ../shared/device/fetch-wheels.sh):
#
#   bash benchmarks/gpu_int4.sh mma       # the tensor-core GEMV (benchmarks/qgemv_mma.py: checks, vs bf16 / tiled; its tests)
#   bash benchmarks/gpu_int4.sh sweep     # its launch variants per 8B layer at 1, 16, 32 and 64 rows (no checks)
#   bash benchmarks/gpu_int4.sh kernels   # per-layer kernels (quant.py)
#   bash benchmarks/gpu_int4.sh tests     # the quantization GPU tests (tiled kernels, library checkpoints)
#   bash benchmarks/gpu_int4.sh e2e       # 8B decode (latency.py) at batch 1 and 16: bf16, GPTQ int4, AWQ int4
#   bash benchmarks/gpu_int4.sh e2e-wide  # 8B decode at batch 64 and 32: bf16, GPTQ int4 (the GEMV's 4 and 8 row tiles)
#   bash benchmarks/gpu_int4.sh table     # the GEMV per 8B layer at 1, 16, 32 and 64 rows and its GPU tests, no checks
#   bash benchmarks/gpu_int4.sh int8      # W8A8 INT8 (and the FP8 activation quantization): GPU tests, the GEMM's
#                                         # launch sweep at 64 and 256 rows, the per-layer table against bf16
#   bash benchmarks/gpu_int4.sh int8-e2e  # 8B decode at batch 64 and 1: W8A8 INT8 (compressed-tensors config) vs bf16
#   bash benchmarks/gpu_int4.sh w8a8      # INT8 and FP8 W8A8 GEMMs: GPU tests, few-row sweeps, per-layer table
#   bash benchmarks/gpu_int4.sh w8a8-e2e  # 8B decode at batch 64 and 1: W8A8 INT8, FP8 (online) and bf16
#   bash benchmarks/gpu_int4.sh w8a8-words # the int8 GEMV on int32 words (dp4a): GPU tests, one row per layer
#   bash benchmarks/gpu_int4.sh breakdown # where the 8B offline run's device time goes (kernel_breakdown.py): bf16, FP8
#   bash benchmarks/gpu_int4.sh int8-wide # INT8 W8A8: GPU tests, the words GEMV's rows, the tiles' sweep at 256 and
#                                         # 1024 rows (wider tiles), 8B decode at batch 1 and 4
#   bash benchmarks/gpu_int4.sh w8a8-tput # 8B offline 1000 x 512 in / 256 out, temperature 0.8: bf16, FP8, INT8 W8A8
#   bash benchmarks/gpu_int4.sh fp8read   # the E4M3 cache's reads (FP8_READS: fp16 fp16-vw bf16): the FP8
#                                         # kernel tests with each, the tile sweep of each, the nano breakdown (default)
#   bash benchmarks/gpu_int4.sh nano-vw   # nano end to end: E4M3 with V read as 32-bit words, E4M3, bf16 cache
#                                         # (FP8_BREAKDOWN=0 skips fp8read's nano breakdown)
#   bash benchmarks/gpu_int4.sh fp8kv     # the FP8 KV cache's decode kernel: the tile sweep at the Qwen3-0.6B heads
#                                         # (E4M3 and bf16 caches), then the nano protocol's kernels by kind, both caches
#
# Several modes in one call run in order: `bash benchmarks/gpu_int4.sh sweep mma e2e`.
# Each step has its own timeout; logs go to $OUT (or /tmp/int4-out) and the summary lines to stdout.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
[ $# -gt 0 ] || { echo "usage: gpu_int4.sh MODE..." >&2; exit 2; }
source tests/gpu/device_prepare.sh
out=${OUT:-/tmp/int4-out}
mkdir -p "$out"
STEP_SUMMARY="Throughput|one layer|sweep one|best|check.*BAD|correctness|qkv|o |gate_up|down|pagedllm:|hardware|Avg latency"
source benchmarks/gpu_step.sh
lat() {  # lat NAME CONFIG DTYPE BATCH [latency.py options]
    step "lat-$1-b$4" 170 python benchmarks/latency.py --model "benchmarks/configs/$2" --load-format dummy --dtype "$3" \
        --batch-size "$4" --input-len 128 --output-len 256 --hf none "${@:5}"
}
for what in "$@"; do
case $what in
mma)
    step mma 330 python benchmarks/qgemv_mma.py --rows 1 2 4 8 16 32 64 256
    step mma-tests 200 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_qgemv_mma_gpu.py
    ;;
sweep)
    step sweep 420 python benchmarks/qgemv_mma.py --no-check --sweep 1 16 32 64
    ;;
kernels)
    step layers 240 python benchmarks/quant.py --model 8b --rows 1 2 4 16 64
    ;;
tests)
    step tests 240 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_quant_tiled.py tests/gpu/test_quant_gpu.py
    ;;
e2e)
    for b in 1 16; do
        lat bf16 llama3-8b bfloat16 $b
        lat gptq llama3-8b-gptq-int4 bfloat16 $b
    done
    lat awq llama3-8b-awq-int4 float16 1
    ;;
e2e-wide)
    for b in 64 32; do
        lat gptq llama3-8b-gptq-int4 bfloat16 $b
        lat bf16 llama3-8b bfloat16 $b
    done
    ;;
int8)
    step int8-tests 240 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_int8_w8a8_gpu.py \
        tests/gpu/test_quant_act.py
    step int8-sweep 240 python benchmarks/quant.py --model 8b --sweep int8 --rows 64 256
    step int8-table 150 python benchmarks/quant.py --model 8b --kinds bf16 w8a8 w8a8-torch fp8 --rows 1 16 64 256 1024
    ;;
w8a8)  # both 8-bit GEMMs (INT8, FP8): GPU tests, few-row launch sweeps, the per-layer table with both FP8 GEMMs
    step w8a8-tests 240 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_int8_w8a8_gpu.py \
        tests/gpu/test_quant_act.py
    step w8a8-sweep-int8 150 python benchmarks/quant.py --model 8b --sweep int8 --rows 1 16
    step w8a8-sweep-fp8 200 python benchmarks/quant.py --model 8b --sweep fp8 --rows 1 16 64
    step w8a8-table 150 python benchmarks/quant.py --model 8b --kinds bf16 w8a8 fp8 fp8-triton fp8-scaled-mm \
        --rows 1 16 64 128 256 1024
    ;;
w8a8-words)  # the int8 GEMV on int32 words (dp4a): its GPU tests, then one row per layer against the byte GEMV
    step words-tests 240 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_int8_w8a8_gpu.py
    step words-table 120 python benchmarks/quant.py --model 8b --kinds bf16 w8a8-gemv w8a8-words fp8-gemv --rows 1 2
    ;;
w8a8-tput)  # issue 27's throughput row: 8B offline, 1000 x 512 in / 256 out at temperature 0.8
    tput() {  # tput NAME CONFIG [offline_throughput.py options]
        step "tput-$1" 200 python benchmarks/offline_throughput.py --model "benchmarks/configs/$2" --load-format dummy \
            --dtype bfloat16 --num-prompts 1000 --input-len 512 512 --output-len 256 256 --temperature 0.8 --hf none \
            --no-tqdm "${@:3}"
    }
    tput fp8 llama3-8b --quantization fp8
    tput bf16 llama3-8b
    tput w8a8 llama3-8b-w8a8-int8
    ;;
fp8kv)  # issue 27's FP8 KV row: the decode kernel is most of a nano run's device time
    for kv in fp8 auto; do
        step "attn-sweep-$kv" 200 python benchmarks/kernels_attention.py --gqa-sweep 16/8 --batches 64 256 --ctx 768 \
            --kv-dtype $kv
        grep "\*" "$out/attn-sweep-$kv.log" | head -8
    done
    for kv in fp8 auto; do
        step "nano-kb-$kv" 240 python benchmarks/kernel_breakdown.py --model benchmarks/configs/qwen3-0.6b \
            --load-format dummy --num-prompts 256 --input-len 100 1024 --output-len 100 1024 --temperature 0.6 \
            --max-model-len 2048 --kv-cache-dtype $kv --top 25 --json "$out/nano-kb-$kv.json"
        grep -A12 "^== all" "$out/nano-kb-$kv.log"
    done
    ;;
fp8read)  # how the kernels read an E4M3 cache: the FP8 tests with each read, the sweep of each, the nano breakdown
    for read in ${FP8_TEST_READS:-fp16,False fp16,True}; do  # compute,V words
        set -- ${read//,/ }
        step "fp8-tests-$1-vw$2" 150 python -c "import sys, pytest; import pagedllm.kernels.paged_attention as p
p.FP8_KV_COMPUTE, p.FP8_V_WORDS = '$1', $2
sys.exit(pytest.main(['-m', 'gpu', '-q', '-p', 'no:cacheprovider', 'tests/gpu/test_kv_fp8_kernels.py',
                      'tests/gpu/test_qkv_prep.py', '-k', 'fp8 or kv_scales']))"
    done
    step fp8-read-sweep 240 python benchmarks/kernels_attention.py --gqa-sweep 16/8 --batches 64 256 --ctx 768 \
        --kv-dtype fp8 --quick --fp8-read ${FP8_READS:-fp16 fp16-vw}
    grep -E "^#|\*" "$out/fp8-read-sweep.log"
    [ "${FP8_BREAKDOWN:-1}" = 1 ] || continue
    step nano-kb-fp8 150 python benchmarks/kernel_breakdown.py --model benchmarks/configs/qwen3-0.6b \
        --load-format dummy --num-prompts 256 --input-len 100 1024 --output-len 100 1024 --temperature 0.6 \
        --max-model-len 2048 --kv-cache-dtype fp8 --top 25 --json "$out/nano-kb-fp8.json"
    grep -A4 "^== all" "$out/nano-kb-fp8.log"
    ;;
nano-kv)  # the nano protocol end to end, E4M3 vs bf16 cache (offline_throughput.py, 256 requests, 100..1024 in/out)
    for kv in fp8 auto; do
        step "nano-$kv" 200 python benchmarks/offline_throughput.py --model benchmarks/configs/qwen3-0.6b \
            --load-format dummy --dtype bfloat16 --num-prompts 256 --input-len 100 1024 --output-len 100 1024 \
            --temperature 0.6 --hf none --kv-cache-dtype $kv
    done
    ;;
nano-vw)  # the nano protocol end to end: E4M3 with V read as words (paged_attention.FP8_V_WORDS), E4M3, bf16
    for kv in fp8-vw fp8 auto; do
        step "nano-$kv" 200 python -c "import runpy, sys; import pagedllm.kernels.paged_attention as p
p.FP8_V_WORDS = '$kv' == 'fp8-vw'
sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')" benchmarks/offline_throughput.py \
            --model benchmarks/configs/qwen3-0.6b --load-format dummy --dtype bfloat16 --num-prompts 256 \
            --input-len 100 1024 --output-len 100 1024 --temperature 0.6 --hf none --kv-cache-dtype ${kv%-vw}
    done
    ;;
breakdown)  # kernel time by kind, 8B 250 x 512 in / 256 out at temperature 0.8: FP8 and bf16 (logs: the whole table)
    for q in fp8 none; do
        qa=(); [ $q = none ] || qa=(--quantization $q)
        step "breakdown-$q" 240 python benchmarks/kernel_breakdown.py --model benchmarks/configs/llama3-8b \
            --load-format dummy --num-prompts 250 --input-len 512 --output-len 256 --temperature 0.8 --top 40 \
            --json "$out/breakdown-$q.json" "${qa[@]}"
        sed -n '/^wall/,$p' "$out/breakdown-$q.log" | head -60
    done
    ;;
int8-wide)
    step int8w-tests 240 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_int8_w8a8_gpu.py
    step int8w-table 90 python benchmarks/quant.py --model 8b --kinds bf16 w8a8 w8a8-tiles --rows 1 2 4 5
    step int8w-sweep 220 python benchmarks/quant.py --model 8b --sweep int8 --rows 256 1024
    lat w8a8 llama3-8b-w8a8-int8 bfloat16 1
    lat w8a8 llama3-8b-w8a8-int8 bfloat16 4
    ;;
w8a8-e2e)  # 8B decode at batch 64 and 1: W8A8 INT8 (compressed-tensors) and FP8 (online) against bf16
    for b in 64 1; do
        lat w8a8 llama3-8b-w8a8-int8 bfloat16 $b
        lat fp8 llama3-8b bfloat16 $b --quantization fp8
        lat bf16 llama3-8b bfloat16 $b
    done
    ;;
int8-e2e)  # 8B decode with compressed-tensors W8A8 INT8 (dummy weights) against bf16
    for b in 64 1; do
        lat w8a8 llama3-8b-w8a8-int8 bfloat16 $b
        lat bf16 llama3-8b bfloat16 $b
    done
    ;;
table)
    step mma-tests 200 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_qgemv_mma_gpu.py
    step table 200 python benchmarks/qgemv_mma.py --no-check --rows 1 16 32 64
    ;;
*) echo "unknown mode $what" >&2; exit 2 ;;
esac
done
