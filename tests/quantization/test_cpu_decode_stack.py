"""The fused CPU decode stack (models/cpu_decode.py, kernels/csrc/cpu_fused.cpp) against the layer-by-layer
path of the same GGUF-packed model: tiny llama (q/k permuted), qwen2 (qkv biases, tied embeddings), qwen3
(per-head q/k norm, head_dim != hidden / heads), gemma2 (Gemma's layer: (1 + w) norms around attention and MLP,
GeGLU, scaled embeddings, query_pre_attn_scalar, soft-capped attention logits; local and global layers
alternating) and gemma3 (q/k norms, no cap, 5 local : 1 global layers with two rope bases) GGUFs, the Gemmas' local
layers with a window of 12 (one KV-cache group per kind); mixed prompt lengths in one batch, several decoding at
once; the tokens and their logprobs must be the same, and the fused op must have run."""
from __future__ import annotations

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams

# Gemma's tiny GGUFs: a GGUF does not store query_pre_attn_scalar (llama.cpp takes head_dim, 32 here), and a
# window shorter than the prompts so the local layers' mask and block table matter.
_GEMMA_SIZES = {"query_pre_attn_scalar": 32, "sliding_window": 12}


def _write_quantized_gguf(hf_dir: str, path: str, arch: str) -> None:
    from gguf import GGMLQuantizationType as Q

    if arch.startswith("gemma"):
        from tests.models.test_gguf_families import write_family_gguf
        write_family_gguf(hf_dir, path, arch, kinds={
            "attn_q": Q.Q4_0, "attn_k": Q.Q8_0, "attn_v": Q.Q8_0, "attn_output": Q.Q5_1, "ffn_gate": Q.Q4_1,
            "ffn_up": Q.Q4_1, "ffn_down": Q.Q8_0, "token_embd": Q.Q8_0})
        return
    from tests.models.gguf_writer import write_tiny_gguf
    write_tiny_gguf(hf_dir, path, arch, kinds={
        "self_attn.q_proj": Q.Q4_0, "self_attn.k_proj": Q.Q8_0, "self_attn.v_proj": Q.Q8_0,
        "self_attn.o_proj": Q.Q5_1, "mlp.gate_proj": Q.Q4_1, "mlp.up_proj": Q.Q4_1, "mlp.down_proj": Q.Q8_0,
        "token_embd": Q.Q8_0, "output": Q.Q8_0})


def _packed_gguf(tmp_path, tiny_model_dir, arch: str) -> str:
    path = str(tmp_path / f"{arch}.gguf")
    hf_dir = tiny_model_dir(arch, **_GEMMA_SIZES) if arch.startswith("gemma") else tiny_model_dir(arch)
    _write_quantized_gguf(hf_dir, path, arch)
    return path


class _CountingOps:
    def __init__(self, ops):
        self.ops, self.calls = ops, 0

    def decode_stack(self, *args):
        self.calls += 1
        return self.ops.decode_stack(*args)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma2", "gemma3"])
def test_fused_stack_matches_the_layer_by_layer_path(tmp_path, monkeypatch, tiny_model_dir, arch):
    from pagedllm.models.cpu_decode import DecodeStack
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    path = _packed_gguf(tmp_path, tiny_model_dir, arch)
    # max_model_len 64: gemma3's six KV-cache groups (one per layer) need 6 x 8 of the 64 blocks per sequence
    llm = LLM(model=path, num_gpu_blocks_override=64, max_model_len=64, skip_tokenizer_init=True, max_num_seqs=8,
              block_size=8)
    inner = llm.engine.worker.model.model
    attns = [layer.self_attn.attn for layer in inner.layers]
    if arch == "gemma2":  # local and global layers alternate, every layer caps its scores
        assert [a.sliding_window for a in attns] == [12, None] * 2 and {a.logits_soft_cap for a in attns} == {1.0}
        assert llm.engine.scheduler.kv_cache_manager.group_windows == (12, None)
    if arch == "gemma3":  # the local layers' window, their own rope cache and KV-cache group
        assert [a.sliding_window for a in attns] == [12] * 5 + [None]
        assert llm.engine.scheduler.kv_cache_manager.group_windows == (12,) * 5 + (None,)  # one layer per group
        assert inner.layers[0].self_attn.rotary_emb is not inner.layers[5].self_attn.rotary_emb
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 500, n).tolist() for n in (3, 17, 40, 5, 9)]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=2, ignore_eos=True)

    def run():
        # No prefix hits from the run before: a shorter prefill chunk can take another matmul path
        # (dense oneDNN vs packed), whose logprobs differ in the last digits.
        assert llm.engine.reset_prefix_cache()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
                for o in outs]

    fused = run()
    stack = inner.fast_path.stack
    assert isinstance(stack, DecodeStack), "the tiny packed model should qualify for the fused stack"
    counting = stack.ops = _CountingOps(stack.ops)
    assert run() == fused
    assert counting.calls >= 9  # every decode step (<= 5 tokens) went through the one C++ call
    inner.fast_path = None  # the layer-by-layer path
    assert run() == fused


def test_fp32_and_unpacked_models_keep_the_layer_path(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks_override=16, max_model_len=256, skip_tokenizer_init=True)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    path = llm.engine.worker.model.model.fast_path
    assert path is not None, "the loader attaches the decode path to every model built on the CPU"
    assert path.stack is None  # offered, refused: a float model is not packed


def test_fused_stack_with_sliding_windows_and_kv_groups(tmp_path, monkeypatch, tiny_model_dir):
    """A packed qwen2 whose second layer slides (window 12, the first is full: two KV-cache groups, two block
    tables): the fused stack gives the layer path's tokens and logprobs, and the window changes them."""
    import json
    import os

    from pagedllm.models.loader import prepare_model_dir

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tmp_path / "qwen2.gguf")
    _write_quantized_gguf(tiny_model_dir("qwen2"), path, "qwen2")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, 500, n).tolist() for n in (60, 17, 45)]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)

    def run(llm):
        # No prefix hits from the run before: a shorter prefill chunk can take another matmul path
        # (dense oneDNN vs packed), whose logprobs differ in the last digits.
        assert llm.engine.reset_prefix_cache()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
                for o in outs]

    full = run(LLM(model=path, num_gpu_blocks_override=64, skip_tokenizer_init=True, block_size=8))
    converted = prepare_model_dir(path)  # what a GGUF with a window in its metadata converts to
    with open(os.path.join(converted, "config.json")) as f:
        config = json.load(f)
    config.update(use_sliding_window=True, sliding_window=12, max_window_layers=1)
    config.pop("layer_types", None)
    with open(os.path.join(converted, "config.json"), "w") as f:
        json.dump(config, f)
    llm = LLM(model=path, num_gpu_blocks_override=64, max_model_len=256, skip_tokenizer_init=True, block_size=8)
    assert [a.sliding_window for a in llm.engine.worker.model.attn_layers] == [None, 12]
    assert llm.engine.scheduler.kv_cache_manager.group_windows == (None, 12)
    fused = run(llm)
    inner = llm.engine.worker.model.model
    counting = inner.fast_path.stack.ops = _CountingOps(inner.fast_path.stack.ops)
    assert run(llm) == fused and counting.calls >= 11
    inner.fast_path = None
    assert run(llm) == fused
    assert [t for t, _ in fused] != [t for t, _ in full]  # the window matters for these prompts

