#!/usr/bin/env bash
# Source on the device after the vLLM wheel's pieces arrived in /tmp/vc (../shared/device/vllm-peer.sh): installs
# real vLLM into /tmp/vsite once per machine; vllm_env then runs a command with it first on the path.
if ls /tmp/vc/part_* >/dev/null 2>&1 && [ ! -d /tmp/vsite/vllm ]; then
    cat /tmp/vc/part_* > /tmp/vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vsite \
        /tmp/vllm-0.24.0-*.whl /tmp/vc/*.whl || echo "vLLM install failed"
fi
vllm_env=(env PYTHONPATH=/tmp/vsite:$PYTHONPATH VLLM_CACHE_ROOT=/tmp/vcache)
