"""The real SmolLM2-135M at 8 bits still answers: a compressed-tensors W8A16 checkpoint (written by the
compressed-tensors library from the fp32 model) and online int8, both on the CPU path, in fp32 activations."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.quantization.checkpoints import ct_checkpoint

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _answer(llm):
    return llm.chat(QUESTION, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)[0].outputs[0].text


@pytest.mark.parametrize("how", ["compressed-tensors-w8a16", "online-int8"])
def test_smollm2_8bit_answers_paris(tmp_path, smollm2_hf_dir, how, caplog):
    caplog.set_level("INFO", logger="pagedllm")
    if how == "online-int8":
        llm = LLM(model=smollm2_hf_dir, dtype="float32", quantization="int8", num_gpu_blocks_override=64,
                  max_model_len=1024)
    else:  # hidden size 576 is not a multiple of 128: one scale per output channel
        model_dir, _ = ct_checkpoint(smollm2_hf_dir, str(tmp_path / "w8a16"), "W8A16", reference=False,
                                     strategy="channel", group_size=None)
        llm = LLM(model=model_dir, dtype="float32", num_gpu_blocks_override=64, max_model_len=1024)
    memory = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Model memory"))
    assert "(120 layers)" in memory, memory  # 30 decoder layers x (qkv, o, gate_up, down)
    answer = _answer(llm)
    assert "Paris" in answer, answer
