"""Structured outputs: JSON schema / regex / choice / grammar constrained decoding through a grammar library.

  params.py   StructuredOutputsParams (plain data on SamplingParams)
  backend.py  the GrammarBackend / RequestGrammar seam and its registry (xgrammar, guidance)
  manager.py  StructuredOutputManager (engine-core side): asynchronous compiles cached by spec, per-step bitmask
  bitmask.py  applying a packed token bitmask to logits on the device
"""
from pagedllm.structured_output.params import StructuredOutputsParams

GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name

__all__ = ["StructuredOutputsParams", "GuidedDecodingParams"]
