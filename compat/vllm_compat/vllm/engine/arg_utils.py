from pagedllm.config import EngineArgs  # noqa: F401
