"""Gemma 2, Gemma 3 and Phi-3 on CUDA (run on the device): in fp32 the engine's tokens (Triton attention, fused qkv
path, CUDA graphs) equal the CPU engine's and transformers', the logprobs within fp32 tolerance; Gemma 3 past its
sliding window; Gemma 2's soft-capped attention on the Triton kernels and the torch backend; bf16 graphs equal bf16
eager."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.engine.test_correctness import check_against_hf, random_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LENGTHS, MAX_TOKENS = [1, 5, 17, 33, 64, 3], [12, 7, 20, 9, 15, 24]


def _tokens(llm: LLM, prompts, max_tokens) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _cuda_matches_cpu_and_hf(model_dir: str, prompts, max_tokens, **kwargs) -> None:
    cuda = LLM(model=model_dir, dtype="float32", device="cuda", num_gpu_blocks_override=64, max_num_seqs=16, **kwargs)
    check_against_hf(cuda, model_dir, prompts, max_tokens)
    got = _tokens(cuda, prompts, max_tokens)
    cuda.shutdown()
    cpu_kwargs = {k: v for k, v in kwargs.items() if k != "enforce_eager"}
    cpu = LLM(model=model_dir, dtype="float32", device="cpu", num_gpu_blocks_override=64, max_num_seqs=16,
              **cpu_kwargs)
    assert got == _tokens(cpu, prompts, max_tokens)
    cpu.shutdown()


@pytest.mark.parametrize("arch", ["gemma3", "phi3_plain"])
def test_fp32_tokens_on_cuda_equal_cpu_and_hf(tiny_model_dir, arch):
    _cuda_matches_cpu_and_hf(tiny_model_dir(arch), random_prompts(LENGTHS, seed=1), MAX_TOKENS)


def test_phi3_longrope_on_cuda(tiny_model_dir):
    """Past the original context (the long factors, partial rotary: the unfused rotary kernel)."""
    _cuda_matches_cpu_and_hf(tiny_model_dir("phi3"), random_prompts([33, 40, 60], seed=7), [10, 6, 12])


def test_phi3_longrope_per_request_on_cuda(tiny_model_dir):
    """Requests on both sides of the original context (32) and across it in one engine (CUDA graphs, async
    scheduling): the long requests' positions offset into the long rows, the crossings recomputed."""
    _cuda_matches_cpu_and_hf(tiny_model_dir("phi3"), random_prompts([5, 20, 28, 31, 32, 33, 45], seed=11),
                             [6, 20, 9, 4, 8, 6, 10], block_size=16, max_num_batched_tokens=16)


def test_gemma3_past_the_window_on_cuda(tmp_path):
    from tests.conftest import save_tiny_model, tiny_hf_config
    config = tiny_hf_config("gemma3")
    config.sliding_window = 16
    model_dir = save_tiny_model(str(tmp_path), config)
    # six KV-cache groups (five windowed layers, one full): 128 tokens need 6 x 8 of the 64 blocks
    _cuda_matches_cpu_and_hf(model_dir, random_prompts([60, 3, 41, 17, 70], seed=8), [12, 30, 9, 20, 6],
                             block_size=16, max_model_len=128)


@pytest.mark.parametrize("backend", [None, "torch"])
def test_gemma2_soft_capped_on_cuda(tiny_model_dir, backend):
    """Attention logits soft-capped at 1.0 (reached by the random activations): the Triton kernels (default: fused
    qkv path, CUDA graphs) and the torch backend give the CPU engine's and transformers' tokens."""
    kwargs = {} if backend is None else {"attention_backend": backend, "enforce_eager": True}
    _cuda_matches_cpu_and_hf(tiny_model_dir("gemma2"), random_prompts(LENGTHS, seed=1), MAX_TOKENS, **kwargs)


def test_gemma2_past_the_window_on_cuda(tmp_path):
    from tests.conftest import save_tiny_model, tiny_hf_config
    config = tiny_hf_config("gemma2")
    config.sliding_window = 16
    model_dir = save_tiny_model(str(tmp_path), config)
    _cuda_matches_cpu_and_hf(model_dir, random_prompts([60, 3, 41, 17, 70], seed=8), [12, 30, 9, 20, 6],
                             block_size=16)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3"])
def test_bf16_cuda_graphs_equal_eager(tiny_model_dir, arch):
    model_dir = tiny_model_dir(arch)
    prompts = random_prompts([3, 30, 11, 50, 7, 1, 19, 2, 44], seed=9)
    max_tokens = [24] * len(prompts)
    graph = LLM(model=model_dir, dtype="bfloat16", device="cuda", num_gpu_blocks_override=128)
    assert graph.engine.worker.runner.cuda_graphs is not None
    with_graphs = _tokens(graph, prompts, max_tokens)
    graph.shutdown()
    eager = LLM(model=model_dir, dtype="bfloat16", device="cuda", num_gpu_blocks_override=128, enforce_eager=True)
    assert with_graphs == _tokens(eager, prompts, max_tokens)
