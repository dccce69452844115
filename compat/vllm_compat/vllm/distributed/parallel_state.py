"""vLLM's vllm.distributed.parallel_state clean-up calls (see vllm.distributed)."""
from pagedllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel  # noqa: F401
