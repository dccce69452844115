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

Sliding windows (core/kv_cache_groups.py): a request holds one block list per KV-cache group (one group unless
the model mixes windows; `req_to_blocks` is group 0's), all the same length, drawn from one pool. In a group with
a sliding window W, a step whose first query sits at position c (the request's computed count) sees no key
before c - W + 1, and no later step does (the computed count only grows, a speculative rollback never goes back
past the step it rolls back, preemption frees everything): the blocks wholly before that position are freed
(`allocate_slots`, before it allocates) and their entries become None, so positions keep indexing the list.
The runner's table keeps the old ids there (NULL_BLOCK_ID for a hit it never held): the backends never read a
block before a row's window. A long sequence on sliding layers thus holds about W / block_size + 2 blocks.

Freed out-of-window blocks stay cached (hash kept, evictable) like any freed block: their K/V are the prefix's.
A prefix hit of M blocks needs, in each sliding group, only the blocks the first computed position sees
(those from (M * block_size - W + 1) // block_size on); the earlier entries of the hit are None. A block whose
content the pool has handed out again lost its hash when it was handed out, so it can never be a hit.

Invariants:
  * req_to_blocks[rid][:num_cached_blocks[rid]] have all been offered to the prefix cache (None entries aside);
  * a request never holds the same block twice; ref_cnt == number of requests holding the block (in any group);
  * every group's list of a request has the same length.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

from pagedllm.core.block_hash import chain_root, extend_block_hashes
from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.kv_cache_groups import blocks_needed
from pagedllm.core.partial_blocks import PartialBlockCache
from pagedllm.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# The id a request's block list sends the runner for an entry it holds no block for (a prefix hit's blocks before
# a sliding window): any valid id, never read.
NULL_BLOCK_ID = 0

# Blocks of one group of one request; None where a block before the group's window was freed.
BlockList = list[Optional[KVCacheBlock]]


def _first_parent(request: Request) -> Optional[int]:
    """The parent of a request's first block, for its chain and for the partial-block cache (block_hash.chain_root:
    its cache salt, LongRoPE's long factors, dynamic NTK's long prompt; None for a plain request)."""
    return chain_root(request.cache_salt, request.rope_long, request.ntk_prompt_len, request.embeds_key)


class KVCacheManager:
    def __init__(self, *, block_size: int, num_blocks: int, enable_caching: bool = True,
                 group_windows: Sequence[Optional[int]] = (None,)) -> None:
        """group_windows: per KV-cache group (core/kv_cache_groups.py) its sliding window, None for full attention;
        one group by default."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}.")
        if not group_windows or any(w is not None and w < 1 for w in group_windows):
            raise ValueError(f"group_windows must list one window (None or >= 1) per group, got {group_windows}.")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.group_windows = tuple(group_windows)
        self.num_groups = len(self.group_windows)
        self.sliding_groups = [g for g, w in enumerate(self.group_windows) if w is not None]
        self.full_groups = [g for g, w in enumerate(self.group_windows) if w is None]
        # The single group's window (None: full attention, or several groups).
        self.sliding_window = self.group_windows[0] if self.num_groups == 1 else None
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_caching)
        self.group_blocks: list[dict[str, BlockList]] = [{} for _ in self.group_windows]
        self.req_to_blocks: dict[str, BlockList] = self.group_blocks[0]
        # Leading entries of a sliding group's list already freed, per request (where the next freeing starts).
        self.group_freed: list[dict[str, int]] = [{} for _ in self.group_windows]
        # Several groups: each request's lists in group order (the same list objects as in group_blocks), and the
        # sliding groups by window (groups of one window free the same entries at the same step).
        self._req_lists: dict[str, list[BlockList]] = {}
        self._window_groups = [(w, [g for g in self.sliding_groups if self.group_windows[g] == w])
                               for w in dict.fromkeys(self.group_windows[g] for g in self.sliding_groups)]
        self.num_cached_blocks: dict[str, int] = {}  # the same for every group: blocks fill up together
        # Cumulative prefix-cache counters, in tokens (what vLLM exports as prefix_cache_queries/hits).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Finished requests' last partial blocks, offered by copy (beam forks; core/partial_blocks.py); one group only.
        self.partial_blocks = PartialBlockCache() if enable_caching and self.num_groups == 1 else None
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
        """Group 0's block ids of the request (NULL_BLOCK_ID where it holds none)."""
        return [NULL_BLOCK_ID if b is None else b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def get_group_block_ids(self, request_id: str) -> Optional[list[list[int]]]:
        """The block ids of groups 1.. (None with one group)."""
        if self.num_groups == 1:
            return None
        return [[NULL_BLOCK_ID if b is None else b.block_id for b in blocks.get(request_id, ())]
                for blocks in self.group_blocks[1:]]

    def num_request_blocks(self, request_id: str) -> int:
        """Blocks the request holds now, in all groups (entries freed before a window are not counted)."""
        return sum(1 for blocks in self.group_blocks for b in blocks.get(request_id, ()) if b is not None)

    def _key(self, block_hash: int, group: int) -> int:
        # One hash space per group: the same prefix has a block in every group. Hashes are < 2**128.
        return block_hash if group == 0 else block_hash + (group << 128)

    def max_request_tokens(self, chunk_tokens: int) -> int:
        """The longest request the pool can hold alone, computed at most chunk_tokens at a time: full groups hold
        every block; a sliding group at most a chunk plus its window (blocks before it are freed), so a pool of
        sliding groups alone may hold any length."""
        bs, num_blocks = self.block_size, self.num_blocks
        if not self.full_groups and blocks_needed(self.group_windows, 1 << 62, chunk_tokens, bs) <= num_blocks:
            return 1 << 62
        lo, hi = 0, num_blocks * bs  # blocks_needed(lo) <= num_blocks; the answer is below hi + 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if blocks_needed(self.group_windows, mid, chunk_tokens, bs) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def update_block_hashes(self, request: Request) -> None:
        """Hash the request's full blocks that are not hashed yet (no-op when caching is off)."""
        if self.enable_caching:
            hashes = request.block_hashes
            extend_block_hashes(hashes, request.all_token_ids, self.block_size, request.prefix_lora_key,
                                None if hashes else _first_parent(request))

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
            return ([] if self.num_groups == 1 else [[] for _ in self.group_windows]), 0
        self.update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        if self.num_groups == 1 and self.sliding_window is None:
            hits: BlockList = []
            for block_hash in request.block_hashes[:max_hit_blocks]:
                block = self.block_pool.get_cached_block(block_hash)
                if block is None:
                    break
                hits.append(block)
            group_hits = [hits]
        else:
            group_hits = self._window_hits(request.block_hashes[:max_hit_blocks])
        num_computed_tokens = len(group_hits[0]) * self.block_size
        if record_stats:
            self.record_prefix_cache_lookup(request.num_tokens, num_computed_tokens)
        return (group_hits[0] if self.num_groups == 1 else group_hits), num_computed_tokens

    def _window_hits(self, hashes: list[int]) -> list[BlockList]:
        """The longest hit valid in every group: full groups need every block of it, sliding groups the blocks
        their window sees from its end on (core docstring). Per group the hit's blocks, None before a window."""
        pool, bs = self.block_pool, self.block_size
        limit = len(hashes)
        found: list[BlockList] = [[] for _ in self.group_windows]
        for g in self.full_groups:  # a prefix of a full-attention hit is a hit: the longest run from the start
            blocks = found[g]
            for block_hash in hashes[:limit]:
                block = pool.get_cached_block(self._key(block_hash, g))
                if block is None:
                    break
                blocks.append(block)
            limit = len(blocks)
        runs = {}
        for g in self.sliding_groups:
            found[g] = [pool.get_cached_block(self._key(h, g)) for h in hashes[:limit]]
            run, n = [], 0
            for block in found[g]:
                n = n + 1 if block is not None else 0
                run.append(n)  # cached blocks in a row ending here
            runs[g] = run
        num = limit
        while num > 0 and not all(runs[g][num - 1] >= num - max(0, num * bs - self.group_windows[g] + 1) // bs
                                  for g in self.sliding_groups):
            num -= 1
        hits = []
        for g, blocks in enumerate(found):
            window = self.group_windows[g]
            first = 0 if window is None else max(0, num * bs - window + 1) // bs
            hits.append([None] * first + blocks[first:num])
        return hits

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
        parent = request.block_hashes[i - 1] if i > 0 else _first_parent(request)
        end = min(request.num_tokens - 1, num_hit_tokens + self.block_size - 1)
        hit = self.partial_blocks.lookup(parent, request.prefix_lora_key, request.all_token_ids[num_hit_tokens:end])
        return None if hit is None else (hit[0].block_id, hit[1])

    def record_prefix_cache_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_queried_tokens
        self.prefix_cache_hits += num_hit_tokens

    # ---------------------------------------------------------------- mutations

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence = (),
    ) -> Optional[Union[list[int], list[list[int]]]]:
        """Make room for num_new_tokens more tokens after the request's computed ones.

        new_computed_blocks are prefix-cache hits from get_computed_blocks (only for a request that
        holds no blocks yet); they count as computed tokens ahead of request.num_computed_tokens.
        Returns the block ids appended to the request's block table (hits first, then fresh blocks;
        with several groups one such list per group), or None -- changing nothing but releasing blocks that fell
        out of a sliding window -- when the pool cannot supply them. Free cached blocks count as
        available: they are evicted on demand.
        """
        if self.num_groups > 1:
            return self._allocate_groups(request, num_new_tokens, new_computed_blocks)
        blocks = self.req_to_blocks.get(request.request_id)
        window = self.sliding_window
        if blocks is not None and window is not None:
            seen_from = _next_query_floor(request)
            if (seen_from - window + 1) // self.block_size > self.group_freed[0].get(request.request_id, 0):
                self._free_before_window(0, request.request_id, blocks, seen_from)  # a block fell out of the window
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
        num_tokens_with_slots, num_new_blocks, num_evictable_hits = self._blocks_taken(
            request, num_new_tokens, new_computed_blocks, len(blocks))
        if num_new_blocks + num_evictable_hits > self.block_pool.num_free_blocks:
            return None

        # Touch hits before allocating so allocation cannot evict them.
        self.block_pool.touch(b for b in new_computed_blocks if b is not None)
        fresh = self.block_pool.allocate(num_new_blocks)
        appended = list(new_computed_blocks) + fresh
        blocks.extend(appended)
        self.req_to_blocks[request.request_id] = blocks
        if request.request_id not in self.num_cached_blocks:
            self.num_cached_blocks[request.request_id] = len(new_computed_blocks)

        if self.enable_caching:
            # Blocks full once this step has run; their tokens are all known (no future tokens needed).
            self._cache_full_blocks(request, min(num_tokens_with_slots, request.num_tokens))
        return [NULL_BLOCK_ID if b is None else b.block_id for b in appended]

    def num_free_blocks_taken(self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence = ()
                              ) -> int:
        """The free blocks allocate_slots(request, num_new_tokens, new_computed_blocks) takes (one KV-cache group)."""
        _, num_new_blocks, num_evictable_hits = self._blocks_taken(
            request, num_new_tokens, new_computed_blocks, len(self.req_to_blocks.get(request.request_id) or ()))
        return num_new_blocks + num_evictable_hits

    def _blocks_taken(self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence, num_held: int
                      ) -> tuple[int, int, int]:
        """(tokens with slots after the allocation, fresh blocks it needs, hits sitting in the free queue: touched,
        they stop being free) of allocate_slots' general path."""
        num_tokens_with_slots = (request.num_computed_tokens + len(new_computed_blocks) * self.block_size
                                 + num_new_tokens)
        num_new_blocks = max(0, cdiv(num_tokens_with_slots, self.block_size) - num_held - len(new_computed_blocks))
        num_evictable_hits = sum(1 for b in new_computed_blocks if b is not None and b.ref_cnt == 0)
        return num_tokens_with_slots, num_new_blocks, num_evictable_hits

    def _allocate_groups(self, request: Request, num_new_tokens: int,
                         new_computed_blocks: Sequence[BlockList]) -> Optional[list[list[int]]]:
        """allocate_slots for several groups: the same number of fresh blocks for each, all or nothing."""
        rid = request.request_id
        lists = self._req_lists.get(rid)
        hits = new_computed_blocks if new_computed_blocks and new_computed_blocks[0] else None
        bs = self.block_size
        if lists is not None:
            if hits is not None and lists[0]:
                raise ValueError("new_computed_blocks is only valid for a request that holds no blocks.")
            computed = _next_query_floor(request)
            for window, groups in self._window_groups:  # what the step's first query no longer sees
                end = min(len(lists[0]), max(0, computed - window + 1) // bs)
                if end > self.group_freed[groups[0]].get(rid, 0):
                    for g in groups:
                        self._free_before_window(g, rid, lists[g], computed)
        num_hit = len(hits[0]) if hits is not None else 0
        num_tokens_with_slots = request.num_computed_tokens + num_hit * bs + num_new_tokens
        have = len(lists[0]) if lists is not None else num_hit
        num_new_blocks = max(0, -(-num_tokens_with_slots // bs) - have)
        if num_new_blocks == 0 and lists is not None and hits is None:  # most decode steps
            if self.enable_caching and min(num_tokens_with_slots, len(request.all_token_ids)) // bs \
                    > self.num_cached_blocks[rid]:
                self._cache_full_blocks(request, min(num_tokens_with_slots, len(request.all_token_ids)))
            return [[]] * self.num_groups  # (one shared empty list: callers only read it)
        num_evictable_hits = 0 if hits is None else sum(
            1 for group in hits for b in group if b is not None and b.ref_cnt == 0)
        if num_new_blocks * self.num_groups + num_evictable_hits > self.block_pool.num_free_blocks:
            return None
        if hits is not None:
            for group in hits:
                self.block_pool.touch(b for b in group if b is not None)
        fresh = self.block_pool.allocate(num_new_blocks * self.num_groups)
        if lists is None:
            lists = self._req_lists[rid] = []
            for g, blocks in enumerate(self.group_blocks):
                lists.append(blocks.setdefault(rid, []))
        out = []
        for g, blocks in enumerate(lists):
            appended = (list(hits[g]) if hits is not None else []) + fresh[g * num_new_blocks:(g + 1) * num_new_blocks]
            blocks.extend(appended)
            out.append([NULL_BLOCK_ID if b is None else b.block_id for b in appended])
        if rid not in self.num_cached_blocks:
            self.num_cached_blocks[rid] = num_hit
        if self.enable_caching:
            self._cache_full_blocks(request, min(num_tokens_with_slots, request.num_tokens))
        return out

    def _free_before_window(self, group: int, rid: str, blocks: BlockList, num_computed_tokens: int) -> None:
        """Free the request's blocks of a sliding group that lie wholly before what position num_computed_tokens
        (the next query) sees."""
        end = min(len(blocks), max(0, num_computed_tokens - self.group_windows[group] + 1) // self.block_size)
        freed = self.group_freed[group]
        start = freed.get(rid, 0)
        if end <= start:
            return
        out = []
        for i in range(start, end):
            block = blocks[i]
            if block is not None:
                out.append(block)
                blocks[i] = None
        freed[rid] = end
        self.block_pool.free(out)

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        rid = request.request_id
        start = self.num_cached_blocks[rid]
        end = min(num_tokens // self.block_size, len(self.req_to_blocks[rid]))
        if end <= start:
            return
        self.update_block_hashes(request)
        hashes = request.block_hashes
        for g, group in enumerate(self.group_blocks):
            blocks = group[rid]
            for i in range(start, end):
                block = blocks[i]
                if block is not None:  # (freed before the window before it was full: nothing to offer)
                    self.block_pool.cache_block(block, hashes[i] if g == 0 else self._key(hashes[i], g))
        self.num_cached_blocks[rid] = end

    def trim(self, request: Request, num_tokens: int) -> int:
        """Speculative rollback: keep only the blocks that hold the request's first num_tokens slots, freeing the
        rest (they held rejected draft tokens only, never a cached block). Returns the kept block count."""
        rid = request.request_id
        if rid not in self.req_to_blocks:
            return 0
        keep = cdiv(num_tokens, self.block_size)
        for group in self.group_blocks:
            blocks = group[rid]
            if keep < len(blocks):
                dropped = [b for b in blocks[keep:] if b is not None]
                del blocks[keep:]
                self.block_pool.free(reversed(dropped))
        self.num_cached_blocks[rid] = min(self.num_cached_blocks[rid], keep)
        for freed in self.group_freed:
            if freed.get(rid, 0) > keep:
                freed[rid] = keep
        return len(self.req_to_blocks[rid])

    def free(self, request: Request, remember_partial: bool = False) -> None:
        """Release the request's blocks. They are freed tail-first so its last blocks evict first.
        remember_partial (a finished request): its last, partly filled block is offered to later requests."""
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, [])
        self.num_cached_blocks.pop(rid, None)
        partial = self._partial_tail(request, blocks) if remember_partial else None
        self.block_pool.free(b for b in reversed(blocks) if b is not None)
        for group in self.group_blocks[1:]:
            self.block_pool.free(b for b in reversed(group.pop(rid, [])) if b is not None)
        for freed in self.group_freed:
            freed.pop(rid, None)
        self._req_lists.pop(rid, None)
        if partial is not None:
            self.partial_blocks.remember(*partial)

    def _partial_tail(self, request: Request, blocks: BlockList):
        """(block, parent hash, LoRA cache key, tokens) of the request's last partly filled block of computed tokens."""
        if self.partial_blocks is None:
            return None
        computed = min(request.num_computed_tokens, request.num_tokens)
        i, m = divmod(computed, self.block_size)
        if m == 0 or i >= len(blocks) or blocks[i] is None or blocks[i].ref_cnt != 1 \
                or blocks[i].block_hash is not None:
            return None
        self.update_block_hashes(request)
        parent = request.block_hashes[i - 1] if i > 0 else _first_parent(request)
        start = i * self.block_size
        return blocks[i], parent, request.prefix_lora_key, tuple(request.all_token_ids[start:computed])

    def reset_prefix_cache(self) -> bool:
        done = self.block_pool.reset_prefix_cache()
        if done and self.partial_blocks is not None:
            self.partial_blocks.clear()
        return done


def _next_query_floor(request: Request) -> int:
    """The earliest position the request's next query can truly have, for freeing what a sliding window no longer
    sees: its computed count, less the drafts of a verify step in flight (overlapped speculation counts that step
    as emitting 1 + its drafts, all accepted; each rejected one puts the next query a position earlier)."""
    return request.num_computed_tokens - max(0, request.num_output_placeholders - 1)
