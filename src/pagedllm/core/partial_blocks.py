"""PartialBlockCache: a finished request's last, partly filled block, offered to later requests by copy.

The prefix cache shares full blocks only. Beam search forks a sequence every step: each beam's next request is
its parent's tokens plus one, so the parent's full blocks are prefix hits but its last block (up to
block_size - 1 computed tokens) would be recomputed by every child, every step. Here, when a request finishes,
its last partial block stays free but remembered under (hash of the full blocks before it, LoRA id) with the
tokens it holds. A new request whose full-block hits end right before such a block, and whose next tokens start
with the block's tokens, gets a fresh block and a copy of the remembered one (copy-on-write at the fork: every
child writes its own token into the copy at once), planned as `BatchPlan.kv_block_copies` and run by the model
runner before the step's forward.

The remembered block stays in the pool's free queue (it costs no capacity); when the pool hands it out again
it is forgotten (`BlockPool` calls `evict`). A copy planned in a step reads the block before that step's forward
writes anything, and a block handed out in an earlier step is no longer remembered, so the copy always reads
the finished request's K/V.

Pure Python (no torch), like the rest of core/.
"""
from __future__ import annotations

from typing import Optional

from pagedllm.core.block_pool import KVCacheBlock

# Most remembered blocks per (parent hash, LoRA id) key: beams of one prompt share a key when they differ
# inside the partial block; older entries are dropped first.
MAX_PER_KEY = 64


class PartialBlockCache:
    def __init__(self) -> None:
        # key -> {token tuple: block}; insertion order = age
        self._entries: dict[tuple, dict[tuple, KVCacheBlock]] = {}
        self._key_of: dict[int, tuple[tuple, tuple]] = {}  # block id -> (key, tokens)

    def __len__(self) -> int:
        return len(self._key_of)

    def remember(self, block: KVCacheBlock, parent_hash, lora_id: Optional[int], tokens: tuple) -> None:
        """A freed request's last block holding `tokens` (its first len(tokens) slots, all computed) after the
        full blocks whose last chained hash is parent_hash (None: the block is the request's first)."""
        if not tokens:
            return
        self.evict(block)
        key = (parent_hash, lora_id)
        entries = self._entries.setdefault(key, {})
        old = entries.pop(tokens, None)
        if old is not None:
            del self._key_of[old.block_id]
        entries[tokens] = block
        self._key_of[block.block_id] = (key, tokens)
        while len(entries) > MAX_PER_KEY:
            oldest = next(iter(entries))
            self._key_of.pop(entries.pop(oldest).block_id)

    def evict(self, block: KVCacheBlock) -> None:
        """The pool hands the block out again (or it is freed anew): its contents stop being offered."""
        entry = self._key_of.pop(block.block_id, None)
        if entry is None:
            return
        key, tokens = entry
        entries = self._entries[key]
        entries.pop(tokens, None)
        if not entries:
            del self._entries[key]

    def lookup(self, parent_hash, lora_id: Optional[int], next_tokens: list[int]) -> Optional[tuple[KVCacheBlock, int]]:
        """The remembered block whose tokens are the longest prefix of next_tokens, and its token count."""
        entries = self._entries.get((parent_hash, lora_id))
        if not entries:
            return None
        best = None
        for tokens, block in entries.items():
            n = len(tokens)
            if n <= len(next_tokens) and (best is None or n > best[1]) and tuple(next_tokens[:n]) == tokens:
                best = (block, n)
        return best

    def clear(self) -> None:
        self._entries.clear()
        self._key_of.clear()
