"""Multi-LoRA serving: PEFT adapters loaded lazily into device slots, applied to a mixed batch in one pass.

    request.py   LoRARequest (vLLM's class and fields)
    peft.py      reading + validating a PEFT adapter directory into per-module A/B tensors (host memory)
    layers.py    LoRA-aware wrappers around the model's linear layers (any LinearMethod) and the batched delta
    manager.py   the worker's adapter manager: max_loras device slots, max_cpu_loras host LRU, per-step slots
"""
