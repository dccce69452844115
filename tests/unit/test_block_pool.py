"""BlockPool: exact block ids, LRU free-queue order, ref counts, hash map, eviction."""
import pytest

from pagedllm.core.block_pool import BlockPool


def ids(blocks):
    return [b.block_id for b in blocks]


def test_initial_state():
    pool = BlockPool(5)
    assert pool.num_free_blocks == 5 and pool.num_used_blocks == 0
    assert pool.get_usage() == 0.0
    assert pool.free_block_queue.block_ids() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocate_takes_from_head_in_id_order():
    pool = BlockPool(5)
    assert ids(pool.allocate(3)) == [0, 1, 2]
    assert ids(pool.allocate(1)) == [3]
    assert all(pool.blocks[i].ref_cnt == 1 for i in range(4))
    assert pool.num_free_blocks == 1
    assert pool.get_usage() == pytest.approx(0.8)
    with pytest.raises(ValueError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1  # failed allocation changed nothing


def test_freed_blocks_go_to_tail_in_given_order():
    pool = BlockPool(4)
    a = pool.allocate(2)  # 0, 1
    pool.free(reversed(a))
    assert pool.free_block_queue.block_ids() == [2, 3, 1, 0]
    assert ids(pool.allocate(4)) == [2, 3, 1, 0]


def test_shared_block_freed_only_at_zero_refs():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free([b])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.free([b])
    assert b.ref_cnt == 0 and pool.free_block_queue.block_ids() == [1, 2, 0]
    with pytest.raises(ValueError):
        pool.free([b])


def test_cache_block_and_lookup():
    pool = BlockPool(3)
    b0, b1 = pool.allocate(2)
    assert pool.cache_block(b0, 111)
    assert pool.get_cached_block(111) is b0 and b0.block_hash == 111
    assert pool.get_cached_block(222) is None
    # A second block with the same hash (computed concurrently) stays a plain block.
    assert not pool.cache_block(b1, 111)
    assert b1.block_hash is None and pool.get_cached_block(111) is b0


def test_caching_disabled_never_registers():
    pool = BlockPool(2, enable_caching=False)
    (b,) = pool.allocate(1)
    assert not pool.cache_block(b, 5)
    assert b.block_hash is None and pool.get_cached_block(5) is None


def test_touch_free_cached_block_takes_it_out_of_queue():
    pool = BlockPool(4)
    b0, b1 = pool.allocate(2)
    pool.cache_block(b0, 10)
    pool.free([b1, b0])
    assert pool.free_block_queue.block_ids() == [2, 3, 1, 0]
    pool.touch([b0])  # prefix hit on a free, still-cached block
    assert b0.ref_cnt == 1 and b0.block_hash == 10
    assert pool.free_block_queue.block_ids() == [2, 3, 1]
    assert pool.num_free_blocks == 3


def test_eviction_is_lru_and_drops_hash():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.cache_block(b, 100 + i)
    pool.free([blocks[2], blocks[0], blocks[1]])  # free order = eviction order
    (first,) = pool.allocate(1)
    assert first.block_id == 2 and first.block_hash is None
    assert pool.get_cached_block(102) is None
    assert pool.get_cached_block(100) is blocks[0] and pool.get_cached_block(101) is blocks[1]
    (second,) = pool.allocate(1)
    assert second.block_id == 0 and pool.get_cached_block(100) is None


def test_free_queue_remove_middle_and_ends():
    pool = BlockPool(5)
    q = pool.free_block_queue
    q.remove(pool.blocks[2])
    q.remove(pool.blocks[0])
    q.remove(pool.blocks[4])
    assert q.block_ids() == [1, 3] and q.num_free_blocks == 2
    with pytest.raises(ValueError):
        q.remove(pool.blocks[2])
    q.append(pool.blocks[0])
    assert q.block_ids() == [1, 3, 0]
    assert q.popleft().block_id == 1


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.cache_block(b, 7)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(7) is b
    pool.free([b])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(7) is None and b.block_hash is None
    assert pool.num_free_blocks == 2


def test_block_states_follow_every_operation():
    """One byte per block (the dashboard's grid): free, cached (free, evictable), used, shared."""
    from pagedllm.core.block_pool import CACHED, FREE, SHARED, USED

    pool = BlockPool(5)
    assert pool.block_states == bytearray([FREE] * 5)
    a = pool.allocate(3)  # 0, 1, 2
    pool.cache_block(a[0], b"h0")
    pool.touch([a[0]])  # a second request shares block 0
    assert list(pool.block_states) == [SHARED, USED, USED, FREE, FREE]
    pool.free(a)  # block 0 goes back to one reference; 1 and 2 are free, 1 never cached
    assert list(pool.block_states) == [USED, FREE, FREE, FREE, FREE]
    pool.free([a[0]])
    assert list(pool.block_states) == [CACHED, FREE, FREE, FREE, FREE]
    pool.touch([pool.get_cached_block(b"h0")])  # a prefix hit takes the cached block back
    assert pool.block_states[0] == USED
    pool.free([a[0]])
    assert pool.reset_prefix_cache()
    assert pool.block_states == bytearray([FREE] * 5)
    pool.cache_block(pool.allocate(1)[0], b"h1")  # block 3 (the queue's head), cached
    pool.free([pool.blocks[3]])
    assert pool.block_states[3] == CACHED
    got = pool.allocate(5)  # evicts the cached block too
    assert pool.block_states == bytearray([USED] * 5) and pool.get_cached_block(b"h1") is None and len(got) == 5


def test_free_stops_at_a_block_freed_too_often_with_the_ones_before_it_freed():
    pool = BlockPool(4)
    a = pool.allocate(3)  # 0, 1, 2
    pool.free([a[1]])
    with pytest.raises(ValueError, match="Block 1 freed more often"):
        pool.free([a[2], a[1], a[0]])
    # block 2 went back before the error, block 0 was never reached: the queue stays linked and counted
    assert pool.free_block_queue.block_ids() == [3, 1, 2] and pool.num_free_blocks == 3 and a[0].ref_cnt == 1
    assert ids(pool.allocate(3)) == [3, 1, 2]


def test_random_operations_against_a_plain_model():
    """allocate / touch / free / cache_block / reset at random: the free queue's order, the ref counts, the hash map and
    block_states equal a plain list-and-dict model of the pool after every operation."""
    import random

    from pagedllm.core.block_pool import CACHED, FREE, SHARED, USED

    rng = random.Random(0)
    n = 24
    pool = BlockPool(n)
    queue = list(range(n))  # the model: free ids head first, ref counts, cached hash per block
    refs, hashes = [0] * n, [None] * n
    held: list[list[int]] = []  # the model's "requests": the block ids each holds
    for step in range(3000):
        op = rng.random()
        if op < 0.35 and queue:
            k = rng.randrange(0, len(queue) + 1)
            got = ids(pool.allocate(k))
            assert got == queue[:k]
            for i in got:
                refs[i] = 1
                hashes[i] = None  # evicted
            del queue[:k]
            held.append(got)
        elif op < 0.5:
            cached = [i for i in range(n) if hashes[i] is not None]
            hits = rng.sample(cached, rng.randrange(0, len(cached) + 1)) if cached else []
            pool.touch([pool.blocks[i] for i in hits])
            for i in hits:
                if refs[i] == 0:
                    queue.remove(i)
                refs[i] += 1
            held.append(hits)
        elif op < 0.65 and held:
            mine = rng.choice(held)
            full = [i for i in mine if hashes[i] is None and rng.random() < 0.7]
            for i in full:
                h = ("h", step, i)
                assert pool.cache_block(pool.blocks[i], h)
                hashes[i] = h
        elif op < 0.97 and held:
            mine = held.pop(rng.randrange(len(held)))
            pool.free(reversed([pool.blocks[i] for i in mine]))
            for i in reversed(mine):
                refs[i] -= 1
                if refs[i] == 0:
                    queue.append(i)
        elif not held:
            assert pool.reset_prefix_cache()
            hashes = [None] * n
        assert pool.free_block_queue.block_ids() == queue and pool.num_free_blocks == len(queue)
        assert [b.ref_cnt for b in pool.blocks] == refs
        assert {h: b.block_id for h, b in pool.cached_blocks.items()} == {h: i for i, h in enumerate(hashes) if h}
        assert list(pool.block_states) == [SHARED if r > 1 else USED if r == 1 else CACHED if hashes[i] else FREE
                                           for i, r in enumerate(refs)]
