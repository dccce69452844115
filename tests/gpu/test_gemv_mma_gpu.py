"""The tensor-core few-row GEMV over plain bf16 / fp16 weights (kernels/gemv_mma.py, csrc/gemv_mma.cu) on the GPU:
against the fp32 product (`gemv_ref`) at the Llama-3-8B, Qwen3-0.6B and SmolLM2 layer shapes, 1..32 rows, gated
(silu(gate) * up), bias, fp16, launch configs, CUDA-graph replay; the layers' routing (PAGEDLLM_GEMV_MMA_MAX_ROWS);
and an engine whose verify and small-batch steps take it."""
from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from pagedllm.kernels.gemv import _rows_kernel, gemv, gemv_applies, gemv_ref  # noqa: E402
from pagedllm.kernels.gemv_mma import gemv_mma  # noqa: E402

SHAPES = [  # (N, K), gated
    ((6144, 4096), False), ((4096, 4096), False), ((28672, 4096), True), ((4096, 14336), False),  # Llama-3-8B
    ((4096, 1024), False), ((1024, 2048), False), ((6144, 1024), True), ((1024, 3072), False),  # Qwen3-0.6B
    ((960, 576), False), ((3072, 576), True), ((576, 1536), False), ((49152, 576), False),  # SmolLM2, LM head
]


def _check(m, n, k, gated=False, bias=False, dtype=torch.bfloat16, config=None, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(dtype)
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    b = torch.randn(n, device="cuda", generator=gen).to(dtype) if bias else None
    out = gemv_mma(x, w, b, gated=gated, config=config)
    ref = gemv_ref(x, w, b, gated=gated)
    assert out.shape == ref.shape and out.dtype == dtype
    # fp32 sums in another order: a rounding or two of the output dtype apart
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    return x, w, b, out


@pytest.mark.parametrize("shape, gated", SHAPES)
@pytest.mark.parametrize("m", [2, 5, 8, 16, 32])
def test_model_shapes(shape, gated, m):
    _check(m, *shape, gated=gated, bias=m == 5)


@pytest.mark.parametrize("m", list(range(1, 33)))
def test_every_row_count(m):
    _check(m, 1024, 2048, seed=m)
    _check(m, 2048, 1024, gated=True, seed=m)


@pytest.mark.parametrize("gated", [False, True])
def test_fp16_and_bias(gated):
    _check(7, 2048, 1024, gated=gated, bias=True, dtype=torch.float16)
    _check(12, 2048, 1024, gated=gated, bias=False, dtype=torch.float16)


@pytest.mark.parametrize("config", [{"warps": 4}, {"warps": 16}, {"unit": 2}, {"unit": 4, "depth": 1},
                                    {"depth": 3}, {"ct": 2}, {"ct": 4, "warps": 8},
                                    {"unit": 2, "depth": 3, "warps": 8}])
def test_launch_configs_give_the_same_product(config):
    x, w, _, base = _check(5, 4096, 4096)
    torch.testing.assert_close(gemv_mma(x, w, config=config), base, atol=2e-2, rtol=2e-2)
    _check(11, 2048, 1024, gated=True, config=config)


def test_odd_chunk_counts_and_unaligned_rows():
    """K of 9 chunks (SmolLM2's 576) takes units of one chunk; a long K; x as a strided view of aligned rows."""
    _check(3, 960, 576, config={"unit": 2})
    _check(6, 1024, 20480)  # a K past the Triton GEMV's (Llama-70B's down projection is 28672)
    big = torch.randn(6, 1024 + 64, device="cuda").to(torch.bfloat16)
    w = (torch.randn(512, 1024, device="cuda") * 0.02).to(torch.bfloat16)
    x = big[:, :1024]
    torch.testing.assert_close(gemv_mma(x, w).float(), gemv_ref(x, w).float(), atol=2e-2, rtol=2e-2)


def test_cuda_graph_replay_equals_eager():
    w = (torch.randn(6144, 4096, device="cuda") * 0.02).to(torch.bfloat16)
    x = torch.randn(5, 4096, device="cuda").to(torch.bfloat16)
    eager = gemv_mma(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv_mma(x, w)
    x.copy_(torch.randn(5, 4096, device="cuda").to(torch.bfloat16))
    graph.replay()
    torch.testing.assert_close(out.float(), gemv_ref(x, w).float(), atol=2e-2, rtol=2e-2)
    assert not torch.equal(out, eager)


def test_routing(monkeypatch):
    """2..PAGEDLLM_GEMV_MMA_MAX_ROWS rows of a readable weight go to the tensor-core GEMV (16 by default); one row
    stays on the Triton GEMV; LoRA's fused expand keeps the Triton rule; misaligned x falls back."""
    w = torch.empty(4096, 4096, device="cuda", dtype=torch.bfloat16)
    x = lambda rows: torch.empty(rows, 4096, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    monkeypatch.setenv("PAGEDLLM_GEMV_MAX_ROWS", "4")
    monkeypatch.setenv("PAGEDLLM_GEMV_MMA_MAX_ROWS", "0")
    assert [_rows_kernel(m, w, x(m)) for m in (1, 2, 5)] == ["gemv", None, None]
    monkeypatch.delenv("PAGEDLLM_GEMV_MMA_MAX_ROWS")
    assert [_rows_kernel(m, w, x(m)) for m in (1, 2, 5, 16, 17)] == ["gemv", "mma", "mma", "mma", None]
    monkeypatch.setenv("PAGEDLLM_GEMV_MMA_MAX_ROWS", "8")
    assert [_rows_kernel(m, w, x(m)) for m in (1, 2, 8, 9)] == ["gemv", "mma", "mma", None]
    monkeypatch.setenv("PAGEDLLM_GEMV_MMA_MAX_ROWS", "64")  # clamped to the kernel's 32
    assert [_rows_kernel(m, w, x(m)) for m in (32, 33)] == ["mma", None]
    assert gemv_applies(x(5), w) and not gemv_applies(x(5), w, lora=True)
    odd = torch.empty(5, 4096 + 1, device="cuda", dtype=torch.bfloat16)[:, 1:]  # rows not 16-byte aligned
    assert _rows_kernel(5, w, odd) is None
    long_k = torch.empty(1024, 20480, device="cuda", dtype=torch.bfloat16)  # past the Triton GEMV's K
    xl = lambda rows: torch.empty(rows, 20480, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    assert [_rows_kernel(m, long_k, xl(m)) for m in (1, 5)] == [None, "mma"]
    bad_k = torch.empty(4096, 4000, device="cuda", dtype=torch.bfloat16)  # K % 64
    assert _rows_kernel(5, bad_k, torch.empty(5, 4000, device="cuda", dtype=torch.bfloat16)) is None
    # gemv() routes by the rule: the product is the tensor-core kernel's
    xs = torch.randn(5, 4096, device="cuda").to(torch.bfloat16)
    wr = (torch.randn(4096, 4096, device="cuda") * 0.02).to(torch.bfloat16)
    assert torch.equal(gemv(xs, wr), gemv_mma(xs, wr))


def test_warm_up_compiles_every_variant_in_parallel():
    """warm_up compiles what later calls launch (their lookups are cache hits), skips weights it cannot read."""
    from pagedllm.kernels import gemv_mma as mod

    w1 = torch.empty(768, 512, device="cuda", dtype=torch.bfloat16)
    w2 = torch.empty(1536, 512, device="cuda", dtype=torch.bfloat16)
    bad = torch.empty(768, 500, device="cuda", dtype=torch.bfloat16)
    assert mod.warm_up([(w1, False, False), (w2, True, True), (bad, False, False)]) == 2
    before = mod._compile.cache_info().misses
    gemv_mma(torch.randn(3, 512, device="cuda").to(torch.bfloat16), w1.normal_())
    gemv_mma(torch.randn(20, 512, device="cuda").to(torch.bfloat16), w2.normal_(),
             torch.zeros(1536, device="cuda", dtype=torch.bfloat16), gated=True)
    assert mod._compile.cache_info().misses == before


def test_a_failed_build_leaves_the_layers_on_their_other_kernels(tiny_model_dir, monkeypatch, caplog):
    """If the kernel cannot be built at start-up the engine says so and runs on the Triton GEMV / cuBLAS."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.kernels import gemv as gemv_module
    from pagedllm.kernels import gemv_mma as mod

    def broken(*args, **kwargs):
        raise RuntimeError("NVRTC said no")

    monkeypatch.setenv("PAGEDLLM_GEMV_MMA_MAX_ROWS", "16")
    monkeypatch.setattr(mod, "_prepare", broken)
    monkeypatch.setattr(gemv_module, "_MMA_DEVICES", {})
    with caplog.at_level("WARNING"):
        llm = LLM(model=tiny_model_dir("llama", hidden_size=256, intermediate_size=768), dtype="bfloat16",
                  num_gpu_blocks_override=64, max_model_len=256)
    assert "failed to build" in caplog.text and "NVRTC said no" in caplog.text
    x = torch.empty(5, 256, device="cuda", dtype=torch.bfloat16)
    assert _rows_kernel(5, torch.empty(512, 256, device="cuda", dtype=torch.bfloat16), x) is None
    out = llm.generate([{"prompt_token_ids": list(range(5, 25))}] * 3, SamplingParams(max_tokens=4), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)


def test_engine_steps_on_the_tensor_core_gemv(tiny_model_dir, monkeypatch):
    """A bf16 engine with the kernel on (batch 6 decode steps, n-gram verify steps of 1 + k rows, CUDA graphs) gives
    the greedy tokens of the engine with it off up to near-ties (bf16 sums in another order), and their logprobs
    within bf16 rounding; the verify steps did replay graphs."""
    from pagedllm import LLM, SamplingParams
    from spec_checks import assert_same_up_to_near_ties

    model = tiny_model_dir("llama", hidden_size=256, intermediate_size=768)  # K of 4 and 12 chunks
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 250 + 5 for j in range(12 + i)] * 2} for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2, ignore_eos=True)
    outs, drafts = {}, {}
    for on in ("0", "16"):
        monkeypatch.setenv("PAGEDLLM_GEMV_MMA_MAX_ROWS", on)
        llm = LLM(model=model, dtype="bfloat16", num_gpu_blocks_override=256, max_model_len=512,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                                      "prompt_lookup_min": 2})
        outs[on] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        drafts[on] = llm.engine.scheduler.spec_stats.num_drafts
        del llm
        torch.cuda.empty_cache()
    assert drafts["16"] > 0  # verify steps ran (the repeated prompts give n-gram matches)
    assert assert_same_up_to_near_ties(outs["16"], outs["0"], check_logprobs=True) > 0
