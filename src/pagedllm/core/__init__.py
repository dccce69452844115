"""Pure-Python engine core: requests, block pool, KV cache manager, scheduler. Never imports torch."""
