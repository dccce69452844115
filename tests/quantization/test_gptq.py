"""GPTQ checkpoints packed by AutoGPTQ's own QuantLinear.pack: our loader + CPU path reproduce the library's
dequantized model (transformers with those weights) and its greedy tokens."""
from __future__ import annotations

import pytest
import torch

from pagedllm.models.loader import load_model
from tests.quantization.checkpoints import gptq_checkpoint

PROMPT = torch.randint(2, 512, (40,), generator=torch.Generator().manual_seed(5))


def _ours_vs_reference(model_dir, reference):
    ours, _, _ = load_model(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        got = ours.compute_logits(ours(PROMPT, torch.arange(len(PROMPT))))
        want = reference(PROMPT[None]).logits[0]
    return ours, got, want


@pytest.mark.parametrize("arch,bits,group_size,desc_act,sym", [
    ("llama", 4, 32, False, True),
    ("qwen3", 4, 32, True, False),   # act-order with g_idx, asymmetric
    ("qwen2", 8, -1, False, False),  # one group per channel, qkv bias
])
def test_gptq_logits_match_library_dequantized_reference(tmp_path, tiny_model_dir, arch, bits, group_size,
                                                         desc_act, sym):
    model_dir, reference = gptq_checkpoint(tiny_model_dir(arch), str(tmp_path / "gptq"), bits, group_size,
                                           desc_act, sym)
    ours, got, want = _ours_vs_reference(model_dir, reference)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    layer = ours.model.layers[0].self_attn.qkv_proj
    assert type(layer.linear_method).__name__ == "GPTQLinearMethod"
    assert (layer.g_idx is not None) == desc_act


def _rank_main(rank: int, world_size: int, init_file: str, model_dir: str, out_path: str) -> None:
    import os

    from pagedllm.distributed import parallel_state as ps
    torch.set_num_threads(1)
    os.environ["PAGEDLLM_DISABLE_PROGRESS_BARS"] = "1"
    ps.init_distributed_environment(world_size, rank, f"file://{init_file}", local_rank=rank, backend="gloo")
    ps.initialize_model_parallel(world_size)
    try:
        model, _, _ = load_model(model_dir, dtype=torch.float32)
        with torch.inference_mode():
            logits = model.compute_logits(model(PROMPT, torch.arange(len(PROMPT))))
        if rank == 0:
            torch.save(logits, out_path)
    finally:
        ps.destroy_distributed_environment()


@pytest.mark.parametrize("desc_act", [True, False])  # True: scales replicated, g_idx split; False: groups split
def test_gptq_tensor_parallel_matches_reference(tmp_path, tiny_model_dir, desc_act):
    import torch.multiprocessing as mp

    model_dir, reference = gptq_checkpoint(tiny_model_dir("llama"), str(tmp_path / "gptq"), 4, 32, desc_act,
                                           sym=False)
    out_path = str(tmp_path / "logits.pt")
    mp.spawn(_rank_main, args=(2, str(tmp_path / "init"), model_dir, out_path), nprocs=2, join=True)
    with torch.inference_mode():
        want = reference(PROMPT[None]).logits[0]
    torch.testing.assert_close(torch.load(out_path), want, atol=2e-4, rtol=1e-4)


def test_gptq_engine_greedy_tokens_equal_reference(tmp_path, tiny_model_dir):
    from pagedllm import LLM, SamplingParams

    model_dir, reference = gptq_checkpoint(tiny_model_dir("qwen3"), str(tmp_path / "gptq"), 4, 32, True, True)
    prompts = [PROMPT[:n].tolist() for n in (7, 23, 40)]
    llm = LLM(model=model_dir, kv_cache_memory_bytes=1 << 22)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = list(prompt)
        with torch.inference_mode():
            for _ in range(8):
                ids.append(int(reference(torch.tensor([ids])).logits[0, -1].argmax()))
        assert out.outputs[0].token_ids == ids[len(prompt):]


@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_checkpoint_tensors_all_consumed_and_g_idx_required_only_with_act_order(tmp_path, caplog,
                                                                                      tiny_model_dir, desc_act):
    """qweight / qzeros / scales / g_idx all land in parameters (no 'Ignoring' warning); a checkpoint without
    g_idx loads with the trivial group map only without act-order: with desc_act that map would be garbage."""
    import logging

    from safetensors.torch import load_file, save_file

    model_dir, _ = gptq_checkpoint(tiny_model_dir("qwen2"), str(tmp_path / "gptq"), 4, 32, desc_act, True)
    caplog.set_level(logging.WARNING, logger="pagedllm")
    load_model(model_dir, dtype=torch.float32)
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("pagedllm.models")]
    path = f"{model_dir}/model.safetensors"
    tensors = load_file(path)
    save_file({k: v for k, v in tensors.items() if not k.endswith(".g_idx")}, path, metadata={"format": "pt"})
    if desc_act:
        with pytest.raises(ValueError, match=r"missing \d+ weight\(s\).*\.g_idx"):
            load_model(model_dir, dtype=torch.float32)
    else:
        load_model(model_dir, dtype=torch.float32)
