"""vLLM's vllm.distributed clean-up calls, as offline scripts run them between two LLMs (`del llm;
destroy_model_parallel(); destroy_distributed_environment()`): pagedllm's own. LLM.shutdown() already frees an
engine's ranks; in the user's process these reset the (single-rank) groups and end a torch.distributed world only
where one was started."""
from pagedllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel  # noqa: F401
