from pagedllm.outputs import CompletionOutput, RequestOutput  # noqa: F401
from pagedllm.pooling import EmbeddingOutput, EmbeddingRequestOutput  # noqa: F401
