"""LoRA on CUDA: the Triton shrink/expand kernels against their torch references (ranks 8-64, bf16/fp16, mixed
slots, tokens without an adapter, CUDA-graph padding rows), and the engine's LoRA tokens on the GPU (eager and
CUDA graphs) equal to the CPU path's and to transformers + PEFT in fp32."""
from __future__ import annotations

import random

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPES = [  # (tokens, slots, K, slices)
    (1, 1, 1024, [2048, 512, 512]),  # batch-1 decode, qkv
    (7, 4, 896, [4864, 4864]),  # gate_up of a Qwen2-0.5B-like shape
    (64, 4, 4096, [4096]),  # o_proj of an 8B shape
    (300, 16, 2048, [1024]),  # prefill-sized, 16 adapters
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rank", [8, 16, 32, 64])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernels_match_reference(shape, rank, dtype):
    from tests.lora.lora_kernel_cases import check_case

    tokens, slots, k, slices = shape
    max_rank = max(16, rank)
    check_case(tokens, slots, k, slices, rank, max_rank, dtype, "cuda", seed=rank, pad_rows=5)


def test_kernels_fp32_exact_path():
    from tests.lora.lora_kernel_cases import check_case

    check_case(33, 3, 576, [576, 192, 192], 16, 16, torch.float32, "cuda", pad_rows=3)


def test_kernels_in_cuda_graph_follow_new_slots():
    """A graph captured with no adapter active replays a later batch's slots from the persistent buffers."""
    from pagedllm.kernels import lora as kernels
    from tests.lora.lora_kernel_cases import build_case, step_metadata

    x, a, b, slots, spans, out = build_case(24, 4, 512, [256, 128], 16, 16, torch.bfloat16, "cuda", seed=9)
    sorted_buf = torch.zeros(24, dtype=torch.int32, device="cuda")
    starts_buf = torch.zeros(5, dtype=torch.int32, device="cuda")
    static_out = out.clone()
    for _ in range(2):
        h = kernels.lora_shrink(x, a, sorted_buf, starts_buf)
        kernels.lora_expand(h, b, static_out, sorted_buf, starts_buf, spans)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h = kernels.lora_shrink(x, a, sorted_buf, starts_buf)
        kernels.lora_expand(h, b, static_out, sorted_buf, starts_buf, spans)
    sorted_ids, starts = step_metadata(slots, 4)
    sorted_buf[:len(sorted_ids)].copy_(sorted_ids)
    starts_buf.copy_(starts)
    static_out.copy_(out)
    graph.replay()
    ref = kernels.lora_expand_ref(kernels.lora_shrink_ref(x.cpu(), a.cpu(), slots), b.cpu(), out.cpu(), slots, spans)
    torch.testing.assert_close(static_out.float().cpu(), ref, atol=6e-2, rtol=2e-2)


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    pytest.importorskip("peft", reason="the engine test makes its adapters with peft (pip install -e '.[test]')")
    from tests.lora.lora_helpers import make_adapter

    d = tmp_path_factory.mktemp("gpu-loras")
    all7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return [make_adapter(tiny_llama_dir, str(d / "a"), r=8, alpha=16, targets=all7, seed=1),
            make_adapter(tiny_llama_dir, str(d / "b"), r=16, alpha=8, targets=["q_proj", "v_proj"], seed=2,
                         use_rslora=True),
            make_adapter(tiny_llama_dir, str(d / "c"), r=4, alpha=4, targets=["o_proj", "down_proj"], seed=3)]


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_engine_lora_tokens_on_gpu_match_peft(tiny_llama_dir, adapters, enforce_eager):
    from pagedllm import LLM, LoRARequest, SamplingParams
    from tests.lora.lora_helpers import peft_greedy

    llm = LLM(model=tiny_llama_dir, dtype="float32", device="cuda", num_gpu_blocks_override=64, max_num_seqs=8,
              enable_lora=True, max_loras=2, max_lora_rank=16, enforce_eager=enforce_eager)
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in (3, 12, 7, 20, 5, 9)]
    reqs = [None] + [LoRARequest(f"l{i}", i + 1, p) for i, p in enumerate(adapters)] * 2
    reqs = reqs[:len(prompts)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), lora_request=reqs,
                        use_tqdm=False)
    for p, r, o in zip(prompts, reqs, outs):
        assert o.outputs[0].token_ids == peft_greedy(tiny_llama_dir, r and r.lora_path, p, 10)[0]
