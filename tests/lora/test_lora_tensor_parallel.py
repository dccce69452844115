"""LoRA under tensor parallelism for real: gloo ranks on the CPU slice each adapter like its layer (column-parallel:
A whole, B's rows of this rank; row-parallel: A's columns, B whole, partial delta before the all-reduce) and must
reproduce the single-process logits of a batch mixing the base model and two adapters (Qwen3 at tp=4 also
replicates its 2 kv heads, so k/v slices of B are shared by two ranks each)."""
from __future__ import annotations

import os

import numpy as np
import torch
import torch.multiprocessing as mp

from tests.lora.lora_helpers import make_adapter

ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora_logits(model_dir: str, adapters: list[str], use_lora: bool = True) -> torch.Tensor:
    from pagedllm.lora.manager import LoRAManager
    from pagedllm.models.loader import get_model, load_hf_config

    model = get_model(load_hf_config(model_dir), model_dir, dtype=torch.float32, device="cpu")
    manager = LoRAManager(model, max_loras=2, max_lora_rank=16, max_cpu_loras=None, max_num_tokens=64,
                          device=torch.device("cpu"))
    for i, path in enumerate(adapters):
        manager.add_lora(i + 1, f"a{i}", path)
    # three "requests" of 8 tokens: base, adapter 1, adapter 2
    token_slots, sorted_ids, starts, active = manager.step_arrays([None, 1, 2] if use_lora else [None] * 3,
                                                                  np.array([8, 8, 8]))
    manager.state.load(torch.from_numpy(token_slots), torch.from_numpy(sorted_ids), torch.from_numpy(starts),
                       active=active)
    ids = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(24))).cpu()


def _rank_main(rank: int, world_size: int, init_file: str, model_dir: str, adapters: list[str], out_path: str):
    from pagedllm.distributed import parallel_state as ps

    torch.set_num_threads(1)
    os.environ["PAGEDLLM_DISABLE_PROGRESS_BARS"] = "1"
    ps.init_distributed_environment(world_size, rank, f"file://{init_file}", local_rank=rank, backend="gloo")
    ps.initialize_model_parallel(world_size)
    try:
        logits = _lora_logits(model_dir, adapters)
        if rank == 0:
            torch.save(logits, out_path)
    finally:
        ps.destroy_distributed_environment()


def test_lora_tensor_parallel_matches_single_rank(tmp_path, tiny_qwen3_dir):
    adapters = [make_adapter(tiny_qwen3_dir, str(tmp_path / "a0"), r=8, alpha=16, targets=ALL7, seed=1),
                make_adapter(tiny_qwen3_dir, str(tmp_path / "a1"), r=16, alpha=8, targets=["k_proj", "v_proj",
                                                                                          "down_proj"], seed=2,
                             use_rslora=True)]
    out_path = str(tmp_path / "logits.pt")
    mp.spawn(_rank_main, args=(4, str(tmp_path / "init"), tiny_qwen3_dir, adapters, out_path), nprocs=4, join=True)
    single = _lora_logits(tiny_qwen3_dir, adapters)
    torch.testing.assert_close(torch.load(out_path), single, atol=1e-5, rtol=1e-5)
    base = _lora_logits(tiny_qwen3_dir, adapters, use_lora=False)
    torch.testing.assert_close(single[:8], base[:8], atol=1e-5, rtol=1e-5)  # causal: the base rows come first
    assert (single[8:] - base[8:]).abs().max() > 1e-2  # the adapters change the other rows


def test_fused_module_adapter_tensor_parallel_matches_single_rank(tmp_path, tiny_model_dir):
    """Phi-3's adapters of the fused qkv_proj / gate_up_proj: split into slices when read, then sharded like them."""
    model_dir = tiny_model_dir("phi3_plain")
    adapters = [make_adapter(model_dir, str(tmp_path / "a0"), r=8, alpha=16,
                             targets=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], seed=1),
                make_adapter(model_dir, str(tmp_path / "a1"), r=4, alpha=8, targets=["qkv_proj"], seed=2)]
    out_path = str(tmp_path / "logits.pt")
    mp.spawn(_rank_main, args=(2, str(tmp_path / "init"), model_dir, adapters, out_path), nprocs=2, join=True)
    single = _lora_logits(model_dir, adapters)
    torch.testing.assert_close(torch.load(out_path), single, atol=1e-5, rtol=1e-5)
    base = _lora_logits(model_dir, adapters, use_lora=False)
    assert (single[8:] - base[8:]).abs().max() > 1e-2
