from pagedllm.outputs import CompletionOutput, RequestOutput  # noqa: F401
from pagedllm.pooling import (ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput,  # noqa: F401
                              EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput, ScoringOutput,
                              ScoringRequestOutput)
