from pagedllm.outputs import CompletionOutput, RequestOutput  # noqa: F401
from pagedllm.pooling import EmbeddingOutput, EmbeddingRequestOutput, ScoringOutput, ScoringRequestOutput  # noqa: F401
