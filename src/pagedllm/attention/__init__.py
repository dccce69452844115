"""Attention backends: how one layer writes new K/V into the paged cache and attends over it."""
from pagedllm.attention.backend import AttentionBackend, get_attention_backend

__all__ = ["AttentionBackend", "get_attention_backend"]
