"""Helpers of the LoRA tests: real PEFT adapters made on a model directory, and the transformers + PEFT reference.

Not a test module (pytest collects test_*.py only).
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

_CACHE: dict = {}


def make_adapter(model_dir: str, out_dir: str, *, r: int, alpha: float, targets: Sequence[str], seed: int,
                 use_rslora: bool = False, std: float = 0.05, **extra) -> str:
    """Save a PEFT LoRA adapter for `model_dir` with random non-zero A and B (PEFT initializes B to zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if os.path.isfile(os.path.join(out_dir, "adapter_config.json")):
        return out_dir
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                        use_rslora=use_rslora, bias="none", task_type="CAUSAL_LM", **extra)
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(out_dir)
    return out_dir


def peft_model(model_dir: str, adapter_dir: Optional[str]):
    """transformers (fp32) with the adapter applied by PEFT (None: the base model)."""
    key = (model_dir, adapter_dir)
    if key not in _CACHE:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if adapter_dir is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, adapter_dir)
        _CACHE[key] = model.eval()
    return _CACHE[key]


def peft_greedy(model_dir: str, adapter_dir: Optional[str], prompt: list[int], max_tokens: int
                ) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from transformers + PEFT, full forward per step."""
    key = (model_dir, adapter_dir, tuple(prompt), max_tokens)
    if key not in _CACHE:
        model = peft_model(model_dir, adapter_dir)
        ids = list(prompt)
        tokens, lps = [], []
        with torch.inference_mode():
            for _ in range(max_tokens):
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
                tok = int(torch.argmax(logits))
                tokens.append(tok)
                lps.append(float(torch.log_softmax(logits, -1)[tok]))
                ids.append(tok)
        _CACHE[key] = (tokens, lps)
    return _CACHE[key]
