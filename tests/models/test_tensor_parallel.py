"""Tensor parallelism for real: N gloo ranks on the CPU each load their shards and must reproduce the
single-process logits (exercises the weight loaders' slicing, kv-head replication, vocab-parallel embedding
and LM head, and the all-reduce / all-gather paths)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from pagedllm.models.loader import get_model, load_hf_config


def _logits(model_dir: str, device: str = "cpu") -> torch.Tensor:
    model = get_model(load_hf_config(model_dir), model_dir, dtype=torch.float32, device=device)
    ids = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(3)).to(device)
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(24, device=device))).cpu()


def _rank_main(rank: int, world_size: int, init_file: str, model_dir: str, out_path: str,
               backend: str = "gloo") -> None:
    from pagedllm.distributed import parallel_state as ps
    torch.set_num_threads(1)
    os.environ["PAGEDLLM_DISABLE_PROGRESS_BARS"] = "1"
    ps.init_distributed_environment(world_size, rank, f"file://{init_file}", local_rank=rank, backend=backend)
    ps.initialize_model_parallel(world_size)
    try:
        assert ps.get_tensor_model_parallel_rank() == rank
        logits = _logits(model_dir, "cpu" if backend == "gloo" else f"cuda:{rank}")
        if rank == 0:
            torch.save(logits, out_path)
    finally:
        ps.destroy_distributed_environment()


# qwen3 tp=4 > 2 kv heads: replicated; gemma3: per-head q/k norms, two ropes, Gemma norms; phi3: the fused qkv_proj /
# gate_up_proj checkpoint tensors split per rank, LongRoPE, partial rotary
@pytest.mark.parametrize("arch,tp", [("qwen2", 2), ("qwen3", 4), ("gemma3", 2), ("phi3", 2)])
def test_tensor_parallel_matches_single_rank(tmp_path, tiny_model_dir, arch, tp):
    model_dir = tiny_model_dir(arch)
    out_path = str(tmp_path / "logits.pt")
    mp.spawn(_rank_main, args=(tp, str(tmp_path / "init"), model_dir, out_path), nprocs=tp, join=True)
    torch.testing.assert_close(torch.load(out_path), _logits(model_dir), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tensor_parallel_nccl(tmp_path, tiny_model_dir):
    model_dir = tiny_model_dir("qwen3")
    out_path = str(tmp_path / "logits.pt")
    mp.spawn(_rank_main, args=(2, str(tmp_path / "init"), model_dir, out_path, "nccl"), nprocs=2, join=True)
    torch.testing.assert_close(torch.load(out_path), _logits(model_dir), atol=1e-4, rtol=1e-4)


def test_single_rank_world_is_identity():
    from pagedllm.distributed import parallel_state as ps
    assert ps.get_tensor_model_parallel_world_size() == 1 and ps.get_tensor_model_parallel_rank() == 0
    x = torch.randn(3, 4)
    assert ps.tensor_model_parallel_all_reduce(x) is x
    assert ps.tensor_model_parallel_all_gather(x) is x
