"""Beam search (vLLM's LLM.beam_search / the server's use_beam_search) with transformers' scoring."""
from pagedllm.beam_search.search import BeamSearch, BeamSearchOutput, BeamSearchSequence

__all__ = ["BeamSearch", "BeamSearchOutput", "BeamSearchSequence"]
