"""KVCacheManager: per-request block tables on top of the BlockPool, with prefix caching.

Block i of a request holds the K/V of its tokens [i * block_size, (i + 1) * block_size). A request holds
exactly ceil(tokens with slots / block_size) blocks, so the waste is under one block per sequence.

Prefix caching: request.block_hashes[i] is the chained hash of full block i of request.all_token_ids
(kept up to date here). When a request starts or resumes, get_computed_blocks() finds the longest run of
its leading full blocks already in the pool; allocate_slots() takes references on them and registers
every block that becomes full (given the tokens scheduled so far) so later requests can hit it.

Note for the model runner: blocks are registered when their slots are *allocated*, i.e. before the step
that computes them has run. A request admitted later in the same step can therefore hit a block whose
K/V is written in that same forward pass. This is correct as long as, in every layer, the K/V of all
scheduled tokens is written to the cache before attention reads the cache (the usual order).

Invariants:
  * req_to_blocks[rid][:num_cached_blocks[rid]] have all been offered to the prefix cache;
  * a request never holds the same block twice; ref_cnt == number of requests holding the block.
"""
from __future__ import annotations

from typing import Optional, Sequence

from pagedllm.core.block_hash import extend_block_hashes
from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.partial_blocks import PartialBlockCache
from pagedllm.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, *, block_size: int, num_blocks: int, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}.")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        # Cumulative prefix-cache counters, in tokens (what vLLM exports as prefix_cache_queries/hits).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Finished requests' last partial blocks, offered by copy (beam forks; core/partial_blocks.py).
        self.partial_blocks = PartialBlockCache() if enable_caching else None
        self.block_pool.partial_cache = self.partial_blocks
        self.num_partial_block_copies = 0

    # ---------------------------------------------------------------- queries

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def get_usage(self) -> float:
        return self.block_pool.get_usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def update_block_hashes(self, request: Request) -> None:
        """Hash the request's full blocks that are not hashed yet (no-op when caching is off)."""
        if self.enable_caching:
            extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.lora_id)

    def get_computed_blocks(
        self, request: Request, *, record_stats: bool = True
    ) -> tuple[list[KVCacheBlock], int]:
        """Longest prefix of the request's full blocks found in the cache, and the tokens they cover.

        At most (num_tokens - 1) tokens are reported computed: the last token must always be run
        through the model to produce logits, so a prompt that is an exact multiple of block_size and
        fully cached gives back all its blocks but the last. Does not take references (allocate_slots
        does). record_stats=False lets the caller count the lookup only once it is acted upon.
        """
        if not self.enable_caching:
            return [], 0
        self.update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_computed_tokens = len(hits) * self.block_size
        if record_stats:
            self.record_prefix_cache_lookup(request.num_tokens, num_computed_tokens)
        return hits, num_computed_tokens

    def disable_partial_blocks(self) -> None:
        """Offer no partial blocks (every request recomputes its tokens past its full-block hits)."""
        self.partial_blocks = None
        self.block_pool.partial_cache = None

    def partial_block_hit(self, request: Request, num_hit_tokens: int) -> Optional[tuple[int, int]]:
        """After get_computed_blocks' full-block hits: a remembered partial block whose tokens continue the
        request's (leaving at least its last token to compute), as (source block id, tokens it covers). The caller
        allocates slots for those tokens too and plans the copy into the request's block after its hits."""
        if self.partial_blocks is None or not len(self.partial_blocks) or num_hit_tokens % self.block_size:
            return None
        i = num_hit_tokens // self.block_size
        self.update_block_hashes(request)
        if i > len(request.block_hashes):
            return None
        parent = request.block_hashes[i - 1] if i > 0 else None
        end = min(request.num_tokens - 1, num_hit_tokens + self.block_size - 1)
        hit = self.partial_blocks.lookup(parent, request.lora_id, request.all_token_ids[num_hit_tokens:end])
        return None if hit is None else (hit[0].block_id, hit[1])

    def record_prefix_cache_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_queried_tokens
        self.prefix_cache_hits += num_hit_tokens

    # ---------------------------------------------------------------- mutations

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> Optional[list[int]]:
        """Make room for num_new_tokens more tokens after the request's computed ones.

        new_computed_blocks are prefix-cache hits from get_computed_blocks (only for a request that
        holds no blocks yet); they count as computed tokens ahead of request.num_computed_tokens.
        Returns the block ids appended to the request's block table (hits first, then fresh blocks),
        or None -- changing nothing -- when the pool cannot supply them. Free cached blocks count as
        available: they are evicted on demand.
        """
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is not None and not new_computed_blocks:
            # Fast path (most decode steps): the new tokens fit in the blocks the request already holds.
            num_tokens_with_slots = request.num_computed_tokens + num_new_tokens
            if num_tokens_with_slots <= len(blocks) * self.block_size:
                num_known = min(num_tokens_with_slots, len(request.all_token_ids))
                # Only when a block became full (one decode step in block_size does).
                if self.enable_caching and num_known // self.block_size > self.num_cached_blocks[request.request_id]:
                    self._cache_full_blocks(request, num_known)
                return []
        if new_computed_blocks and blocks:
            raise ValueError("new_computed_blocks is only valid for a request that holds no blocks.")
        blocks = blocks if blocks is not None else []
        num_computed_tokens = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_tokens_with_slots = num_computed_tokens + num_new_tokens
        num_required_blocks = cdiv(num_tokens_with_slots, self.block_size)
        num_new_blocks = max(0, num_required_blocks - len(blocks) - len(new_computed_blocks))
        # Hits sitting in the free queue stop being free once touched.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_evictable_hits > self.block_pool.num_free_blocks:
            return None

        # Touch hits before allocating so allocation cannot evict them.
        self.block_pool.touch(new_computed_blocks)
        fresh = self.block_pool.allocate(num_new_blocks)
        appended = list(new_computed_blocks) + fresh
        blocks.extend(appended)
        self.req_to_blocks[request.request_id] = blocks
        if request.request_id not in self.num_cached_blocks:
            self.num_cached_blocks[request.request_id] = len(new_computed_blocks)

        if self.enable_caching:
            # Blocks full once this step has run; their tokens are all known (no future tokens needed).
            self._cache_full_blocks(request, min(num_tokens_with_slots, request.num_tokens))
        return [b.block_id for b in appended]

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        blocks = self.req_to_blocks[request.request_id]
        start = self.num_cached_blocks[request.request_id]
        end = min(num_tokens // self.block_size, len(blocks))
        if end <= start:
            return
        self.update_block_hashes(request)
        for i in range(start, end):
            self.block_pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = end

    def trim(self, request: Request, num_tokens: int) -> int:
        """Speculative rollback: keep only the blocks that hold the request's first num_tokens slots, freeing the
        rest (they held rejected draft tokens only, never a cached block). Returns the kept block count."""
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is None:
            return 0
        keep = cdiv(num_tokens, self.block_size)
        if keep < len(blocks):
            dropped = blocks[keep:]
            del blocks[keep:]
            self.num_cached_blocks[request.request_id] = min(self.num_cached_blocks[request.request_id], keep)
            self.block_pool.free(reversed(dropped))
        return len(blocks)

    def free(self, request: Request, remember_partial: bool = False) -> None:
        """Release the request's blocks. They are freed tail-first so its last blocks evict first.
        remember_partial (a finished request): its last, partly filled block is offered to later requests."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        partial = self._partial_tail(request, blocks) if remember_partial else None
        self.block_pool.free(reversed(blocks))
        if partial is not None:
            self.partial_blocks.remember(*partial)

    def _partial_tail(self, request: Request, blocks: list[KVCacheBlock]):
        """(block, parent hash, LoRA id, tokens) of the request's last partly filled block of computed tokens."""
        if self.partial_blocks is None:
            return None
        computed = min(request.num_computed_tokens, request.num_tokens)
        i, m = divmod(computed, self.block_size)
        if m == 0 or i >= len(blocks) or blocks[i].ref_cnt != 1 or blocks[i].block_hash is not None:
            return None
        self.update_block_hashes(request)
        parent = request.block_hashes[i - 1] if i > 0 else None
        start = i * self.block_size
        return blocks[i], parent, request.lora_id, tuple(request.all_token_ids[start:computed])

    def reset_prefix_cache(self) -> bool:
        done = self.block_pool.reset_prefix_cache()
        if done and self.partial_blocks is not None:
            self.partial_blocks.clear()
        return done
