"""Model implementations, the architecture registry, and loading (HF safetensors, GGUF, dummy).

Only the registry is imported here (cheap, torch-free); use `pagedllm.models.loader` for loading.
"""
from pagedllm.models.registry import get_model_class, is_supported, register_model, supported_architectures

__all__ = ["get_model_class", "is_supported", "register_model", "supported_architectures"]
