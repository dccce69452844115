"""BlockPool: the KV-cache blocks, their reference counts, the free queue and the prefix-cache map.

Every one of the `num_blocks` blocks (ids 0..num_blocks-1, none reserved) is either
  * in use: ref_cnt > 0, held by that many requests, not in the free queue; or
  * free: ref_cnt == 0, in the free queue. A free block may still be *cached* (block_hash set and
    registered in the hash map): its K/V stays valid until the block is handed out again, so a new
    request with the same prefix can take it back ("touch") instead of recomputing it.

The free queue is in eviction order: allocation takes from the head, freed blocks go to the tail, so
the least recently freed cached block is evicted first (LRU). A freed request's blocks are appended
tail-first (see KVCacheManager.free), so its last blocks -- the least likely to be shared -- go first.

`block_states` holds one byte per block, kept up to date by the operations below, so a snapshot of the pool (the
dashboard's grid) is a copy of it instead of a walk over the blocks: FREE (ref_cnt 0, nothing cached), CACHED (ref_cnt
0, a cached prefix: evictable), USED (one request), SHARED (several requests). It costs one byte store per block in
loops the operations run anyway, paid for by running those loops without a method call per block
(benchmarks/block_pool_ops.py; numbers in docs/benchmarks.md).

Invariants:
  * block in free queue  <=>  block.ref_cnt == 0
  * cached_blocks[h] is b  =>  b.block_hash == h; a block with a block_hash is in cached_blocks
  * at most one block per hash is registered (a duplicate computed concurrently stays uncached)
"""
from __future__ import annotations

from typing import Iterable, Optional

from pagedllm.core.block_hash import BlockHash

# block_states values
FREE, CACHED, USED, SHARED = 0, 1, 2, 3


class KVCacheBlock:
    """One block of the paged KV cache (metadata only; the tensors live in the runner)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[BlockHash] = None
        # Links of the doubly-linked free queue (None when not in it, or at an end).
        self.prev_free: Optional[KVCacheBlock] = None
        self.next_free: Optional[KVCacheBlock] = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly-linked list of free blocks with O(1) popleft, append and remove-from-the-middle.

    Two sentinel nodes bound the list so no operation special-cases an empty queue or an end.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinel before the first free block
        self._tail = KVCacheBlock(-1)  # sentinel after the last free block
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("No free blocks left.")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """The first n free blocks, head first, unlinked in one pass (the head is relinked once, not per block)."""
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot take {n} blocks: only {self.num_free_blocks} free.")
        out = []
        node = self._head.next_free
        for _ in range(n):
            out.append(node)
            nxt = node.next_free
            node.prev_free = node.next_free = None
            node = nxt
        self._head.next_free = node
        node.prev_free = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"Block {block.block_id} is not in the free queue.")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Ids head (next evicted) to tail; for tests and debugging."""
        ids = []
        node = self._head.next_free
        while node is not self._tail:
            ids.append(node.block_id)
            node = node.next_free
        return ids


class BlockPool:
    """Owns all blocks; hands them out, takes them back, and keeps the hash -> cached block map."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.block_states = bytearray(num_blocks)  # all FREE
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        # core/partial_blocks.PartialBlockCache (set by the KV manager): free blocks it remembers are forgotten
        # when handed out again.
        self.partial_cache = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt == 0, including cached ones that would be evicted on demand."""
        return self.free_block_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks held by at least one request (0..1)."""
        return self.num_used_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> Optional[KVCacheBlock]:
        return self.cached_blocks.get(block_hash)

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take num_blocks blocks from the head of the free queue, evicting their cached contents."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"Cannot allocate {num_blocks} blocks: only {self.num_free_blocks} free.")
        if num_blocks == 0:
            return []
        out = self.free_block_queue.popleft_n(num_blocks)
        states, partial, cached = self.block_states, self.partial_cache, self.cached_blocks
        for block in out:
            # evicted: its partial-block entry and its cached hash stop being offered
            if partial is not None:
                partial.evict(block)
            if block.block_hash is not None:
                del cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            states[block.block_id] = USED
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each block (prefix-cache hit), pulling free ones out of the free queue."""
        states = self.block_states
        n = 0
        try:
            for block in blocks:
                ref = block.ref_cnt
                if ref == 0:
                    # removed from the free queue (FreeBlockQueue.remove, unlinked here: no call per block)
                    prev, nxt = block.prev_free, block.next_free
                    if prev is None or nxt is None:
                        raise ValueError(f"Block {block.block_id} is not in the free queue.")
                    prev.next_free = nxt
                    nxt.prev_free = prev
                    block.prev_free = block.next_free = None
                    n += 1
                    states[block.block_id] = USED
                elif ref == 1:
                    states[block.block_id] = SHARED
                block.ref_cnt = ref + 1
        finally:
            if n:
                self.free_block_queue.num_free_blocks -= n

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the order given; blocks reaching 0 join the tail."""
        states = self.block_states
        queue = self.free_block_queue
        tail = queue._tail
        last = tail.prev_free
        n = 0
        try:
            for block in blocks:
                ref = block.ref_cnt - 1
                if ref < 0:
                    raise ValueError(f"Block {block.block_id} freed more often than allocated.")
                block.ref_cnt = ref
                if ref == 0:
                    # appended to the free queue (FreeBlockQueue.append, linked here: no call per block)
                    last.next_free = block
                    block.prev_free = last
                    last = block
                    n += 1
                    states[block.block_id] = FREE if block.block_hash is None else CACHED
                elif ref == 1:
                    states[block.block_id] = USED
        finally:
            if n:
                last.next_free = tail
                tail.prev_free = last
                queue.num_free_blocks += n

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Register a now-full, in-use block under block_hash; False if caching is off or it is taken.

        When another block already holds the hash (two requests computed the same prefix at once),
        the first one stays the cached copy and this one stays a plain block, freed like any other.
        """
        if not self.enable_caching or block_hash in self.cached_blocks:
            return False
        if block.block_hash is not None:
            raise ValueError(f"Block {block.block_id} is already cached.")
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Only allowed while no block is in use (else returns False),
        so no running request holds a block whose cached status would silently change."""
        if self.num_used_blocks > 0:
            return False
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        self.block_states[:] = bytes(self.num_blocks)  # no block in use: all FREE
        return True
