"""Structured outputs on CUDA: the mask on model-dtype logits in the greedy shortcut (argmax kernel) and in the
sampler, CUDA graphs, and async scheduling's overlapped mask fill give schema-valid output and the same tokens as
the synchronous engine."""
from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.gpu

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "color": {"enum": ["red", "green", "blue"]}}, "required": ["name", "age", "color"]}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_masked_greedy_and_sampled_rows_on_cuda_sync_equals_async(tiny_llama_dir: str) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    from pagedllm import LLM, SamplingParams
    from pagedllm.structured_output import StructuredOutputsParams

    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=so),
              SamplingParams(temperature=0.0, max_tokens=12),
              SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=StructuredOutputsParams(
                  choice=["alpha", "beta"])),
              SamplingParams(temperature=0.0, max_tokens=60, logprobs=1, structured_outputs=so)]  # sampler path
    prompts = ["a", "b", "c", "a"]
    results = []
    for async_scheduling in (False, True):
        llm = LLM(model=tiny_llama_dir, dtype="bfloat16", device="cuda", async_scheduling=async_scheduling,
                  num_gpu_blocks_override=64, gpu_memory_utilization=0.3)
        results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        outs = llm.generate(prompts, params, use_tqdm=False)
        jsonschema.validate(json.loads(outs[0].outputs[0].text), SCHEMA)
        assert outs[2].outputs[0].text in ("alpha", "beta")
        assert outs[0].outputs[0].token_ids == outs[3].outputs[0].token_ids  # greedy shortcut == sampler path
        del llm
        torch.cuda.empty_cache()
    assert results[0] == results[1]
