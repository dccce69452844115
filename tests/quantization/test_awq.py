"""AWQ (AutoAWQ GEMM layout) checkpoints: our loader + CPU path reproduce AutoAWQ's own dequantization."""
from __future__ import annotations

import pytest
import torch

from pagedllm.models.loader import load_model
from tests.quantization.checkpoints import awq_checkpoint

PROMPT = torch.randint(2, 512, (40,), generator=torch.Generator().manual_seed(9))


@pytest.mark.parametrize("arch,group_size", [("llama", 32), ("qwen2", 64), ("qwen3", -1)])
def test_awq_logits_match_library_dequantized_reference(tmp_path, caplog, tiny_model_dir, arch, group_size):
    model_dir, reference = awq_checkpoint(tiny_model_dir(arch), str(tmp_path / "awq"), group_size)
    ours, _, _ = load_model(model_dir, dtype=torch.float32)
    assert not [r for r in caplog.records if "Ignoring" in r.getMessage()]  # every AWQ tensor is read
    assert type(ours.model.layers[0].mlp.gate_up_proj.linear_method).__name__ == "AWQLinearMethod"
    with torch.inference_mode():
        got = ours.compute_logits(ours(PROMPT, torch.arange(len(PROMPT))))
        want = reference(PROMPT[None]).logits[0]
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    with torch.inference_mode():  # greedy continuation, token for token
        ids, ref_ids = PROMPT[:12].clone(), PROMPT[:12].clone()
        for _ in range(6):
            ids = torch.cat([ids, ours.compute_logits(ours(ids, torch.arange(len(ids))))[-1].argmax().view(1)])
            ref_ids = torch.cat([ref_ids, reference(ref_ids[None]).logits[0, -1].argmax().view(1)])
    assert ids.tolist() == ref_ids.tolist()


def test_awq_forced_method_on_gptq_checkpoint_is_refused(tmp_path, tiny_model_dir):
    from pagedllm.models.loader import load_hf_config
    from pagedllm.quantization import resolve_quant_config

    model_dir, _ = awq_checkpoint(tiny_model_dir("llama"), str(tmp_path / "awq"), 32)
    with pytest.raises(ValueError, match="--quantization gptq does not match the checkpoint, which is quantized "
                                         "with 'awq'"):
        resolve_quant_config("gptq", load_hf_config(model_dir), model_dir)
    # vLLM's kernel-specific spelling of the same method is accepted
    assert resolve_quant_config("awq_marlin", load_hf_config(model_dir), model_dir).name == "awq"

