"""LoRA on CUDA: the Triton shrink/expand kernels against their torch references (ranks 8-64, bf16/fp16, mixed
slots, tokens without an adapter, CUDA-graph padding rows), and the engine's LoRA tokens on the GPU (eager and
CUDA graphs) equal to the CPU path's and to transformers + PEFT in fp32; the few-row path's kernels (shrink in the
norm, few-token shrink, expand + SiLU) against references, in a CUDA graph, and in the engine against the general
kernels."""
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
    (300, 16, 2048, [1024]),  # 300 tokens, 16 adapters
    (1500, 5, 1024, [2048, 512, 512]),  # prefill-sized: 64-row blocks
    (40, 64, 1024, [1024]),  # most of 64 slots empty: blocks span slots with gaps
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


# ---- the few-row path: the shrink in the norm, few-token shrink and expand (+ SiLU) kernels ----------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("case", [(1, 2, 4096, 1), (1, 1, 14336, 1), (5, 3, 896, 3), (16, 4, 4096, 2)])
def test_shrink_rows_matches_reference(case, rank, dtype):
    from tests.lora.lora_kernel_cases import check_shrink_rows_case

    tokens, slots, k, n_slices = case
    check_shrink_rows_case(tokens, slots, k, n_slices, rank, rank, dtype, "cuda", seed=rank + tokens)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("case", [(1, 2, [4096, 1024, 1024], 1, False), (1, 1, [4096], 16, False),
                                  (1, 2, [14336, 14336], 1, True), (5, 3, [896, 128, 128], 2, False),
                                  (16, 4, [4864, 4864], 1, True)])
def test_expand_rows_matches_reference(case, rank, dtype, stale_cuda_memory):
    from tests.lora.lora_kernel_cases import check_expand_rows_case

    tokens, slots, slices, split, silu = case
    check_expand_rows_case(tokens, slots, slices, rank, rank, dtype, "cuda", split=split, silu=silu, seed=rank)


GEMV_LORA_CASES = [  # (rows, slots, K, slices, gated, bias): the 8B layer shapes at one row, a few rows
    (1, 2, 4096, [4096, 1024, 1024], False, False),  # qkv
    (1, 2, 4096, [14336, 14336], True, False),  # gate_up + SiLU
    (1, 2, 14336, [4096], False, False),  # down
    (4, 3, 896, [896, 128, 128], False, True),  # Qwen2-0.5B-like qkv with bias, four rows
    (3, 2, 1024, [3072, 3072], True, False),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("case", GEMV_LORA_CASES)
def test_gemv_lora_matches_reference(case, rank, dtype):
    """The base GEMV with the LoRA expand in its epilogue (lora.layers.GEMV_EXPAND)."""
    from tests.lora.lora_kernel_cases import check_gemv_lora_case

    rows, slots, k, slices, gated, bias = case
    check_gemv_lora_case(rows, slots, k, slices, rank, rank, dtype, "cuda", split=2 if rows > 1 else 1, gated=gated,
                         bias=bias, seed=rank)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("case", [(1, 2, 32, 8, 128, 16), (16, 4, 32, 8, 128, 8), (5, 3, 16, 8, 64, 4)])
def test_output_shrink_matches_reference(case, rank, dtype):
    """o_proj's shrink computed by the split-KV decode attention's reduce kernel (lora.layers.FOLD_O_SHRINK)."""
    from tests.lora.lora_kernel_cases import check_output_shrink_case

    tokens, slots, heads, kv_heads, head_size, splits = case
    check_output_shrink_case(tokens, slots, heads, kv_heads, head_size, rank, rank, dtype, "cuda", num_splits=splits,
                             seed=rank)


NORM_SHRINK_CASES = [  # (rows, slots, hidden, slices, residual, fp32 product)
    (1, 2, 4096, 3, True, False),
    (1, 2, 4096, 2, False, False),
    (8, 4, 896, 3, True, False),
    (3, 2, 2048, 2, True, True),  # Gemma's (1 + w) norm
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("case", NORM_SHRINK_CASES)
def test_norm_shrink_matches_reference(case, rank, dtype, stale_cuda_memory):
    from tests.lora.lora_kernel_cases import check_norm_shrink_case

    rows, slots, hidden, n_slices, residual, fp32_product = case
    check_norm_shrink_case(rows, slots, hidden, n_slices, rank, rank, dtype, "cuda", residual=residual,
                           fp32_product=fp32_product, seed=rank)


def test_few_row_kernels_in_cuda_graph_follow_new_slots():
    """Norm + shrink, GEMV, expand + SiLU, few-token shrink and expand captured while no row has an adapter replay a
    later step's slots (the slot table is read at replay)."""
    from pagedllm.kernels import lora, norm
    from tests.lora.lora_kernel_cases import build_case

    x, a, b, _, _, res = build_case(2, 3, 1024, [512, 512], 16, 16, torch.bfloat16, "cuda", seed=5)
    res = res[:, :1024].contiguous()
    weight = torch.ones(1024, dtype=torch.bfloat16, device="cuda")
    w = (torch.randn(1024, 1024, device="cuda") / 32).to(torch.bfloat16)  # gate_up of 512 + 512
    a_down = (torch.randn(3, 16, 512, device="cuda") * 0.1).to(torch.bfloat16)
    b_down = (torch.randn(3, 16, 1024, device="cuda") * 0.1).to(torch.bfloat16)
    slot_buf = torch.full((2,), -1, dtype=torch.int32, device="cuda")
    counters = torch.zeros(2, dtype=torch.int32, device="cuda")

    def step():
        y, _, h = norm.rms_norm_shrink(x, res, weight, 1e-6, False, a, slot_buf)
        gate_up = y @ w.t()
        act = lora.lora_expand_rows(h, b, gate_up, slot_buf, silu=True)
        h_down = lora.lora_shrink_rows(act, a_down, slot_buf, counters)
        out = act.new_zeros((2, 1024))  # a stand-in for the down projection's output: zeros, then its delta
        lora.lora_expand_rows(h_down, b_down, out, slot_buf)
        return y, gate_up, act, out

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, gate_up, act, out = step()
    slots = torch.tensor([2, -1], dtype=torch.int32)
    slot_buf.copy_(slots)
    graph.replay()
    torch.cuda.synchronize()
    ref_h = lora.lora_shrink_ref(y.cpu(), a.cpu(), slots)
    ref_gu = lora.lora_expand_ref(ref_h, b.cpu(), gate_up.cpu(), slots, [(0, 512), (512, 512)])
    ref_act = (torch.nn.functional.silu(ref_gu[:, :512].to(torch.bfloat16).float()).to(torch.bfloat16).float()
               * ref_gu[:, 512:].to(torch.bfloat16).float())
    torch.testing.assert_close(act.float().cpu(), ref_act, atol=3e-2, rtol=3e-2)
    ref_down = lora.lora_expand_ref(lora.lora_shrink_ref(act.cpu(), a_down.cpu(), slots), b_down.cpu(),
                                    torch.zeros(2, 1024), slots, [(0, 1024)])
    torch.testing.assert_close(out.float().cpu(), ref_down, atol=3e-2, rtol=3e-2)
    assert torch.all(out[1] == 0) and torch.any(out[0] != 0), "row 1 has no adapter; row 0's delta is missing"
    assert torch.all(counters == 0)


from pagedllm.lora import layers as lora_layers  # noqa: E402

_FEW_ROWS, _NORM_AND_SHRINK = lora_layers.LoRALinear._few_rows, lora_layers.LoRALinear.norm_and_shrink


def _greedy_with_logprobs(model_dir, adapters, fused: bool, enforce_eager: bool, monkeypatch):
    from pagedllm import LLM, LoRARequest, SamplingParams

    monkeypatch.setattr(lora_layers, "FUSED_DECODE", fused)
    calls = {"rows": 0, "norm": 0}
    few_rows, norm_and_shrink = _FEW_ROWS, _NORM_AND_SHRINK

    def count_rows(self, *args, **kwargs):
        out = few_rows(self, *args, **kwargs)
        calls["rows"] += out is not None
        return out

    def count_norm(self, *args, **kwargs):
        out = norm_and_shrink(self, *args, **kwargs)
        calls["norm"] += out is not None
        return out

    monkeypatch.setattr(lora_layers.LoRALinear, "_few_rows", count_rows)
    monkeypatch.setattr(lora_layers.LoRALinear, "norm_and_shrink", count_norm)
    llm = LLM(model=model_dir, dtype="bfloat16", device="cuda", num_gpu_blocks_override=64, max_num_seqs=4,
              enable_lora=True, max_loras=3, max_lora_rank=16, enforce_eager=enforce_eager)
    rng = random.Random(1)
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in (5, 11, 8, 14, 3, 9)]
    reqs = [LoRARequest(f"l{i}", i + 1, p) for i, p in enumerate(adapters)] * 2
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
                        lora_request=reqs, use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0] for o in outs], calls


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_engine_few_row_path_matches_general_kernels(tiny_llama_dir, adapters, enforce_eager, monkeypatch):
    """bf16 decode of three adapters at once (all 7 projections; q/v only; o/down only): the few-row path (shrinks
    in the norms, few-token shrink / expand kernels) gives the general shrink / expand kernels' tokens and
    logprobs (up to bf16 rounding: a token may differ only where the general path's top two were within rounding
    of each other)."""
    ref, ref_calls = _greedy_with_logprobs(tiny_llama_dir, adapters, False, enforce_eager, monkeypatch)
    got, calls = _greedy_with_logprobs(tiny_llama_dir, adapters, True, enforce_eager, monkeypatch)
    assert ref_calls == {"rows": 0, "norm": 0}
    assert calls["rows"] > 0 and calls["norm"] > 0, calls
    compared = _same_tokens_and_logprobs(ref, got, 0.05)
    # (a near-tie ends a sequence's comparison wherever the reference has one: on another GPU or driver at other
    # steps; half of the 6 x 12 steps leaves room for a few early ones)
    assert compared >= 36, compared


def _same_tokens_and_logprobs(ref, got, margin: float) -> int:
    """Each sequence's tokens equal the reference's until a step where the reference's top two were within
    `margin` (a rounding-level tie), their logprobs within `margin` up to there; -> the steps compared."""
    compared = 0
    for r, g in zip(ref, got):
        for step, (rt, gt) in enumerate(zip(r.token_ids, g.token_ids)):
            top = sorted(r.logprobs[step].values(), key=lambda lp: -lp.logprob)
            if rt != gt:
                assert top[0].logprob - top[1].logprob < margin, (step, rt, gt, top)
                break
            assert abs(r.logprobs[step][rt].logprob - g.logprobs[step][gt].logprob) < margin
            compared += 1
    return compared


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_engine_gemv_expand_matches_separate_expand(tiny_llama_dir, adapters, enforce_eager, monkeypatch):
    """The few-row path with the expand in the base GEMV's epilogue (lora.layers.GEMV_EXPAND) gives the separate
    expand kernels' tokens and logprobs (up to one rounding: the delta joins before the base output is rounded)."""
    from pagedllm.kernels import gemv as gemv_kernels

    monkeypatch.setattr(lora_layers, "GEMV_EXPAND", False)
    ref, _ = _greedy_with_logprobs(tiny_llama_dir, adapters, True, enforce_eager, monkeypatch)
    monkeypatch.setattr(lora_layers, "GEMV_EXPAND", True)
    calls = {"lora": 0}
    plain = gemv_kernels.gemv

    def counted(*args, **kwargs):
        calls["lora"] += kwargs.get("lora") is not None
        return plain(*args, **kwargs)

    monkeypatch.setattr(gemv_kernels, "gemv", counted)
    got, _ = _greedy_with_logprobs(tiny_llama_dir, adapters, True, enforce_eager, monkeypatch)
    assert calls["lora"] > 0, calls  # (graphs: at least while capturing)
    _same_tokens_and_logprobs(ref, got, 0.02)


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_engine_output_shrink_fold_matches_separate_shrink(tiny_llama_dir, adapters, enforce_eager, monkeypatch):
    """The few-row path with o_proj's shrink computed by the decode attention's reduce kernel (the default,
    lora.layers.FOLD_O_SHRINK) gives the separate few-token shrink's tokens and logprobs (up to the fp32 summation
    order of the shrink)."""
    from pagedllm.lora.layers import LoRALinear

    assert lora_layers.FOLD_O_SHRINK
    monkeypatch.setattr(lora_layers, "FOLD_O_SHRINK", False)
    ref, _ = _greedy_with_logprobs(tiny_llama_dir, adapters, True, enforce_eager, monkeypatch)
    monkeypatch.setattr(lora_layers, "FOLD_O_SHRINK", True)
    calls = {"o": 0}
    take = LoRALinear.take_output_shrink

    def counted_o(self, *args, **kwargs):
        calls["o"] += 1
        return take(self, *args, **kwargs)

    monkeypatch.setattr(LoRALinear, "take_output_shrink", counted_o)
    got, _ = _greedy_with_logprobs(tiny_llama_dir, adapters, True, enforce_eager, monkeypatch)
    assert calls["o"] > 0, calls  # (graphs: at least while capturing)
    _same_tokens_and_logprobs(ref, got, 0.02)
