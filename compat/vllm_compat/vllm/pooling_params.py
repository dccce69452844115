"""vLLM's vllm.pooling_params, forwarded to pagedllm."""
from pagedllm.pooling import PoolingParams  # noqa: F401
