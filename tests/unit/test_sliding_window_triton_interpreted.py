"""Sliding-window models on the Triton attention backend, in Triton's interpreter on the CPU (the GPU versions are
tests/gpu/test_sliding_window_kernels.py and tests/gpu/test_sliding_window_engine_gpu.py)."""
from __future__ import annotations

import os

from tests.models.swa_helpers import save_swa_model
from tests.triton_interpreter import needs_triton, run_interpreted

HERE = os.path.dirname(os.path.abspath(__file__))


@needs_triton
def test_windowed_models_on_interpreted_triton_backend(tmp_path):
    """Mistral (a 32-token window on every layer) and a Qwen3 mixing sliding and full layers (two block tables):
    the Triton backend's greedy tokens equal the torch backend's on prompts past the window."""
    mistral = save_swa_model(str(tmp_path / "mistral"), "mistral", sliding_window=32)
    mixed = save_swa_model(str(tmp_path / "qwen3"), "qwen3", num_hidden_layers=3, use_sliding_window=True,
                           sliding_window=24, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    out = run_interpreted(os.path.join(HERE, "interpret_swa_engine.py"), mistral, mixed, timeout=900,
                          PAGEDLLM_FUSED_QKV="0", PAGEDLLM_DECODE_MAX_SPLITS="1")
    assert out.count("engine ok") == 2
