"""Layer-level checks against transformers' reference functions and against each other."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers.activation import SiluAndMul, get_gated_act_fn
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.rotary_embedding import get_rope, get_rope_parameters
from pagedllm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_hf_and_fuses_residual(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    torch.manual_seed(0)
    x, residual = torch.randn(2, 7, 64, dtype=dtype), torch.randn(2, 7, 64, dtype=dtype)
    ours = RMSNorm(64, eps=1e-5, params_dtype=dtype)
    ours.weight.data.normal_()
    ref = LlamaRMSNorm(64, eps=1e-5).to(dtype)
    ref.weight.data.copy_(ours.weight)
    with torch.no_grad():
        # The plain-torch path is HF's arithmetic exactly; the CPU kernel (ours(x) on 2-D input) sums the
        # squares in another order, so it may differ in the last bit.
        assert torch.equal(ours.forward_native(x), ref(x))
        torch.testing.assert_close(ours(x.view(14, 64)), ref(x).view(14, 64))
        out, new_residual = ours.forward_native(x, residual)
        assert torch.equal(new_residual, residual + x)
        assert torch.equal(out, ref(residual + x))
        out, new_residual = ours(x.view(14, 64), residual.view(14, 64))
        assert torch.equal(new_residual, (residual + x).view(14, 64))
        torch.testing.assert_close(out, ref(residual + x).view(14, 64))


def test_silu_and_mul():
    x = torch.randn(5, 2 * 24)
    assert torch.equal(SiluAndMul.forward_native(x), F.silu(x[:, :24]) * x[:, 24:])
    torch.testing.assert_close(SiluAndMul()(x), F.silu(x[:, :24]) * x[:, 24:])
    assert isinstance(get_gated_act_fn("silu"), SiluAndMul)
    with pytest.raises(ValueError, match="Activation 'relu2' is not supported"):
        get_gated_act_fn("relu2")


@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "linear", "factor": 2.0},
                                          {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
                                          {"rope_type": "yarn", "factor": 4.0,
                                           "original_max_position_embeddings": 128}])
def test_rotary_matches_hf_on_a_flattened_batch(rope_scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                         max_position_embeddings=1024, rope_scaling=rope_scaling)
    head_dim = 64
    rope = get_rope(head_dim, config.max_position_embeddings, get_rope_parameters(config))
    # Three requests laid end to end: a prefill from 0, a decode at 700, a chunk from 37.
    positions = torch.cat([torch.arange(0, 5), torch.tensor([700]), torch.arange(37, 40)])
    q, k = torch.randn(9, 4 * head_dim), torch.randn(9, 2 * head_dim)
    q_out, k_out = rope(positions, q.clone(), k.clone())  # rotated in place on CPU and CUDA
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    q_ref, k_ref = apply_rotary_pos_emb(q.view(1, 9, 4, head_dim).transpose(1, 2),
                                        k.view(1, 9, 2, head_dim).transpose(1, 2), cos, sin)
    torch.testing.assert_close(q_out, q_ref.transpose(1, 2).reshape(9, -1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out, k_ref.transpose(1, 2).reshape(9, -1), atol=1e-5, rtol=1e-5)


def test_rope_parameters_old_and_new_style():
    from types import SimpleNamespace
    old = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    assert get_rope_parameters(old) == {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5,
                                        "partial_rotary_factor": 1.0}
    new = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    assert get_rope_parameters(new)["rope_theta"] == 1e4
    assert get_rope_parameters(SimpleNamespace())["rope_type"] == "default"
    with pytest.raises(ValueError, match="rope_type 'mrope' is not supported"):
        get_rope(64, 128, {"rope_type": "mrope", "rope_theta": 1e4})


@pytest.mark.parametrize("params,field", [({"rope_type": "llama3", "factor": 8.0}, "low_freq_factor"),
                                          ({"rope_type": "linear"}, "factor")])
def test_rope_scaling_without_one_of_its_fields_names_it(params, field):
    with pytest.raises(ValueError, match=rf"rope_type '{params['rope_type']}' needs '{field}' in the config"):
        get_rope(64, 128, {**params, "rope_theta": 1e4})


def test_partial_rotary_leaves_the_tail():
    rope = get_rope(64, 32, {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})
    q, k = torch.randn(3, 128), torch.randn(3, 64)
    q_out, _ = rope(torch.tensor([1, 2, 3]), q.clone(), k.clone())
    assert torch.equal(q_out.view(3, 2, 64)[..., 32:], q.view(3, 2, 64)[..., 32:])
    assert not torch.allclose(q_out.view(3, 2, 64)[..., :32], q.view(3, 2, 64)[..., :32])


def test_qkv_loader_separate_and_fused_agree():
    torch.manual_seed(0)
    hidden, head_dim, heads, kv_heads = 32, 8, 4, 2
    wq, wk, wv = torch.randn(heads * 8, hidden), torch.randn(kv_heads * 8, hidden), torch.randn(kv_heads * 8, hidden)
    bq, bk, bv = torch.randn(heads * 8), torch.randn(kv_heads * 8), torch.randn(kv_heads * 8)
    separate = QKVParallelLinear(hidden, head_dim, heads, kv_heads, bias=True)
    for shard, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
        separate.weight.weight_loader(separate.weight, w, shard)
        separate.bias.weight_loader(separate.bias, b, shard)
    fused = QKVParallelLinear(hidden, head_dim, heads, kv_heads, bias=True)
    fused.weight.weight_loader(fused.weight, torch.cat([wq, wk, wv]))
    fused.bias.weight_loader(fused.bias, torch.cat([bq, bk, bv]))
    x = torch.randn(3, hidden)
    expected = torch.cat([F.linear(x, wq, bq), F.linear(x, wk, bk), F.linear(x, wv, bv)], dim=-1)
    torch.testing.assert_close(separate(x), expected)
    assert torch.equal(separate(x), fused(x))
    with pytest.raises(ValueError, match="shape mismatch"):
        separate.weight.weight_loader(separate.weight, torch.randn(3 * 8, hidden), "k")


def test_merged_and_row_linear():
    gate, up, down = torch.randn(48, 16), torch.randn(48, 16), torch.randn(16, 48)
    merged = MergedColumnParallelLinear(16, [48, 48], bias=False)
    merged.weight.weight_loader(merged.weight, gate, 0)
    merged.weight.weight_loader(merged.weight, up, 1)
    row = RowParallelLinear(48, 16, bias=True)
    row.weight.weight_loader(row.weight, down)
    row.bias.weight_loader(row.bias, torch.ones(16))
    x = torch.randn(4, 16)
    torch.testing.assert_close(merged(x), torch.cat([x @ gate.T, x @ up.T], -1))
    h = torch.randn(4, 48)
    torch.testing.assert_close(row(h), h @ down.T + 1)
    # an unquantized layer's dense weight is its parameter (references, LoRA merging)
    assert merged.linear_method.dequantized_weight(merged) is merged.weight


def test_vocab_padding_is_cut_from_logits():
    embed = VocabParallelEmbedding(100, 8)
    assert embed.num_embeddings_padded == 128 and embed.weight.shape == (128, 8)
    table = torch.randn(100, 8)
    embed.weight.weight_loader(embed.weight, table)
    assert torch.equal(embed.weight[100:], torch.zeros(28, 8))
    ids = torch.tensor([0, 99, 5])
    assert torch.equal(embed(ids), table[ids])
    head = ParallelLMHead(100, 8).tie_weights(embed)
    hidden = torch.randn(2, 8)
    logits = head.compute_logits(hidden)
    assert logits.shape == (2, 100) and logits.dtype == torch.float32 and logits.is_contiguous()
    torch.testing.assert_close(logits, hidden @ table.T)
