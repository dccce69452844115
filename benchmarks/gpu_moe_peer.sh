#!/usr/bin/env bash
# Issue 30's speed rows on the lent H200 beside real vLLM, in device calls (each step under its own timeout, its log
# and JSON under $OUT, a failed step recorded and the rest run):
#
#   1. here: ../shared/device/vllm-peer.sh (-> .vpeer1..8); on the device one call per piece, back to back, each
#      carrying only that folder: mkdir -p /tmp/vc && cp .vpeerN/* /tmp/vc/
#   2. on the device (carry .whl; the first call installs vLLM from /tmp/vc into /tmp/vsite):
#        bash benchmarks/gpu_moe_peer.sh STEP [STEP ...]
#
# Steps:
#   kernel-SHAPE          benchmarks/moe.py kernel --peer vllm (SHAPE: qwen3-30b-a3b, mixtral-8x7b)
#   rows-CONFIG-ENGINE    benchmarks/moe.py rows (batch-1 decode + 512 x 512/256 at temperature 0.6, one engine start)
#                         CONFIG: a dir under benchmarks/configs; ENGINE: pagedllm or vllm
#   nano-CONFIG-ENGINE    offline_throughput.py's nano-vllm protocol (256 prompts, 100..1024 in / out, temperature 0.6)
#   serve                 issue 26's 1024x256 and 4096x1024 rows of pagedllm serve (carry .carry_srv too)
#   rowsold-CONFIG        rows of pagedllm from the tree in .old (carried; git archive COMMIT src benchmarks)
#   nanoold-CONFIG        the nano protocol from the tree in .old (A/B: alternate with nano-CONFIG-pagedllm)
#   sampler-ab            benchmarks/sample_split_ab.py: the sampler at 32-512 rows, bf16 vs float32 logits, split or not
#   profile-CONFIG-BATCH  profile_step.py: a decode step at BATCH running requests, kernels by device time
#   prefill-CONFIG        profile_step.py --prefill: one full prefill step of 64 prompts
#   timeline-CONFIG       step_timeline.py on rows' 512 x 512/256 at temperature 0.6 (time per step kind)
#   timelineN-CONFIG      step_timeline.py with N requests of 128 in / 256 out running at once (device idle per step)
#   timelinenano-CONFIG   step_timeline.py on the nano protocol's workload (device time and idle per running-count bucket)
#   idleN-CONFIG          device_idle.py at N running (128 in, temperature 0.6) under the profiler: idle gaps, the host's
#                         CUDA calls and the ops around long ones; its trace in $OUT (idleN-CONFIG-stack: Python stacks)
#   sweep-SHAPE           benchmarks/moe.py kernel --sweep at 1 token (the GEMV tiles)
#   layer-SHAPE           benchmarks/moe.py kernel --torch-grouped at 1-16384 tokens (LAYER_TOKENS; no peer)
#   check                 tests/gpu/test_fused_moe_gpu.py's kernel tests, then benchmarks/moe_variants/ab.py's A/Bs
# STEP_TIMEOUT (s, default 300) bounds each step.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
source tests/gpu/device_prepare.sh
source tests/gpu/vllm_install.sh
out=${OUT:-/tmp/out}
mkdir -p "$out"
status=0
for step in "$@"; do
    log="$out/$step.log"
    t0=$(date +%s)
    echo "=== $step ($(date -u +%H:%M:%S))" | tee -a "$out/steps.txt"
    case $step in
        kernel-*)
            cmd=("${vllm_env[@]}" python3 benchmarks/moe.py kernel --shape "${step#kernel-}" --peer vllm
                 --tokens 1 2 4 8 16 64 256 1024 4096 --json "$out/$step.json") ;;
        rows-*|nano-*)
            rest=${step#*-}; engine=${rest##*-}; config=benchmarks/configs/${rest%-*}
            env_=(env); [ "$engine" = vllm ] && env_=("${vllm_env[@]}")
            if [ "${step%%-*}" = rows ]; then
                cmd=("${env_[@]}" python3 benchmarks/moe.py rows --model "$config" --engine "$engine"
                     --json "$out/$step.json")
            else
                cmd=("${env_[@]}" python3 benchmarks/offline_throughput.py --model "$config" --load-format dummy
                     --dtype bfloat16 --num-prompts 256 --input-len 100 1024 --output-len 100 1024
                     --max-model-len 2048 --temperature 0.6 --hf none --no-tqdm --engine "$engine"
                     --json "$out/$step.json")
            fi ;;
        rowsold-*)  # the same rows from an older tree carried in .old (git archive COMMIT src benchmarks), for
                    # an A/B against it in one lease: alternate rowsold-CONFIG and rows-CONFIG-pagedllm
            cmd=(env PYTHONPATH="$root/.old/src:$GPU_SITE" python3 .old/benchmarks/moe.py rows
                 --model "benchmarks/configs/${step#rowsold-}" --engine pagedllm --json "$out/$step.json") ;;
        nanoold-*)
            cmd=(env PYTHONPATH="$root/.old/src:$GPU_SITE" python3 .old/benchmarks/offline_throughput.py
                 --model "benchmarks/configs/${step#nanoold-}" --load-format dummy --dtype bfloat16 --num-prompts 256
                 --input-len 100 1024 --output-len 100 1024 --max-model-len 2048 --temperature 0.6 --hf none --no-tqdm
                 --engine pagedllm --json "$out/$step.json") ;;
        sampler-ab)
            cmd=(python3 benchmarks/sample_split_ab.py) ;;
        profile-*)
            rest=${step#profile-}; batch=${rest##*-}; config=benchmarks/configs/${rest%-*}
            cmd=(python3 benchmarks/profile_step.py --model "$config" --load-format dummy --batch "$batch"
                 --input-len $([ "$batch" -le 8 ] && echo 128 || echo 512) --steps 20) ;;
        prefill-*)
            cmd=(python3 benchmarks/profile_step.py --model "benchmarks/configs/${step#prefill-}" --load-format dummy
                 --batch 64 --prefill) ;;
        timelinenano-*)
            cmd=(python3 benchmarks/step_timeline.py --model "benchmarks/configs/${step#timelinenano-}" --load-format dummy
                 --num-prompts 256 --input-len 100 1024 --output-len 100 1024 --max-model-len 2048 --temperature 0.6
                 --emit final_only --json "$out/$step.json") ;;
        idle[0-9]*-*)
            rest=${step#idle}; n=${rest%%-*}; config=${rest#*-}; stack=()
            [ "${config%-stack}" != "$config" ] && { config=${config%-stack}; stack=(--with-stack); }
            cmd=(python3 benchmarks/device_idle.py --model "benchmarks/configs/$config" --load-format dummy --batch "$n"
                 --input-len 128 --temperature 0.6 --steps 8 "${stack[@]}" --trace "$out/$step.json.gz") ;;
        timeline[0-9]*-*)  # issue 29: N requests running at once (all admitted together), device idle per step
            rest=${step#timeline}; n=${rest%%-*}
            cmd=(python3 benchmarks/step_timeline.py --model "benchmarks/configs/${rest#*-}" --load-format dummy
                 --num-prompts "$n" --input-len 128 128 --output-len 256 256 --max-num-seqs "$n"
                 --max-model-len 400 --temperature 0.6 --json "$out/$step.json") ;;
        timeline-*)
            cmd=(python3 benchmarks/step_timeline.py --model "benchmarks/configs/${step#timeline-}" --load-format dummy
                 --num-prompts 512 --input-len 512 512 --output-len 256 256 --max-num-seqs 512 --max-model-len 800
                 --temperature 0.6 --json "$out/$step.json") ;;
        sweep-*)
            cmd=(python3 benchmarks/moe.py kernel --shape "${step#sweep-}" --tokens 1 --sweep --json "$out/$step.json") ;;
        layer-*)
            cmd=(python3 benchmarks/moe.py kernel --shape "${step#layer-}" --torch-grouped
                 --tokens ${LAYER_TOKENS:-1 2 4 8 16 64 256 512 1024 4096 16384} --json "$out/$step.json") ;;
        check)  # the few-token MoE kernels' GPU tests, then their A/Bs (fenced vs loops; the router in the norm)
            cmd=(bash -c "python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_fused_moe_gpu.py \
                 -k 'fenced or router or routed or real_layer or matches_reference or cuda_graph or fp32'
                 for a in '--shape qwen3-30b-a3b --tokens 1 2' '--shape mixtral-tp8 --tokens 1 2' \
                          '--shape mixtral-8x7b --tokens 1' '--norm-router --shape qwen3-30b-a3b --tokens 1 2 8'; do
                     python3 benchmarks/moe_variants/ab.py \$a; done") ;;
        serve)
            cmd=(env OUT="$out" WORKLOADS="--workload 1024x256 --workload 4096x1024" SERVERS=pagedllm
                 KV_BYTES=42949672960 PART_TIMEOUT=$(( ${STEP_TIMEOUT:-300} - 10 ))
                 bash benchmarks/gpu_serve_peer.sh pagedllm) ;;
        *) echo "unknown step $step" | tee -a "$out/steps.txt"; status=2; continue ;;
    esac
    timeout -k 10 "${STEP_TIMEOUT:-300}" "${cmd[@]}" > "$log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && status=1
    echo "=== $step rc=$rc in $(( $(date +%s) - t0 )) s" | tee -a "$out/steps.txt"
    grep -E "ms/step|tok/s|T=|passed|failed|Error|error:|^rows " "$log" | grep -v "^INFO" | tail -25
    # a killed engine may leave its workers: nothing of one step may hold the GPU for the next
    pkill -f "benchmarks/(moe|offline_throughput|serve_vs_vllm|profile_step|step_timeline).py" 2>/dev/null; pkill -f "vllm serve" 2>/dev/null
    pkill -f "pagedllm serve" 2>/dev/null; pkill -f EngineCore 2>/dev/null; sleep 1
done
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
exit $status
