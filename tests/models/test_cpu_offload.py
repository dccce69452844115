"""--cpu-offload-gb's layer streaming (worker/cpu_offload.py), exercised on the CPU (plain copies instead of the
GPU's side stream): offloaded layers run from the two shared slots and give exactly the resident model's logits,
step after step, whatever number of layers is offloaded."""
from __future__ import annotations

import pytest
import torch

from pagedllm.models.loader import get_model, load_hf_config
from pagedllm.worker.cpu_offload import CpuOffloader


def _model(model_dir):
    return get_model(load_hf_config(model_dir), model_dir, dtype=torch.float32, device="cpu")


def _logits(model, ids):
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(ids.shape[0])))


@pytest.mark.parametrize("num_layers", [1, 2])
def test_offloaded_layers_give_the_same_logits(tiny_qwen3_dir, num_layers):
    ref_model, model = _model(tiny_qwen3_dir), _model(tiny_qwen3_dir)
    layer = model.model.layers[0]
    layer_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    off = CpuOffloader(model, layer_bytes * num_layers + 1, torch.device("cpu"))
    assert len(off.layers) == num_layers and off.offloaded_bytes == layer_bytes * num_layers
    slot_ptrs = {t.data_ptr() for slot in off.slots for t in slot.values()}
    seen = []
    for lay in off.layers:  # during its forward (after the offloader's pre-hook) a layer's weights are a slot's
        lay.register_forward_pre_hook(lambda m, a: seen.append({p.data_ptr() for p in m.parameters()} <= slot_ptrs))
    for seed in (1, 2, 3):  # several steps: the prefetch pipeline wraps correctly
        ids = torch.randint(0, 512, (9,), generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(_logits(model, ids), _logits(ref_model, ids), atol=0, rtol=0)
    assert seen and all(seen)
    # between steps the parameters point back at their host copies
    assert all(p.data_ptr() not in slot_ptrs for lay in off.layers for p in lay.parameters())


def test_offload_smaller_than_one_layer_is_refused(tiny_qwen3_dir):
    with pytest.raises(ValueError, match="less than one decoder layer"):
        CpuOffloader(_model(tiny_qwen3_dir), 10, torch.device("cpu"))
