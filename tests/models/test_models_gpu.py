"""Models and layers on CUDA (run on the device: pytest -m gpu tests/models): Triton layer paths against the
plain-torch ones, tiny models against transformers, SmolLM2 in bf16 against transformers."""
from __future__ import annotations

import pytest
import torch

from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.rotary_embedding import get_rope
from pagedllm.layers.activation import SiluAndMul
from pagedllm.models.loader import get_model, load_hf_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _logits(model, ids):
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(ids.shape[0], device=ids.device)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_kernels_match_native(dtype):
    torch.manual_seed(0)
    x, res = torch.randn(37, 576, device="cuda", dtype=dtype), torch.randn(37, 576, device="cuda", dtype=dtype)
    norm = RMSNorm(576, eps=1e-5, params_dtype=dtype).cuda()
    norm.weight.data.normal_()
    torch.testing.assert_close(norm(x), norm.forward_native(x))
    for got, want in zip(norm(x, res), norm.forward_native(x, res)):
        torch.testing.assert_close(got, want)
    gate_up = torch.randn(37, 2 * 1536, device="cuda", dtype=dtype)
    torch.testing.assert_close(SiluAndMul()(gate_up), SiluAndMul.forward_native(gate_up))
    with torch.device("cuda"):
        rope = get_rope(64, 8192, {"rope_type": "default", "rope_theta": 1e5})
    positions = torch.randint(0, 8192, (37,), device="cuda")
    qkv = torch.randn(37, (9 + 3 + 3) * 64, device="cuda", dtype=dtype)
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    want_q, want_k = rope.forward_native(positions, q.clone(), k.clone())
    got_q, got_k = rope(positions, q, k)  # in place on the qkv views
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(got_k, want_k, **tol)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_tiny_models_fp32_on_cuda(tiny_model_dir, arch):
    from transformers import AutoModelForCausalLM
    model_dir = tiny_model_dir(arch)
    ours = get_model(load_hf_config(model_dir), model_dir, dtype=torch.float32, device="cuda")
    assert all(p.device.type == "cuda" for p in ours.parameters())
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, 512, (48,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0]
    out = _logits(ours, ids.cuda()).cpu()
    torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-3)
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


def test_smollm2_bf16_on_cuda(smollm2_hf_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(smollm2_hf_dir)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Name three primary colors."}],
                                        add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = torch.tensor(ids, device="cuda")
    ours = get_model(load_hf_config(smollm2_hf_dir), smollm2_hf_dir, dtype=torch.bfloat16, device="cuda")
    hf32 = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).cuda().eval()
    with torch.inference_mode():
        ref = hf32(ids[None]).logits[0].float()
    out = _logits(ours, ids)
    # bf16 vs fp32 reference: close in value, same top token almost everywhere.
    assert (out - ref).abs().max() < 1.5
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    # Greedy continuation agrees with the fp32 reference for a few tokens.
    seq = ids.clone()
    for _ in range(8):
        nxt = _logits(ours, seq)[-1].argmax().view(1)
        seq = torch.cat([seq, nxt])
    with torch.inference_mode():
        ref_seq = hf32.generate(ids[None], max_new_tokens=8, do_sample=False)[0]
    assert seq[len(ids):len(ids) + 4].tolist() == ref_seq[len(ids):len(ids) + 4].tolist()
