from pagedllm.sampling_params import SamplingParams  # noqa: F401
