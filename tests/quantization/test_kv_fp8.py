"""FP8 (E4M3) KV cache, --kv-cache-dtype fp8: the torch backend (the CPU path) reads and writes it with the
per-layer scales, exactly as E4M3 rounds (against an independent float64 attention over the same rounding, and
within the rounding's worst case of full precision); the engine equals a full-precision engine whose K/V are
rounded the same way, its error against full precision is measured and bounded, its token capacity doubles (fp32:
quadruples); unsupported combinations are refused."""
from __future__ import annotations

import os
import re
import sys

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.attention.torch_backend import TorchAttentionBackend
from tests.quantization.logprob_checks import assert_same_greedy, greedy, max_logprob_error, teacher_forced
from tests.triton_interpreter import needs_triton, run_interpreted

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "gpu"))
from attention_cases import build_batch  # noqa: E402

E4M3 = torch.float8_e4m3fn
SPECS = [(0, 37), (100, 50), (500, 1), (0, 1), (31, 20), (3, 1)]  # prefills, prefix hits, decodes


def _batch():
    return build_batch(SPECS, 8, 2, 64, 16, torch.float32, "cpu", poison=False)


def e4m3_error_bound(x: torch.Tensor) -> torch.Tensor:
    """The most E4M3 rounding (round to nearest, |x| <= 448) can move x: half a step, 2^-4 |x| where x is normal (3
    mantissa bits) and 2^-10 among the subnormals (below 2^-6, steps of 2^-9)."""
    return torch.maximum(x.abs() * 2.0 ** -4, torch.full_like(x, 2.0 ** -10))


def e4m3_round_trip(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """What a scaled FP8 cache gives back for x: E4M3(x / scale) * scale, saturated at +-448 like the writes."""
    return (x / scale).clamp(-448, 448).to(E4M3).to(x.dtype) * scale


def _sequence_kv(kv_cache: torch.Tensor, md, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence i's K and V ([S, KVH, D], float64), read from the paged cache through its block table."""
    block_size = kv_cache.shape[2]
    pos = torch.arange(md.seq_lens_cpu[i])
    slots = md.block_table[i].long()[pos // block_size] * block_size + pos % block_size
    flat = kv_cache.float().double().view(2, -1, *kv_cache.shape[3:])
    return flat[0, slots], flat[1, slots]


def _dense_attention(query: torch.Tensor, kv_cache: torch.Tensor, md, scale: float):
    """Causal GQA attention in float64 over the K/V the paged cache holds, one sequence at a time: an independent
    reference of the backend. Returns out [T, H, D] and, per sequence, (q, K, V, probabilities, mask)."""
    num_heads = query.shape[1]
    out = torch.empty(query.shape, dtype=torch.float64)
    parts = []
    for i in range(md.num_reqs):
        start, end = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1]
        k, v = _sequence_kv(kv_cache, md, i)
        group = num_heads // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [S, H, D]
        q = query[start:end].double()
        first = md.seq_lens_cpu[i] - (end - start)  # query j sees positions <= first + j
        mask = torch.arange(k.shape[0])[None, :] <= torch.arange(end - start)[:, None] + first  # [Q, S]
        scores = torch.einsum("qhd,shd->hqs", q, k) * scale
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out[start:end] = torch.einsum("hqs,shd->qhd", probs, v)
        parts.append((q, k, v, probs, mask))
    return out, parts


def rounding_bound(query, full_cache, md, scale: float, scales=(1.0, 1.0)) -> torch.Tensor:
    """How far attention over E4M3(K / k_scale) * k_scale (V alike) can be from attention over the full-precision
    K/V, per value [T, H, D]. Each score moves by at most delta = scale * max_s sum_d |q_d| e(k_sd) (e: the
    rounding's bound, e4m3_error_bound, at the cache's scale), so each probability by a factor within
    e^(+-2 delta); hence |out - exact| <= sum_s p'_s e(v_s) + (e^(2 delta) - 1) sum_s p_s |v_s| (p, p': the
    probabilities over the exact and the rounded K)."""
    k_scale, v_scale = scales
    _, exact = _dense_attention(query, full_cache, md, scale)
    _, rounded = _dense_attention(query, torch.stack([e4m3_round_trip(full_cache[0], k_scale),
                                                      e4m3_round_trip(full_cache[1], v_scale)]), md, scale)
    bound = torch.empty(query.shape, dtype=torch.float64)
    for i, ((q, k, v, p, mask), (_, _, _, p_rounded, _)) in enumerate(zip(exact, rounded)):
        start, end = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1]
        score_error = torch.einsum("qhd,shd->hqs", q.abs(), e4m3_error_bound(k / k_scale) * k_scale) * scale
        delta = score_error.masked_fill(~mask, 0).amax(-1)  # [H, Q]
        bound[start:end] = (torch.einsum("hqs,shd->qhd", p_rounded, e4m3_error_bound(v / v_scale) * v_scale)
                            + torch.expm1(2 * delta).transpose(0, 1)[..., None]
                            * torch.einsum("hqs,shd->qhd", p, v.abs()))
    return bound


def test_torch_backend_fp8_cache_equals_attention_over_e4m3_rounded_kv():
    batch = _batch()
    fp8_cache = batch.kv_cache.to(E4M3)
    out = TorchAttentionBackend().forward(batch.query, batch.key, batch.value, fp8_cache, batch.metadata, batch.scale)
    full_cache = batch.kv_cache.clone()
    full = TorchAttentionBackend().forward(batch.query, batch.key, batch.value, full_cache, batch.metadata,
                                           batch.scale)
    # The new tokens were written as their E4M3 rounding, everything else kept; that rounding is as exact as the
    # format allows (one mantissa bit fewer, a truncation or a wrong scale breaks it).
    assert torch.equal(fp8_cache.float(), full_cache.to(E4M3).float())
    assert ((fp8_cache.float() - full_cache).abs() <= e4m3_error_bound(full_cache)).all()
    # Against an independent float64 attention over the E4M3-rounded K/V of the same paged layout: equal up to
    # float32 rounding (the same numbers, another summation order).
    ref, _ = _dense_attention(batch.query, fp8_cache, batch.metadata, batch.scale)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)
    exact, _ = _dense_attention(batch.query, full_cache, batch.metadata, batch.scale)
    torch.testing.assert_close(full.double(), exact, atol=2e-6, rtol=1e-5)
    # Against full precision: within what the rounding can do (rounding_bound).
    bound = rounding_bound(batch.query, full_cache, batch.metadata, batch.scale)
    err = (out.double() - exact).abs()
    assert (err <= bound * (1 + 1e-6) + 2e-6).all(), (err / bound).max()
    print(f"fp8 attention error against full precision: at most {(err / bound).max():.2f} of the rounding bound")


def test_per_layer_scales(monkeypatch):
    """With k_scale / v_scale the cache holds K / k_scale, V / v_scale: the layer returns attention over
    E4M3(K / k_scale) * k_scale (and V alike), and small values keep their precision."""
    from pagedllm.forward_context import set_forward_context
    from pagedllm.layers.attention import Attention

    batch = _batch()
    layer = Attention(8, 64, batch.scale, 2)
    small = 1e-3  # values this small are E4M3 subnormals at scale 1 (few significant bits)
    t = batch.query.shape[0]
    q, k, v = batch.query.reshape(t, -1), batch.key.reshape(t, -1) * small, batch.value.reshape(t, -1) * small
    layer.kv_cache = torch.zeros_like(batch.kv_cache)
    with set_forward_context(batch.metadata, TorchAttentionBackend()):
        exact = layer(q, k, v).double().view(batch.query.shape)
    full_cache = layer.kv_cache  # the zero prefixes and this step's K/V at full precision
    errors = {}
    for k_scale, v_scale in ((1.0, 1.0), (small, small / 2)):
        layer.kv_cache = torch.zeros_like(batch.kv_cache, dtype=E4M3)
        layer.kv_scales.copy_(torch.tensor([k_scale, v_scale]))
        layer.kv_scale_source = "checkpoint"
        with set_forward_context(batch.metadata, TorchAttentionBackend()):
            out = layer(q, k, v).double().view(batch.query.shape)
        ref, _ = _dense_attention(batch.query, torch.stack([e4m3_round_trip(full_cache[0], k_scale),
                                                            e4m3_round_trip(full_cache[1], v_scale)]),
                                  batch.metadata, batch.scale)
        torch.testing.assert_close(out, ref, atol=1e-9, rtol=1e-5)
        errors[k_scale] = (out - exact).abs()
    # Scaled, K / k_scale and V / v_scale are normal E4M3 numbers: within the rounding bound at those scales (3
    # significant bits). Unscaled, the same values are subnormals with fewer bits, and break that bound.
    bound = rounding_bound(batch.query, full_cache, batch.metadata, batch.scale, (small, small / 2))
    assert (errors[small] <= bound * (1 + 1e-6) + 1e-12).all(), (errors[small] / bound).max()
    print(f"per-layer scales: error at most {(errors[small] / bound).max():.2f} of the bound scaled, "
          f"{(errors[1.0] / bound).max():.1f} unscaled")
    assert (errors[1.0] > bound).any()


TEXT = ("The sea was calm that morning, and the fishermen pushed their boats into the water before the sun rose over "
        "the hills. Paris is the capital of France, and Berlin is the capital of Germany. Write a haiku about the sea. "
        "List three colors: red, green and blue. The quick brown fox jumps over the lazy dog while the children play.")
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "List three colors:"]
BUDGET = 24 << 20
# The FP8 engine against the full-precision one over K/V rounded exactly as the cache rounds them, in the same order
# of operations (Attention.forward's scaled form): the same float32 numbers. Not merely close: a difference of one
# float rounding anywhere is amplified where a K/V value sits at an E4M3 rounding boundary, or an activation at a
# digit boundary of the packed GGUF kernels, into log-probability differences of 1e-2 and more.
ROUND_TRIP_ATOL = 1e-4


@pytest.fixture(scope="module")
def reference(smollm2_gguf_path):
    """A full-precision engine whose attention layers see K/V as an E4M3 cache at state["scales"] (per layer
    (k_scale, v_scale)) gives them back, or unrounded when that is None: attention(k_scale q, E4M3(K / k_scale),
    E4M3(V / v_scale)) * v_scale, as Attention.forward orders a scaled cache's arithmetic. Prefix caching as in
    the FP8 engine, so a prompt's prefill computes the same rows on both (the packed GGUF kernels' rounding can
    depend on how many rows a product has); set_scales forgets the cached blocks, computed under the old state."""
    llm = LLM(model=smollm2_gguf_path, kv_cache_memory_bytes=BUDGET, max_model_len=512, attention_backend="torch")
    state = {"scales": None}

    def set_scales(scales):
        state["scales"] = scales
        assert llm.reset_prefix_cache()
    state["set"] = set_scales
    for i, layer in enumerate(llm.engine.worker.runner.model.attn_layers):
        def rounded(q, k, v, forward=layer.forward, i=i):
            if state["scales"] is None:
                return forward(q, k, v)
            k_scale, v_scale = state["scales"][i]
            if (k_scale, v_scale) == (1.0, 1.0):  # unscaled: no multiplications at all, as in Attention.forward
                return forward(q, e4m3_round_trip(k), e4m3_round_trip(v))
            k8, v8 = e4m3_round_trip(k / k_scale), e4m3_round_trip(v / v_scale)
            return forward(q * k_scale, k8, v8) * v_scale
        layer.forward = rounded
    return llm, state


def _attn_scales(llm) -> list[tuple[float, float]]:
    return [tuple(layer.kv_scales.tolist()) for layer in llm.engine.worker.runner.model.attn_layers]


@pytest.mark.parametrize("scales", ["unscaled", "calibrated"])
def test_engine_fp8_kv_equals_full_precision_over_rounded_kv(smollm2_gguf_path, reference, monkeypatch, scales):
    """Prefill (the paragraph teacher-forced), prefix hits on FP8 blocks and decode (greedy continuations that
    read every earlier token back from the FP8 cache), against the reference over the same rounding."""
    # calibrated: scales from the first step's K/V (the default); unscaled: PAGEDLLM_KV_SCALES=0
    monkeypatch.setenv("PAGEDLLM_KV_SCALES", "1" if scales == "calibrated" else "0")
    ref_llm, state = reference
    fp8 = LLM(model=smollm2_gguf_path, kv_cache_memory_bytes=BUDGET, max_model_len=512, kv_cache_dtype="fp8")
    tok = fp8.get_tokenizer()
    text = tok.encode(TEXT)
    got = teacher_forced(fp8, text)  # the first step: calibrates the scales where asked
    layers = fp8.engine.worker.runner.model.attn_layers
    assert all(layer.kv_scale_source == (None if scales == "unscaled" else "calibrated") for layer in layers)
    state["set"](_attn_scales(fp8))
    assert (state["scales"] == [(1.0, 1.0)] * len(layers)) == (scales == "unscaled")
    try:
        ref = teacher_forced(ref_llm, text)
        errors = [max_logprob_error(a, b) for a, b in zip(got, ref, strict=True)]
        assert max(errors) <= ROUND_TRIP_ATOL, max(errors)
        prompts = [text + tok.encode(" " + p) for p in PROMPTS]  # the paragraph's blocks come from the prefix cache
        hits = fp8.engine.get_stats().prefix_cache_hits
        got_greedy = greedy(fp8, prompts, 24)
        assert fp8.engine.get_stats().prefix_cache_hits > hits
        assert assert_same_greedy(got_greedy, greedy(ref_llm, prompts, 24), ROUND_TRIP_ATOL) == 24 * len(prompts)
    finally:
        state["set"](None)


def test_engine_fp8_kv_error_against_full_precision(smollm2_gguf_path, reference):
    """What the format itself costs: the paragraph's teacher-forced log-probabilities with the FP8 cache against
    the full-precision cache. E4M3 keeps 3 mantissa bits (each K/V value within 2^-4 of itself); how that moves
    a 30-layer model's log-probabilities has no closed form, so the bound is measured (docs/benchmarks.md, "Error
    bounds of the CPU correctness tests"): 1.5x the measured mean. The same cache with one mantissa bit fewer
    (E5M2) doubles the mean, past the bound; an FP8 path that is wrong in itself fails the round-trip test above
    by far more."""
    ref_llm, state = reference
    fp8 = LLM(model=smollm2_gguf_path, kv_cache_memory_bytes=BUDGET, max_model_len=512, kv_cache_dtype="fp8")
    text = fp8.get_tokenizer().encode(TEXT)
    assert state["scales"] is None
    got, ref = teacher_forced(fp8, text), teacher_forced(ref_llm, text)
    err = torch.tensor([abs(a[t].logprob - b[t].logprob) for a, b, t in zip(got, ref, text[1:], strict=True)])
    print(f"fp8 KV vs full precision, {len(err)} tokens: mean |d logprob| {err.mean():.4f}, max {err.max():.3f}")
    assert err.mean() <= 0.1, err
    answer = fp8.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=6),
                          use_tqdm=False)[0].outputs[0].text
    assert "Paris" in answer, answer


def _kv_tokens(caplog) -> int:
    ready = next(r.getMessage() for r in caplog.records if "tokens of KV cache" in r.getMessage())
    return int(re.search(r"= (\d+) tokens of KV cache", ready).group(1))


def test_engine_fp8_kv_capacity(tiny_llama_dir, caplog):
    caplog.set_level("INFO", logger="pagedllm")
    LLM(model=tiny_llama_dir, kv_cache_memory_bytes=1 << 20, max_model_len=256)
    full_tokens = _kv_tokens(caplog)
    caplog.clear()
    LLM(model=tiny_llama_dir, kv_cache_memory_bytes=1 << 20, max_model_len=256, kv_cache_dtype="fp8")
    assert any("KV cache in float8_e4m3fn" in r.getMessage() for r in caplog.records)
    assert _kv_tokens(caplog) == 4 * full_tokens  # fp32 model on the CPU: 4 bytes -> 1 per value


def test_cpu_backend_with_fp8_kv_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="The cpu attention backend cannot use an FP8 KV cache"):
        LLM(model=tiny_llama_dir, kv_cache_dtype="fp8", attention_backend="cpu", kv_cache_memory_bytes=1 << 20)


def test_fp8_write_saturates():
    """Values past E4M3's range are stored as +-448 (torch's own cast would give NaN from 480 on)."""
    from pagedllm.attention.torch_backend import write_kv_cache

    cache = torch.zeros(2, 1, 4, 1, 2, dtype=E4M3)
    key = torch.tensor([[[1000.0, -600.0]], [[1.0, 2.0]]])
    write_kv_cache(key, -key, cache, torch.tensor([0, 1]), 2)
    assert cache[0, 0, 0, 0].float().tolist() == [448.0, -448.0]
    assert cache[1, 0, 0, 0].float().tolist() == [-448.0, 448.0]
    assert not cache.float().isnan().any()


@needs_triton
def test_decode_kernel_fp8_reads_in_triton_interpreter():
    """The decode kernel's fp16 read of an E4M3 cache, V read as 32-bit words or not (paged_attention.FP8_V_WORDS),
    with an output scale, in Triton's interpreter: bit-identical to each other, close to the torch reference."""
    assert "fp8 decode ok" in run_interpreted(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                           "interpret_fp8_decode.py"), timeout=300)
