"""Quantized models on the GPU: every method's CUDA path (Triton dequant matmul, torch._scaled_mm, _int_mm)
against the same model's CPU path, and the engine with CUDA graphs on a quantized model."""
from __future__ import annotations

import json
import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from pagedllm.models.loader import get_model, load_hf_config  # noqa: E402
from pagedllm.quantization import resolve_quant_config  # noqa: E402

CT_W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
                                                                       "symmetric": False, "strategy": "group",
                                                                       "group_size": 32}}}}
CT_FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
          "config_groups": {"g": {"targets": ["Linear"],
                                  "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                                  "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                        "dynamic": True}}}}
CASES = {
    "gptq-4bit-act-order": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True}, None),
    "gptq-8bit": ({"quant_method": "gptq", "bits": 8, "group_size": -1}, None),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}, None),
    "ct-w4a16": (CT_W4A16, None),
    "ct-fp8": (CT_FP8, None),
    "online-fp8": (None, "fp8"),
    "online-int8": (None, "int8"),
}


def _model_dir(tmp_path, tiny_llama_dir, qc):
    d = tmp_path / "m"
    d.mkdir()
    config = json.load(open(os.path.join(tiny_llama_dir, "config.json")))
    if qc is not None:
        config["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


@pytest.mark.parametrize("case", sorted(CASES))
def test_cuda_path_matches_cpu_path(tmp_path, tiny_llama_dir, case):
    qc, online = CASES[case]
    model_dir = _model_dir(tmp_path, tiny_llama_dir, qc)
    cfg = load_hf_config(model_dir)
    quant = resolve_quant_config(online, cfg, model_dir)
    model = get_model(cfg, model_dir, dtype=torch.bfloat16, device="cpu", load_format="dummy", quant_config=quant)
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = model.compute_logits(model(ids, torch.arange(40))).float()
        model = model.to("cuda")
        for rows in (1, 4):  # the few-row GEMV (split-K) path; 40 rows below: the tensor-core path
            got = model.compute_logits(model(ids[:rows].cuda(), torch.arange(rows, device="cuda"))).float().cpu()
            assert (got - ref[:rows]).abs().max().item() < 0.05 * ref.abs().max().item(), (case, rows)
        got = model.compute_logits(model(ids.cuda(), torch.arange(40, device="cuda"))).float().cpu()
    scale = ref.abs().max().item()
    assert scale > 0 and (got - ref).abs().max().item() < 0.05 * scale, case


def test_engine_cuda_graphs_on_a_quantized_model(tmp_path, tiny_model_dir):
    from pagedllm import LLM, SamplingParams

    from tests.quantization.checkpoints import awq_checkpoint
    model_dir, _ = awq_checkpoint(tiny_model_dir("qwen3"), str(tmp_path / "awq"), 32)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for eager in (True, False):
        llm = LLM(model=model_dir, enforce_eager=eager, gpu_memory_utilization=0.2, max_model_len=512)
        tokens[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    assert tokens[True] == tokens[False]
