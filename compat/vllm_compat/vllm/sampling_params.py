from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams  # noqa: F401
from pagedllm.structured_output import GuidedDecodingParams, StructuredOutputsParams  # noqa: F401
