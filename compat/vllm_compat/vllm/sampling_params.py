from pagedllm.sampling_params import BeamSearchParams, SamplingParams  # noqa: F401
