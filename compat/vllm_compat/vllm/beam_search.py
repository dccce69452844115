from pagedllm.beam_search.search import BeamSearchOutput, BeamSearchSequence  # noqa: F401
