"""GPU tests run on a CUDA machine (`pytest -m gpu tests/gpu`). Without Triton (CI, CPU-only installs) the
kernel test modules cannot even be imported, so they are not collected; the rest skip without CUDA."""
import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("triton") else [
    "test_attention_kernels.py", "test_small_kernels.py", "test_qkv_prep.py", "attention_cases.py"]
