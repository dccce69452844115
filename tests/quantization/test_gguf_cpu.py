"""SmolLM2's Q4_1 GGUF kept packed on CPU (quantization/gguf.py) against the same file dequantized by the `gguf`
package to fp32 (dequantize-then-fp32-matmul): memory; log-probabilities within the error of the kernels'
activation quantization, prefill and decode; greedy tokens identical up to a near-tie; the France answer; mixed
batches, prefix hits and preemption; the flags; and a tiny llama GGUF with mixed block types (Q/K permutation,
fused parts of different types, an F16 tensor left dequantized, an untied LM head) against its dequantized twin."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.quantization.logprob_checks import assert_same_greedy, greedy, max_logprob_error, teacher_forced

TEXTS = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea.\nThe sea",
         "Once upon a time, in a small village at the edge of a great forest, there lived an old",
         "The three primary colors are", "import numpy as np\n\n# compute the mean of", "Dear Sir or Madam,",
         "Water boils at a temperature of"]
MAX_TOKENS = 16
# The packed kernels give each activation row two int8 digits per 32-block (error <= amax / 127 / 512 per value,
# ~1.5e-5 of the block's largest) and sum in another order than torch's fp32 GEMM. Through SmolLM2's 30 layers that
# moves a log-probability by a few 1e-3 nat at most (docs/benchmarks.md, "Error bounds of the CPU correctness
# tests"): the bound is that with 2.5x room. Activations with one int8 digit, a dropped block scale or min, or a
# sign flip miss it by far.
LOGPROB_ATOL = 1e-2


@pytest.fixture(scope="module")
def engines(smollm2_gguf_path, smollm2_cache_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_CACHE_DIR", smollm2_cache_dir)
        packed = LLM(model=smollm2_gguf_path, dtype="float32", num_gpu_blocks_override=256, max_model_len=4096)
        dense = LLM(model=smollm2_gguf_path, dtype="float32", quantization="none", num_gpu_blocks_override=256,
                    max_model_len=4096)
    return packed, dense


def test_weights_stay_packed_at_about_the_file_size(engines, smollm2_gguf_path):
    from pagedllm.quantization.gguf import GGUFLinearMethod, packed_weight_bytes
    packed, dense = engines
    model = packed.engine.worker.model
    assert packed.engine.worker.quant_config.name == "gguf" and dense.engine.worker.quant_config is None
    linears = [m for m in model.modules() if hasattr(m, "linear_method")]
    assert linears and all(isinstance(m.linear_method, GGUFLinearMethod) for m in linears)
    # Q8_0, shared with the tied LM head; regrouped into the layout this machine's kernels read fastest
    assert model.model.embed_tokens.__dict__["gguf_type"] == tiled_id(8)
    assert all(t == tiled_id(3) for m in linears for t in m.__dict__["_gguf_types"])  # Q4_1
    packed_bytes, float_bytes = packed_weight_bytes(model)
    size = os.path.getsize(smollm2_gguf_path)
    assert 0.9 * size <= packed_bytes + float_bytes <= 1.02 * size
    dense_bytes = sum(p.numel() * p.element_size() for p in dense.engine.worker.model.parameters())
    assert dense_bytes > 5 * (packed_bytes + float_bytes)


def test_logprobs_within_the_activation_rounding_of_fp32(engines):
    """The prefill path (many rows at once, the text teacher-forced) and the decode path (one row per step, greedy)."""
    packed, dense = engines
    tok = packed.get_tokenizer()
    ids = tok.encode(" ".join(TEXTS) * 2)
    errors = [max_logprob_error(a, b) for a, b in zip(teacher_forced(packed, ids), teacher_forced(dense, ids))]
    print(f"\nteacher-forced |d logprob|, packed Q4_1 vs dequantized fp32, {len(ids)} tokens: max {max(errors):.2e}")
    assert len(errors) == len(ids) - 1 and max(errors) <= LOGPROB_ATOL, max(errors)
    prompts = [tok.encode(t) for t in TEXTS]
    got, ref = greedy(packed, prompts, MAX_TOKENS), greedy(dense, prompts, MAX_TOKENS)
    compared = assert_same_greedy(got, ref, LOGPROB_ATOL)
    print(f"greedy: {compared} of {len(prompts) * MAX_TOKENS} positions compared (the rest follow a near-tie)")


def test_answers_paris(engines):
    chat = engines[0].chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    assert "Paris" in chat[0].outputs[0].text


def test_mixed_batch_prefix_hits_and_preemption(engines, smollm2_gguf_path, smollm2_cache_dir, monkeypatch):
    packed, dense = engines
    tok = packed.get_tokenizer()
    shared = tok.encode("You are a helpful assistant. Answer briefly and precisely, in one sentence. " * 2)
    prompts = [shared + tok.encode(t) for t in TEXTS[:4]]
    ref = greedy(dense, prompts, 12)
    alone = [greedy(packed, [p], 12)[0] for p in prompts]
    before = packed.engine.get_stats().prefix_cache_hits
    mixed = greedy(packed, prompts, 12)  # one batch of mixed lengths, the shared prefix from the cache
    assert packed.engine.get_stats().prefix_cache_hits > before
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", smollm2_cache_dir)
    # 10 blocks of 8 tokens cannot hold 4 requests growing to ~45 tokens each: the newest get preempted
    small = LLM(model=smollm2_gguf_path, dtype="float32", num_gpu_blocks_override=10, block_size=8, max_model_len=80,
                enable_prefix_caching=False)
    preempted = greedy(small, prompts, 12)
    assert small.engine.get_stats().num_preemptions > 0
    # Batched rows, cached prefixes and recomputed requests change the kernels' row counts and summation order,
    # never the numbers beyond the activation rounding: each is held to the same bound as a request alone.
    for name, run in (("alone", alone), ("mixed", mixed), ("preempted", preempted)):
        print(f"{name}: {assert_same_greedy(run, ref, LOGPROB_ATOL)} of {4 * 12} positions compared")
    assert_same_greedy(mixed, alone, LOGPROB_ATOL)
    assert_same_greedy(preempted, alone, LOGPROB_ATOL)


def test_flags(engines, tiny_llama_dir):
    with pytest.raises(ValueError, match="needs a .gguf model"):
        LLM(model=tiny_llama_dir, quantization="gguf", num_gpu_blocks_override=16)
    with pytest.raises(ValueError, match="dummy"):
        LLM(model=engines[0].engine.worker.model_dir, quantization="gguf", load_format="dummy",
            num_gpu_blocks_override=16)
    # a Hugging Face dir: float weights by default
    fp = LLM(model=tiny_llama_dir, num_gpu_blocks_override=16, max_model_len=256)
    assert fp.engine.worker.quant_config is None


# ----------------------------------------------------------------------------- a tiny GGUF of mixed types

def tiled_id(qtype: int, rows: int = 16) -> int:
    """The type id a packed tensor of qtype (rows output rows) has after loading: the layout this machine's
    kernels read fastest where they have one for it (AVX-512 VNNI: 16-row tiles; AVX2: the row layout of Q4_0,
    Q4_1, Q8_0, Q4_K and Q6_K)."""
    from pagedllm import envs
    from pagedllm.kernels.cpu_ops import cpu_ops
    from pagedllm.kernels.gguf_ops import A2_BASE, TILED_BASE
    best = cpu_ops().gguf_best_impl()
    if not envs.PAGEDLLM_GGUF_TILED:
        return qtype
    if best == 1 and qtype in (2, 3, 8, 12, 14):
        return A2_BASE + qtype
    return TILED_BASE + qtype if best == 2 and rows % 16 == 0 else qtype


def _write_mixed_gguf(hf_dir: str, path: str) -> None:
    """The tiny llama (untied LM head) as a GGUF whose tensors use several block types, q/k permuted the way
    llama.cpp's converter does; ffn_up stays F16 (no packed kernel: dequantized at load). The LM head is Q8_0
    (gguf has no Q6_K quantizer), still packed."""
    import gguf

    from tests.models.gguf_writer import write_tiny_gguf
    Q = gguf.GGMLQuantizationType
    write_tiny_gguf(hf_dir, path, "llama", kinds={
        "self_attn.q_proj": Q.Q4_0, "self_attn.k_proj": Q.Q5_1, "self_attn.v_proj": Q.Q8_0,
        "self_attn.o_proj": Q.Q5_0, "mlp.gate_proj": Q.Q4_1, "mlp.up_proj": Q.F16, "mlp.down_proj": Q.Q8_0,
        "token_embd": Q.Q8_0, "output": Q.Q8_0})


def test_tiny_mixed_type_gguf_matches_its_dequantized_twin(tmp_path, monkeypatch, tiny_model_dir, caplog):
    from pagedllm.quantization.gguf import GGUFLinearMethod
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    hf_dir = tiny_model_dir("llama", tie_word_embeddings=False)
    path = str(tmp_path / "mixed.gguf")
    _write_mixed_gguf(hf_dir, path)
    with caplog.at_level("INFO", logger="pagedllm"):
        packed = LLM(model=path, num_gpu_blocks_override=64, skip_tokenizer_init=True)
    assert any("F16" in r.getMessage() and "dequantized" in r.getMessage() for r in caplog.records)
    dense = LLM(model=path, quantization="none", num_gpu_blocks_override=64, skip_tokenizer_init=True)
    layer = packed.engine.worker.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.linear_method, GGUFLinearMethod)
    qkv_types = [2, 7, 8]  # Q4_0 | Q5_1 | Q8_0 side by side (tiled where a part's rows are a multiple of 16)
    qkv_rows = layer.self_attn.qkv_proj.output_partition_sizes
    assert layer.self_attn.qkv_proj.__dict__["_gguf_types"] == [
        tiled_id(t, r) for t, r in zip(qkv_types, qkv_rows)]
    assert not isinstance(layer.mlp.gate_up_proj.linear_method, GGUFLinearMethod)  # up is F16
    assert "gguf_type" in packed.engine.worker.model.lm_head.__dict__
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 500, n).tolist() for n in (3, 17, 40)]
    bf16 = LLM(model=path, dtype="bfloat16", num_gpu_blocks_override=64, skip_tokenizer_init=True)
    assert bf16.engine.worker.quant_config.name == "gguf"
    out = bf16.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)
    for llm_a, llm_b in ((packed, dense),):
        a = llm_a.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=6, logprobs=0, ignore_eos=True), use_tqdm=False)
        b = llm_b.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=6, logprobs=0, ignore_eos=True), use_tqdm=False)
        for x, y in zip(a, b):
            assert x.outputs[0].token_ids == y.outputs[0].token_ids
            lx = [x.outputs[0].logprobs[i][t].logprob for i, t in enumerate(x.outputs[0].token_ids)]
            ly = [y.outputs[0].logprobs[i][t].logprob for i, t in enumerate(y.outputs[0].token_ids)]
            torch.testing.assert_close(torch.tensor(lx), torch.tensor(ly), atol=2e-3, rtol=0)


def _kquant_blocks(data: np.ndarray, qtype) -> np.ndarray:
    """Valid blocks of a K-quant type (gguf has no quantizer for them) holding random, roughly zero-mean weights
    of about the tiny model's scale: random quants; Q4_K / Q5_K with one 4-bit sub-block scale a per
    super-block (all sub-blocks alike) and min 15 with dmin = d a mean(q) / 15 (centred); Q6_K with random int8
    sub-scales (its quants are centred by the format's -32). Seeded by the tensor's shape."""
    from gguf import GGMLQuantizationType as Q
    from gguf.constants import GGML_QUANT_SIZES
    rows, k = data.shape
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(rows * 7919 + k)
    blocks = rng.integers(0, 256, (rows, k // elems, nbytes), dtype=np.uint8)
    if qtype == Q.Q6_K:
        d = (rng.random((rows, k // elems)) * 2e-5 + 2e-5).astype(np.float16)
        blocks[..., 208:210] = d[..., None].view(np.uint8)
        return blocks.reshape(rows, -1)
    a = rng.integers(4, 16, (rows, k // elems)).astype(np.uint8)
    blocks[..., 4:8] = a[..., None]                                    # sc = a for sub-blocks 0-3
    blocks[..., 8:12] = 15                                             # mn = 15 for sub-blocks 0-3
    blocks[..., 12:16] = (a[..., None] & 0xF) | (15 << 4)              # sub-blocks 4-7: sc = a, mn = 15
    d = rng.random((rows, k // elems)) * 1e-3 + 1e-3
    mean_q = 7.5 if qtype == Q.Q4_K else 15.5
    dmin = d * a * mean_q / 15
    blocks[..., 0:2] = d.astype(np.float16)[..., None].view(np.uint8)
    blocks[..., 2:4] = dmin.astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def test_kquant_gguf_tiled_matches_its_dequantized_twin(tmp_path, monkeypatch):
    """A Q4_K_M-like file (Q4_K, Q5_K and Q6_K layers, a Q6_K LM head): its tensors load tiled, and greedy
    tokens and logprobs match the same file dequantized to fp32, through prefill, batched and fused decode."""
    import gguf

    from tests.conftest import save_tiny_model, tiny_hf_config
    from tests.models.gguf_writer import write_tiny_gguf
    Q = gguf.GGMLQuantizationType
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    cfg = tiny_hf_config("llama", tie_word_embeddings=False)
    cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim = 256, 512, 512, 64  # K-quants: rows of 256
    hf_dir = save_tiny_model(str(tmp_path / "hf"), cfg)
    path = str(tmp_path / "kquant.gguf")
    kinds = {"self_attn.q_proj": Q.Q4_K, "self_attn.k_proj": Q.Q4_K, "self_attn.v_proj": Q.Q6_K,
             "self_attn.o_proj": Q.Q4_K, "mlp.gate_proj": Q.Q4_K, "mlp.up_proj": Q.Q5_K, "mlp.down_proj": Q.Q6_K,
             "token_embd": Q.Q4_K, "output": Q.Q6_K}
    write_tiny_gguf(hf_dir, path, "llama", kinds=kinds, quantizer=_kquant_blocks)
    packed = LLM(model=path, num_gpu_blocks_override=64, skip_tokenizer_init=True)
    dense = LLM(model=path, quantization="none", num_gpu_blocks_override=64, skip_tokenizer_init=True)
    model = packed.engine.worker.model
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.__dict__["_gguf_types"] == [tiled_id(12), tiled_id(14)]  # q+k | v
    assert layer.mlp.gate_up_proj.__dict__["_gguf_types"] == [tiled_id(12), tiled_id(13)]
    assert layer.mlp.down_proj.__dict__["_gguf_types"] == [tiled_id(14)]
    assert model.lm_head.__dict__["gguf_type"] == tiled_id(14)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, 500, n).tolist() for n in (5, 23, 60)]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True)
    a = packed.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    b = dense.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert len({t for x in a for t in x.outputs[0].token_ids}) > 3  # a live model, not a constant one
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        lx = [x.outputs[0].logprobs[i][t].logprob for i, t in enumerate(x.outputs[0].token_ids)]
        ly = [y.outputs[0].logprobs[i][t].logprob for i, t in enumerate(y.outputs[0].token_ids)]
        torch.testing.assert_close(torch.tensor(lx), torch.tensor(ly), atol=2e-3, rtol=0)


def test_online_int8_on_cpu_runs_on_the_integer_kernels(tiny_llama_dir):
    from pagedllm.models.loader import load_model
    model, _, _ = load_model(tiny_llama_dir, dtype=torch.float32, quantization="int8")
    from pagedllm.quantization.int8 import quantize_per_channel_int8
    down = model.model.layers[0].mlp.down_proj
    rows = down.w8a8_rows
    n, k = down.__dict__["w8a8_shape"]
    assert rows.dtype == torch.uint8 and rows.numel() == n * (k + 4)  # one copy in RAM: [scale | K int8] per row
    if down.__dict__["w8a8_type"] == tiled_id(1000) != 1000:  # regrouped into the VNNI kernels' tiles
        assert rows.shape == (n // 16, 16 * (k + 4)) and down.weight.numel() == 0
    else:
        assert rows.shape == (n, k + 4) and down.weight.data_ptr() == rows.data_ptr() + 4  # weight: a view
    # The reference: the checkpoint's float weight quantized the same way.
    from safetensors.torch import load_file
    import os
    w = load_file(os.path.join(tiny_llama_dir, "model.safetensors"))["model.layers.0.mlp.down_proj.weight"]
    q, scale = quantize_per_channel_int8(w)
    dequantized = q.float() * scale[:, None]
    assert torch.equal(down.linear_method.dequantized_weight(down), dequantized)
    for m in (1, 3, 17):
        x = torch.randn(m, k)
        torch.testing.assert_close(down(x), x @ dequantized.T, atol=1e-4, rtol=1e-3)


def test_online_int8_layer_leaves_the_cpu_kernels_with_the_same_values(tiny_llama_dir):
    """A model quantized on the CPU (rows or tiles of the integer kernels) and then moved elsewhere rebuilds that
    device's layout from the very same int8 values and scales (on CUDA, tests/gpu/test_quant_gpu.py moves it)."""
    import os

    from safetensors.torch import load_file

    from pagedllm.models.loader import load_model
    from pagedllm.quantization.cpu_w8a8 import w8a8_int8_values
    from pagedllm.quantization.int8 import quantize_per_channel_int8
    model, _, _ = load_model(tiny_llama_dir, dtype=torch.float32, quantization="int8")
    w = load_file(os.path.join(tiny_llama_dir, "model.safetensors"))
    for name in ("mlp.down_proj", "mlp.gate_up_proj", "self_attn.o_proj"):
        layer = model.model.layers[1].get_submodule(name)
        q, scale = w8a8_int8_values(layer)
        if name == "mlp.down_proj":  # the checkpoint's weight quantized the same way
            want_q, want_scale = quantize_per_channel_int8(w["model.layers.1.mlp.down_proj.weight"])
            assert torch.equal(q, want_q) and torch.equal(scale, want_scale)
        x = torch.randn(5, q.shape[1])
        before = x @ layer.linear_method.dequantized_weight(layer).T
        layer.linear_method._leave_cpu_kernels(layer)  # what the first forward after a move does
        assert "w8a8_rows" not in layer._buffers and layer.weight.dtype == torch.int8
        assert torch.equal(layer.weight, q) and torch.equal(layer.weight_scale, scale)
        torch.testing.assert_close(layer(x), before, atol=1e-4, rtol=1e-4)


def test_fast_tensor_index_matches_gguf_reader(smollm2_gguf_path, tmp_path, tiny_model_dir):
    from gguf import GGUFReader

    from pagedllm.models.gguf_packed import read_gguf_index
    mixed = str(tmp_path / "mixed.gguf")
    _write_mixed_gguf(tiny_model_dir("llama", tie_word_embeddings=False), mixed)
    for path in (smollm2_gguf_path, mixed):
        ref, index = GGUFReader(path), read_gguf_index(path)
        assert index.arch == "llama" and len(index.tensors) == len(ref.tensors)
        for a, b in zip(ref.tensors, index.tensors):
            assert (a.name, int(a.tensor_type), a.data.shape, a.data.dtype) == \
                (b.name, b.tensor_type, b.data.shape, b.data.dtype)
            assert np.array_equal(np.asarray(a.data), b.data)
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(open(mixed, "rb").read()[:-100])
    with pytest.raises(ValueError):
        read_gguf_index(str(truncated))


def test_tensor_index_falls_back_to_gguf_reader(smollm2_gguf_path, monkeypatch):
    import pagedllm.models.gguf_packed as gp

    fast = gp.read_gguf_index(smollm2_gguf_path)
    gp._index_cache.clear()

    def unsupported(path):
        raise ValueError("a layout this parser does not handle")

    monkeypatch.setattr(gp, "_parse_index", unsupported)
    slow = gp.read_gguf_index(smollm2_gguf_path)
    gp._index_cache.clear()
    assert slow.arch == fast.arch == "llama"
    assert [(t.name, t.tensor_type, t.data.shape) for t in slow.tensors] == \
        [(t.name, t.tensor_type, t.data.shape) for t in fast.tensors]
