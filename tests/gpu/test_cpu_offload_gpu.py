"""--cpu-offload-gb on CUDA: layers streamed from pinned host memory on a side stream give transformers' exact
greedy tokens (graphs off, with its reason logged), and the offloaded bytes really leave the GPU."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.engine.test_correctness import check_against_hf, random_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_offloaded_layers_match_hf(tiny_llama_dir, caplog):
    with caplog.at_level("INFO", logger="pagedllm"):
        llm = LLM(model=tiny_llama_dir, dtype="float32", device="cuda", num_gpu_blocks_override=64,
                  cpu_offload_gb=0.001)  # ~1 MB: both tiny layers
    off = llm.engine.worker.offloader
    assert len(off.layers) == 2 and all(p.device.type == "cpu" and p.is_pinned()
                                        for lay in off.layers for p in lay.parameters())
    assert llm.engine.worker.runner.cuda_graphs is None and "CUDA graphs are off" in caplog.text
    prompts = random_prompts([1, 5, 17, 33, 64, 3], seed=1)
    check_against_hf(llm, tiny_llama_dir, prompts, [12, 7, 20, 9, 15, 24])


def test_offloaded_bytes_leave_the_gpu(tmp_path):
    from transformers import Qwen3Config

    cfg = Qwen3Config(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                      architectures=["Qwen3ForCausalLM"])
    cfg.save_pretrained(tmp_path)
    used = {}
    for gb in (0, 0.25):
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        llm = LLM(model=str(tmp_path), load_format="dummy", dtype="bfloat16", device="cuda", cpu_offload_gb=gb,
                  skip_tokenizer_init=True, num_gpu_blocks_override=64, max_model_len=1024, enforce_eager=True)
        weights = torch.cuda.memory_allocated() - before
        out = llm.generate({"prompt_token_ids": list(range(10, 40))},
                           SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 8
        used[gb] = (weights, getattr(llm.engine.worker, "offloader", None))
        llm.engine.shutdown()
        del llm
    off = used[0.25][1]
    saved = used[0][0] - used[0.25][0]
    # the offloaded layers left the GPU, minus the two slots that hold the layers being streamed
    slot_bytes = 2 * off.offloaded_bytes / len(off.layers)
    assert saved >= 0.9 * (off.offloaded_bytes - slot_bytes), (saved, off.offloaded_bytes)
