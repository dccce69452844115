"""The fused MoE on CUDA: the Triton routing, sort/align and expert kernels against their torch references (tokens 1,
7, 64, 512; 8 / 64 / 128 experts; top-2 / top-8; bf16 and fp16; both expert paths; the Qwen3-30B-A3B and a Mixtral
layer shape), the layer inside a CUDA graph (no host sync: captured once, replayed on new tokens), and the tiny
MoE models on CUDA against transformers and the CPU path (fp32, the engine with CUDA graphs)."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("triton", reason="the fused MoE kernels need Triton")

from pagedllm import LLM, SamplingParams  # noqa: E402
from tests.engine.test_correctness import check_against_hf, random_prompts  # noqa: E402
from tests.models.moe_helpers import MOE_ARCHS, tiny_moe_dir  # noqa: E402,F401 - the fixture
from tests.models.moe_kernel_cases import (check_align, check_fenced_equals_loops, check_fused,  # noqa: E402
                                           check_fused_routed, check_norm_router, check_route)

TOKENS = [1, 7, 64, 512]
EXPERTS = [(8, 2), (64, 8), (128, 8)]
DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("experts,top_k", EXPERTS + [(60, 4)])
@pytest.mark.parametrize("tokens", TOKENS)
def test_route(tokens, experts, top_k, renormalize):
    for dtype in DTYPES + [torch.float32]:
        check_route(tokens, experts, top_k, renormalize, dtype, "cuda", seed=tokens)


@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize("experts,top_k", EXPERTS)
@pytest.mark.parametrize("tokens", TOKENS + [4096])
def test_align(tokens, experts, top_k, block_m, stale_cuda_memory):
    check_align(tokens, experts, top_k, block_m, "cuda", seed=tokens)
    check_align(tokens, experts, top_k, block_m, "cuda", seed=tokens + 1, skew=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("experts,top_k", EXPERTS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_fused_moe_matches_reference(tokens, experts, top_k, dtype, stale_cuda_memory):
    """hidden 1024, intermediate 352 (not a multiple of the 64-wide tiles): every path the layer may take."""
    paths = [None, "grouped", "torch"] + (["gemv"] if tokens * top_k <= 64 else [])
    for path in paths:
        check_fused(tokens, experts, top_k, 1024, 352, dtype, "cuda", path=path, seed=tokens)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("experts,top_k", EXPERTS + [(60, 4)])
@pytest.mark.parametrize("tokens", [1, 2, 7])
def test_fused_moe_routed(tokens, experts, top_k, renormalize, stale_cuda_memory):
    """The routing inside the GEMV gate_up kernel: the reference's routing and experts, and bit for bit what
    routing first gives."""
    for path in (None, "gemv"):
        check_fused_routed(tokens, experts, top_k, 1024, 352, torch.bfloat16, "cuda", renormalize=renormalize,
                           path=path, seed=tokens)


@pytest.mark.parametrize("tokens", [1, 3, 64, 512])
@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "mixtral-tp8"])
def test_real_layer_shapes(shape, tokens, stale_cuda_memory):
    experts, top_k, hidden, inter = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-tp8": (8, 2, 4096, 1792)}[shape]
    for path in [None, "grouped", "torch"] + (["gemv"] if tokens <= 2 else []):
        check_fused(tokens, experts, top_k, hidden, inter, torch.bfloat16, "cuda", path=path, seed=tokens)
    check_fused_routed(tokens, experts, top_k, hidden, inter, torch.bfloat16, "cuda", seed=tokens)


@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "mixtral-tp8", "mixtral-8x7b-gate", "ragged"])
def test_fenced_gemvs_equal_loops(shape, tokens, stale_cuda_memory):
    """fused_moe.FENCED_GEMV at the shapes it is for (Qwen3-30B-A3B: both kernels) and beside them."""
    experts, top_k, hidden, inter, fenced = {"qwen3-30b-a3b": (128, 8, 2048, 768, (True, True)),
                                             "mixtral-tp8": (8, 2, 4096, 1792, (False, True)),
                                             "mixtral-8x7b-gate": (8, 2, 4096, 1024, (False, True)),
                                             "ragged": (60, 4, 1000, 352, (True, True))}[shape]
    for dtype in DTYPES:
        check_fenced_equals_loops(tokens, experts, top_k, hidden, inter, dtype, "cuda", fenced, seed=tokens)


@pytest.mark.parametrize("tokens", [1, 2, 8])
@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_router_in_the_norm(shape, tokens, stale_cuda_memory):
    """models/moe.NORM_ROUTER at the real router shapes (small experts: the router does not depend on them)."""
    experts, top_k, hidden = {"qwen3-30b-a3b": (128, 8, 2048), "mixtral-8x7b": (8, 2, 4096)}[shape]
    for dtype in DTYPES + [torch.float32]:
        check_norm_router(tokens, experts, top_k, hidden, 64, dtype, "cuda", seed=tokens)


def test_torch_grouped_mm_for_large_experts(stale_cuda_memory):
    """Experts of intermediate size >= 4096 with ~512+ rows each (a Mixtral prefill chunk) take torch's grouped
    GEMM by default on the H200 (bf16), and it matches the reference; fp16 and small experts keep Triton."""
    from pagedllm.kernels.fused_moe import torch_grouped_pays

    x = torch.empty(4096, 1024, dtype=torch.bfloat16, device="cuda")
    if torch.cuda.get_device_capability() == (9, 0):
        assert torch_grouped_pays(4096 * 2, 8, 4096, x)
    assert not torch_grouped_pays(4096 * 2, 8, 4096, x.half())
    assert not torch_grouped_pays(4096 * 8, 128, 768, x)
    assert not torch_grouped_pays(1024 * 2, 8, 4096, x)  # 256 rows per expert: Triton's
    check_fused(4096, 8, 2, 1024, 4096, torch.bfloat16, "cuda", path=None, seed=3)
    check_fused_routed(4096, 8, 2, 1024, 4096, torch.bfloat16, "cuda", seed=4)


def test_fp32_kernels_match_reference():
    """fp32 (the tests' engines): ieee dots, the tight tolerance."""
    for tokens, path in ((1, "gemv"), (7, None), (64, None), (300, "grouped")):
        check_fused(tokens, 8, 2, 256, 96, torch.float32, "cuda", path=path, seed=tokens)


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 128, 8), (2, 8, 2), (64, 128, 8), (512, 8, 2)])
def test_layer_in_cuda_graph(tokens, experts, top_k):
    """The whole layer (routing, align, experts, sum) captured once and replayed on other tokens equals eager:
    capture fails on any host sync, and a shape that depended on the routing would make replays wrong."""
    from pagedllm.layers.fused_moe import FusedMoE

    torch.manual_seed(0)
    with torch.device("cuda"):
        layer = FusedMoE(experts, top_k, 512, 256, renormalize=True, params_dtype=torch.bfloat16, prefix="moe")
    layer.gate_up_proj.data.normal_(std=512 ** -0.5)
    layer.down_proj.data.normal_(std=256 ** -0.5)
    x = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(x, logits)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph):
        out = layer(x, logits)
    for seed in range(3):
        g = torch.Generator(device="cuda").manual_seed(100 + seed)
        x.copy_(torch.randn(x.shape, device="cuda", generator=g).to(x.dtype))
        logits.copy_(torch.randn(logits.shape, device="cuda", generator=g).to(logits.dtype))
        graph.replay()
        with torch.inference_mode():
            expected = layer(x, logits)
        torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_tiny_moe_models_fp32_on_cuda(tiny_moe_dir, arch):
    from transformers import AutoModelForCausalLM

    from pagedllm.models.loader import get_model, load_hf_config

    model_dir = tiny_moe_dir(arch)
    ours = get_model(load_hf_config(model_dir), model_dir, dtype=torch.float32, device="cuda")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for n in (1, 48):  # one token (the GEMV path) and a prompt (grouped)
        ids = torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n))
        with torch.inference_mode():
            ref = hf(ids[None]).logits[0]
            out = ours.compute_logits(ours(ids.cuda(), torch.arange(n, device="cuda"))).cpu()
        torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_engine_fp32_with_cuda_graphs_matches_hf(tiny_moe_dir, arch):
    """The engine on CUDA (decode graphs replaying the MoE layers) gives transformers' tokens, as the CPU path."""
    model_dir = tiny_moe_dir(arch)
    llm = LLM(model=model_dir, dtype="float32", device="cuda", num_gpu_blocks_override=64, max_num_seqs=16)
    assert llm.engine.worker.runner.cuda_graphs is not None
    prompts = random_prompts([1, 5, 17, 33, 64, 3], seed=11)
    check_against_hf(llm, model_dir, prompts, [12, 7, 20, 9, 15, 24])


def test_engine_chunked_prefill_prefix_and_preemption_on_gpu(tiny_moe_dir):
    model_dir = tiny_moe_dir("qwen3_moe")
    llm = LLM(model=model_dir, dtype="float32", device="cuda", num_gpu_blocks_override=7, block_size=16,
              max_model_len=112, max_num_batched_tokens=16, max_num_seqs=4)
    shared = random_prompts([20], seed=6)[0]
    prompts = random_prompts([5, 9, 2, 14], seed=7, prefix=shared)
    check_against_hf(llm, model_dir, prompts, [30, 35, 26, 32])
    assert llm.engine.get_stats().num_preemptions > 0


def test_bf16_cuda_graph_equals_eager(tiny_moe_dir):
    model_dir = tiny_moe_dir("mixtral")
    prompts = [{"prompt_token_ids": p} for p in random_prompts([3, 30, 11, 50, 7, 1, 19, 2, 44], seed=9)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    graph = LLM(model=model_dir, dtype="bfloat16", device="cuda", num_gpu_blocks_override=128)
    eager = LLM(model=model_dir, dtype="bfloat16", device="cuda", num_gpu_blocks_override=128, enforce_eager=True)
    a = [o.outputs[0].token_ids for o in graph.generate(prompts, sp, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in eager.generate(prompts, sp, use_tqdm=False)]
    assert a == b


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tensor_parallel_nccl(tmp_path, tiny_moe_dir):
    import torch.multiprocessing as mp

    from tests.models.test_tensor_parallel import _logits, _rank_main

    model_dir = tiny_moe_dir("qwen2_moe")
    out_path = str(tmp_path / "logits.pt")
    mp.spawn(_rank_main, args=(2, str(tmp_path / "init"), model_dir, out_path, "nccl"), nprocs=2, join=True)
    torch.testing.assert_close(torch.load(out_path), _logits(model_dir), atol=1e-4, rtol=1e-4)
