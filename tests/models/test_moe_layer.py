"""The MoE layer on the CPU: its batched expert path against a per-token float64 reference, its routing against
transformers' own router modules, its loaders for every checkpoint layout, and the Triton kernels in Triton's
interpreter (fp32) against their torch references."""
from __future__ import annotations

import os

import pytest
import torch

from pagedllm.layers.fused_moe import FusedMoE, experts_forward_dense, experts_forward_native, route_native
from tests.models.moe_kernel_cases import make_case, per_token_reference
from tests.triton_interpreter import needs_triton, run_interpreted

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (9, 8, 2), (40, 16, 4), (5, 64, 8), (3, 4, 1)])
def test_batched_cpu_path_matches_per_token_reference(tokens, experts, top_k):
    x, w13, w2, logits = make_case(tokens, experts, 48, 40, torch.float32, "cpu", seed=tokens)
    weights, ids = route_native(logits, top_k, renormalize=True)
    out = experts_forward_native(x, w13, w2, weights, ids)
    ref = per_token_reference(x.double(), w13.double(), w2.double(), weights, ids)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    if tokens * top_k < experts:  # some experts got no token: skipped, not run on an empty batch
        assert len(torch.unique(ids)) < experts
    # the sync-free path (CUDA graphs without Triton) computes the same
    torch.testing.assert_close(experts_forward_dense(x, w13, w2, weights, ids), out, atol=1e-5, rtol=1e-5)


def test_prepacked_cpu_experts_match_the_parameters():
    """The worker's oneDNN-prepacked expert copies (pack_cpu_weights, CPU float32) compute what the parameters do,
    and the layer uses them."""
    from pagedllm.layers.linear import pack_cpu_weights

    layer = _layer(experts=8, hidden=64, inter=48)
    layer.gate_up_proj.data.normal_(std=0.1)
    layer.down_proj.data.normal_(std=0.1)
    x, logits = torch.randn(11, 64), torch.randn(11, 8)
    unpacked = layer(x, logits)
    if pack_cpu_weights(layer) == 0:
        pytest.skip("this torch build has no oneDNN linear")
    assert len(layer.__dict__["cpu_packed_experts"][0]) == 8
    assert "cpu_packed_experts" not in layer.state_dict()
    weights, ids = route_native(logits, 2, True)
    packed = experts_forward_native(x, layer.gate_up_proj, layer.down_proj, weights, ids,
                                    layer.__dict__["cpu_packed_experts"])
    torch.testing.assert_close(packed, unpacked, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer(x, logits), packed, atol=0, rtol=0)


def test_batched_cpu_path_bfloat16_close_to_fp32():
    x, w13, w2, logits = make_case(33, 8, 64, 48, torch.float32, "cpu", seed=5)
    weights, ids = route_native(logits, 2, renormalize=True)
    ref = experts_forward_native(x, w13, w2, weights, ids)
    out = experts_forward_native(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe_norm", "qwen3_moe"])
def test_routing_matches_transformers_routers(arch):
    """Same router weight, same hidden states: transformers' router modules pick the same experts with the same
    weights (Mixtral always renormalizes; Qwen3-MoE only with norm_topk_prob)."""
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    if arch == "mixtral":
        router = MixtralTopKRouter(MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2))
        renormalize, top_k = True, 2
    else:
        norm = arch == "qwen3_moe_norm"
        router = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=32, num_experts=16, num_experts_per_tok=4,
                                                   norm_topk_prob=norm))
        renormalize, top_k = norm, 4
    torch.manual_seed(0)
    torch.nn.init.normal_(router.weight, std=0.3)
    hidden = torch.randn(50, 32)
    with torch.no_grad():
        logits, ref_weights, ref_ids = router(hidden)
    weights, ids = route_native(logits, top_k, renormalize)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights.float(), atol=1e-6, rtol=1e-6)
    if not renormalize:
        assert (weights.sum(-1) < 1 - 1e-3).all()  # the raw top-k probabilities really are kept


def _layer(experts=4, hidden=16, inter=12) -> FusedMoE:
    return FusedMoE(experts, 2, hidden, inter, renormalize=True, params_dtype=torch.float32, prefix="mlp.experts")


def test_loader_layouts_fill_the_same_parameters():
    """Per-expert gate/up/down, stacked gate/up/down (GGUF) and transformers 5's fused gate_up all load the
    same stacked [E, 2I, H] / [E, H, I] parameters."""
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(4, 12, 16, generator=g), torch.randn(4, 12, 16, generator=g)
    down = torch.randn(4, 16, 12, generator=g)
    per_expert, stacked, fused = _layer(), _layer(), _layer()
    for e in range(4):
        per_expert.weight_loader(per_expert.gate_up_proj, gate[e], "gate", e)
        per_expert.weight_loader(per_expert.gate_up_proj, up[e], "up", e)
        per_expert.weight_loader(per_expert.down_proj, down[e], "down", e)
    stacked.weight_loader(stacked.gate_up_proj, gate, "gate")
    stacked.weight_loader(stacked.gate_up_proj, up, "up")
    stacked.weight_loader(stacked.down_proj, down, "down")
    fused.weight_loader(fused.gate_up_proj, torch.cat([gate, up], dim=1), "gate_up")
    fused.weight_loader(fused.down_proj, down, "down")
    expected = torch.cat([gate, up], dim=1)
    for layer in (per_expert, stacked, fused):
        assert torch.equal(layer.gate_up_proj, expected) and torch.equal(layer.down_proj, down)
        assert layer.missing_shards() == []


def test_loader_names_missing_and_misshapen_experts():
    layer = _layer()
    for e in (0, 1, 3):
        layer.weight_loader(layer.gate_up_proj, torch.zeros(12, 16), "gate", e)
        layer.weight_loader(layer.gate_up_proj, torch.zeros(12, 16), "up", e)
    layer.weight_loader(layer.down_proj, torch.zeros(4, 16, 12), "down")
    assert layer.missing_shards() == ["expert 2 gate", "expert 2 up"]
    with pytest.raises(ValueError, match=r"shape mismatch: the checkpoint has \(10, 16\), the model expects "
                                         r"\(12, 16\)"):
        layer.weight_loader(layer.gate_up_proj, torch.zeros(10, 16), "gate", 2)
    with pytest.raises(ValueError, match="expected 4 stacked experts"):
        layer.weight_loader(layer.down_proj, torch.zeros(3, 16, 12), "down")
    with pytest.raises(ValueError, match="expert 4 is out of range"):
        layer.weight_loader(layer.down_proj, torch.zeros(16, 12), "down", 4)


def test_tensor_parallel_size_must_divide_the_expert_intermediate_size(monkeypatch):
    import pagedllm.layers.fused_moe as fused_moe

    monkeypatch.setattr(fused_moe, "get_tensor_model_parallel_world_size", lambda: 5)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=5 does not divide the experts' intermediate size "
                                         r"12"):
        _layer()


@needs_triton
def test_kernels_in_triton_interpreter():
    assert "fused moe kernels ok" in run_interpreted(os.path.join(HERE, "interpret_fused_moe.py"))


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_sparse_layers_route_in_their_post_attention_norm(arch):
    """Each sparse layer's post-attention RMSNorm points at its MoE block (on few-row CUDA steps its kernel computes
    the router's logits: models/moe.NORM_ROUTER), by a plain reference: the block stays out of the norm's
    submodules and state dict. Dense layers' norms point at nothing."""
    from pagedllm.models.registry import get_model_class
    from tests.models.moe_helpers import tiny_moe_config

    config = tiny_moe_config(arch)
    model = get_model_class(config)(config)
    kinds = []
    for layer in model.model.layers:
        consumer = layer.post_attention_layernorm.__dict__.get("shrink_consumer")
        sparse = type(layer.mlp).__name__ == "SparseMoeBlock"
        assert consumer is (layer.mlp if sparse else None)
        assert not list(layer.post_attention_layernorm.children())
        kinds.append(sparse)
    assert any(kinds)
    assert not any(".post_attention_layernorm.shrink_consumer" in name for name in model.state_dict())
