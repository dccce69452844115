#!/usr/bin/env bash
# Issue 29's device sampler on the lent H200, in device calls (carry .whl: ../shared/device/fetch-wheels.sh):
#
#   bash benchmarks/gpu_sampling.sh tests   # its GPU tests (and the LoRA CUDA-graph test), the launch sweep, the cost
#                                           # table (sort / prefix / device at 1, 64, 256 rows)
#   bash benchmarks/gpu_sampling.sh nano    # the nano-vllm protocol at temperature 0.6: device sampler on / off,
#                                           # greedy; Qwen3's top_k 20 / top_p 0.95 on / off
#   bash benchmarks/gpu_sampling.sh all     # tests, then the nano runs of temperature 0.6 and Qwen3's sampling
#   bash benchmarks/gpu_sampling.sh small   # the kernel vs the general path at 1-128 rows; the nano runs again
#   bash benchmarks/gpu_sampling.sh split   # the split variant for few plain rows: tests, cost at 1-64 rows, 8B batch 1
#
# Each step has its own timeout; logs and JSON go to $OUT (or /tmp/sampling-out), the summary lines to stdout.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
what=${1:?tests, nano or all}
source tests/gpu/device_prepare.sh
out=${OUT:-/tmp/sampling-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
STEP_SUMMARY="llm|normal|pagedllm:|hardware"
source benchmarks/gpu_step.sh
nano() {  # nano NAME TIMEOUT ARGS...
    local name=$1 limit=$2; shift 2
    step "$name" "$limit" python benchmarks/offline_throughput.py --model benchmarks/configs/qwen3-0.6b \
        --load-format dummy --num-prompts 256 --input-len 100 1024 --output-len 100 1024 --max-model-len 2048 \
        --hf none --no-tqdm --json "$out/$name.json" "$@"
}
tests() {
    step tests 240 python -m pytest -m gpu -q -x -p no:cacheprovider tests/gpu/test_device_sampling_gpu.py \
        "tests/gpu/test_lora_gpu.py::test_few_row_kernels_in_cuda_graph_follow_new_slots"
    step sweep 60 python benchmarks/sampler_cost.py --device cuda --logits llm --rows 1,64,256 \
        --configs temp,top_p,qwen --sweep 2048x8,4096x16,8192x16,8192x32 --repeats 10 --json "$out/sweep.json"
    step cost 100 python benchmarks/sampler_cost.py --device cuda --logits llm --rows 1,64,256 \
        --impls sort,prefix,device --json "$out/cost.json"
}
case $what in
tests) tests ;;
small)  # the plain-batch threshold: temperature alone at few rows, the kernel vs the general path; nano again
    step tests 90 python -m pytest -m gpu -q -x -p no:cacheprovider tests/gpu/test_device_sampling_gpu.py
    step small 40 python benchmarks/sampler_cost.py --device cuda --logits llm --rows 1,8,32,64,128,256 \
        --configs temp,top_p,qwen --parts step --impls sort,kernel,device --json "$out/small.json"
    nano nano-t06-device-2 70 --temperature 0.6 --device-sampling on
    nano nano-qwen-device-2 60 --temperature 0.6 --top-k 20 --top-p 0.95 --device-sampling on
    nano nano-t06-general-2 50 --temperature 0.6 --device-sampling off
    nano nano-qwen-general-2 50 --temperature 0.6 --top-k 20 --top-p 0.95 --device-sampling off
    ;;
split)  # few plain rows: the split variant (device) vs one program per row (kernel) vs the general path (sort)
    step tests 150 python -m pytest -m gpu -q -x -p no:cacheprovider tests/gpu/test_device_sampling_gpu.py
    step split 60 python benchmarks/sampler_cost.py --device cuda --logits llm --rows 1,4,16,32,63,64 \
        --configs temp --parts step --impls sort,kernel,device --json "$out/split.json"
    for s in "greedy 0 auto" "t06-device 0.6 on" "t06-general 0.6 off"; do
        set -- $s
        step "lat-8b-$1" 120 python benchmarks/latency.py --model benchmarks/configs/llama3-8b --load-format dummy \
            --dtype bfloat16 --batch-size 1 --temperature "$2" --device-sampling "$3" --hf none
    done
    ;;
all)
    tests
    nano nano-t06-device 110 --temperature 0.6 --device-sampling on
    nano nano-t06-general 110 --temperature 0.6 --device-sampling off
    nano nano-qwen-device 110 --temperature 0.6 --top-k 20 --top-p 0.95 --device-sampling on
    nano nano-qwen-general 110 --temperature 0.6 --top-k 20 --top-p 0.95 --device-sampling off
    nano nano-greedy 100 --temperature 0
    ;;
nano)
    nano nano-t06-device 150 --temperature 0.6 --device-sampling on
    nano nano-t06-general 150 --temperature 0.6 --device-sampling off
    nano nano-greedy 150 --temperature 0
    nano nano-qwen-device 150 --temperature 0.6 --top-k 20 --top-p 0.95 --device-sampling on
    nano nano-qwen-general 150 --temperature 0.6 --top-k 20 --top-p 0.95 --device-sampling off
    ;;
esac
