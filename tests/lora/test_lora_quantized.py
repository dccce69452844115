"""LoRA on a quantized base (online int8): the wrappers call the layer's own LinearMethod, so an adapter on the
int8 model gives PEFT's tokens on a transformers model holding the same dequantized weights."""
from __future__ import annotations

import random

import torch

from pagedllm import LLM, LoRARequest, SamplingParams
from tests.lora.lora_helpers import make_adapter


def dequantized_hf_model(llm: LLM, model_dir: str):
    """transformers' model of `model_dir` with every linear weight replaced by the engine's dequantized one."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ours = llm.engine.worker.model
    for i, layer in enumerate(ours.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        target = hf.model.layers[i]
        qkv = attn.qkv_proj.linear_method.dequantized_weight(attn.qkv_proj.base_layer)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size])
        gate, up = mlp.gate_up_proj.linear_method.dequantized_weight(mlp.gate_up_proj.base_layer).chunk(2)
        weights = {target.self_attn.q_proj: q, target.self_attn.k_proj: k, target.self_attn.v_proj: v,
                   target.self_attn.o_proj: attn.o_proj.linear_method.dequantized_weight(attn.o_proj.base_layer),
                   target.mlp.gate_proj: gate, target.mlp.up_proj: up,
                   target.mlp.down_proj: mlp.down_proj.linear_method.dequantized_weight(mlp.down_proj.base_layer)}
        with torch.no_grad():
            for module, w in weights.items():
                module.weight.copy_(w)
    return hf


def test_lora_on_int8_base_matches_peft_on_dequantized_weights(tiny_llama_dir, tmp_path):
    from peft import PeftModel

    adapter = make_adapter(tiny_llama_dir, str(tmp_path / "a"), r=8, alpha=16,
                           targets=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"], seed=5)
    llm = LLM(model=tiny_llama_dir, dtype="float32", quantization="int8", enable_lora=True, max_loras=1,
              max_lora_rank=8, num_gpu_blocks_override=32)
    assert type(llm.engine.worker.model.model.layers[0].self_attn.qkv_proj.linear_method).__name__ == \
        "Int8LinearMethod"
    reference = PeftModel.from_pretrained(dequantized_hf_model(llm, tiny_llama_dir), adapter).eval()
    rng = random.Random(1)
    prompts = [[rng.randrange(2, 512) for _ in range(n)] for n in (6, 15)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                        lora_request=[LoRARequest("a", 1, adapter)] * 2, use_tqdm=False)
    def greedy(prompt: list[int], adapter_on: bool) -> list[int]:
        ids = list(prompt)
        with torch.inference_mode():
            for _ in range(6):
                if adapter_on:
                    logits = reference(input_ids=torch.tensor([ids])).logits
                else:
                    with reference.disable_adapter():
                        logits = reference(input_ids=torch.tensor([ids])).logits
                ids.append(int(logits[0, -1].argmax()))
        return ids[len(prompt):]

    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == greedy(prompt, True)
    assert any(out.outputs[0].token_ids != greedy(p, False) for p, out in zip(prompts, outs))  # the adapter matters
