"""Structured outputs through the executor: the grammar bitmask travels in the plan to every rank (TP) and the
pipelined engine attaches it to each micro-batch (PP), so the parallel engines give one rank's constrained
tokens, and those obey the grammar."""
from __future__ import annotations

import json

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.structured_output import StructuredOutputsParams

pytestmark = pytest.mark.timeout(240)

_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
           "additionalProperties": False}


def _generate(model_dir: str, **kwargs) -> list[str]:
    llm = LLM(model_dir, device="cpu", dtype="float32", enforce_eager=True, max_model_len=256,
              kv_cache_memory_bytes=64 << 20, **kwargs)
    prompts = ["The capital of France is", "Name a big city:", "Pick a colour."]
    params = [SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(json=_SCHEMA)),
              SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(json=_SCHEMA)),
              SamplingParams(temperature=0.0, max_tokens=8,
                             structured_outputs=StructuredOutputsParams(choice=["red", "green", "blue"]))]
    try:
        return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.engine.shutdown()


def test_structured_outputs_under_tp_and_pp_match_one_rank(smollm2_hf_dir):
    expected = _generate(smollm2_hf_dir)
    for text in expected[:2]:
        assert set(json.loads(text)) == {"city"}
    assert expected[2] in ("red", "green", "blue")
    assert _generate(smollm2_hf_dir, pipeline_parallel_size=2) == expected
    assert _generate(smollm2_hf_dir, tensor_parallel_size=3) == expected
