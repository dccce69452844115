"""Helpers of the LoRA tests: real PEFT adapters made on a model directory, and the transformers + PEFT reference.

Not a test module (pytest collects test_*.py only). Each base model is loaded twice per session at most: once to
make adapters (PEFT injects, saves, and unloads them again) and once under the PeftModel used as the reference.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

_CACHE: dict = {}


def _hf_model(model_dir: str, role: str):
    key = ("model", model_dir, role)
    if key not in _CACHE:
        from transformers import AutoModelForCausalLM

        _CACHE[key] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return _CACHE[key]


def make_adapter(model_dir: str, out_dir: str, *, r: int, alpha: float, targets: Sequence[str], seed: int,
                 use_rslora: bool = False, std: float = 0.05, **extra) -> str:
    """Save a PEFT LoRA adapter for `model_dir` with random non-zero A and B (PEFT initializes B to zero)."""
    from peft import LoraConfig, get_peft_model

    if os.path.isfile(os.path.join(out_dir, "adapter_config.json")):
        return out_dir
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                        use_rslora=use_rslora, bias="none", task_type="CAUSAL_LM", **extra)
    model = get_peft_model(_hf_model(model_dir, "maker"), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(out_dir)
    model.unload()  # the base model is left as it was, for the next adapter
    return out_dir


def _peft_model(model_dir: str, adapter_dir: str):
    """The reference PeftModel of a base, with `adapter_dir` loaded (once) and active."""
    key = ("peft", model_dir)
    names = _CACHE.setdefault(("names", model_dir), {})
    model = _CACHE.get(key)
    if adapter_dir not in names:
        names[adapter_dir] = f"a{len(names)}"
        if model is None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(_hf_model(model_dir, "reference"), adapter_dir,
                                              adapter_name=names[adapter_dir]).eval()
            _CACHE[key] = model
        else:
            model.load_adapter(adapter_dir, adapter_name=names[adapter_dir])
    model.set_adapter(names[adapter_dir])
    return model


def peft_greedy(model_dir: str, adapter_dir: Optional[str], prompt: list[int], max_tokens: int
                ) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from transformers (+ PEFT with `adapter_dir`), with its KV cache."""
    import contextlib

    key = (model_dir, adapter_dir, tuple(prompt), max_tokens)
    if key not in _CACHE:
        if adapter_dir is None:
            model = _CACHE.get(("peft", model_dir)) or _hf_model(model_dir, "reference")
        else:
            model = _peft_model(model_dir, adapter_dir)
        base_only = adapter_dir is None and hasattr(model, "disable_adapter")
        tokens, lps = [], []
        with torch.inference_mode(), (model.disable_adapter() if base_only else contextlib.nullcontext()):
            out = model(input_ids=torch.tensor([prompt]), use_cache=True)
            for _ in range(max_tokens):
                logits = out.logits[0, -1].float()
                tok = int(torch.argmax(logits))
                tokens.append(tok)
                lps.append(float(torch.log_softmax(logits, -1)[tok]))
                out = model(input_ids=torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
        _CACHE[key] = (tokens, lps)
    return _CACHE[key]
