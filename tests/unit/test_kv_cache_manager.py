"""KVCacheManager: block tables, prefix hits, sharing, eviction, failure atomicity."""
import pytest

from pagedllm.core.block_hash import hash_full_blocks
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams

BS = 4


def req(rid, tokens, lora_id=None):
    return Request(rid, list(tokens), SamplingParams(max_tokens=100), lora_id=lora_id)


def mgr(num_blocks=10, caching=True):
    return KVCacheManager(block_size=BS, num_blocks=num_blocks, enable_caching=caching)


def admit(m, r):
    """What the scheduler does for a new request: look up, allocate the whole prompt, mark computed."""
    hits, num_hit = m.get_computed_blocks(r)
    new_ids = m.allocate_slots(r, r.num_tokens - num_hit, hits)
    assert new_ids is not None
    r.num_computed_tokens = r.num_tokens
    return new_ids, num_hit


def test_allocates_ceil_blocks_and_grows_at_boundaries():
    m = mgr()
    r = req("a", range(9))
    assert m.allocate_slots(r, 9) == [0, 1, 2]
    r.num_computed_tokens = 9
    for t in range(9, 12):  # tokens 9..11 still fit in block 2
        r.append_output_token_ids([t])
        assert m.allocate_slots(r, 1) == []
        r.num_computed_tokens += 1
    r.append_output_token_ids([12])
    assert m.allocate_slots(r, 1) == [3]
    assert m.get_block_ids("a") == [0, 1, 2, 3]
    assert m.get_block_ids("unknown") == []


def test_allocate_failure_changes_nothing():
    m = mgr(num_blocks=3)
    a = req("a", range(8))
    m.allocate_slots(a, 8)
    b = req("b", range(100, 109))
    before = (m.num_free_blocks, m.block_pool.free_block_queue.block_ids(), dict(m.block_pool.cached_blocks))
    assert m.allocate_slots(b, 9) is None
    assert (m.num_free_blocks, m.block_pool.free_block_queue.block_ids(), dict(m.block_pool.cached_blocks)) == before
    assert m.get_block_ids("b") == [] and "b" not in m.req_to_blocks


def test_full_blocks_are_cached_partial_are_not():
    m = mgr()
    r = req("a", range(10))
    m.allocate_slots(r, 10)
    hashes = hash_full_blocks(list(range(10)), BS)
    assert r.block_hashes == hashes
    assert m.block_pool.get_cached_block(hashes[0]).block_id == 0
    assert m.block_pool.get_cached_block(hashes[1]).block_id == 1
    assert m.block_pool.blocks[2].block_hash is None
    assert len(m.block_pool.cached_blocks) == 2


def test_chunk_caches_only_blocks_full_after_the_step():
    m = mgr()
    r = req("a", range(12))
    m.allocate_slots(r, 5)  # a chunk: tokens 0..4 -> block 0 full, block 1 partial
    assert [b.block_hash is not None for b in m.req_to_blocks["a"]] == [True, False]
    r.num_computed_tokens = 5
    m.allocate_slots(r, 7)
    assert [b.block_hash is not None for b in m.req_to_blocks["a"]] == [True, True, True]


def test_decode_fills_block_then_another_request_hits_it():
    m = mgr()
    a = req("a", range(6))
    admit(m, a)
    a.append_output_token_ids([50])
    m.allocate_slots(a, 1)
    a.num_computed_tokens = 7
    a.append_output_token_ids([51])
    m.allocate_slots(a, 1)  # tokens 0..7 -> block 1 now full and cached
    a.num_computed_tokens = 8
    b = req("b", [0, 1, 2, 3, 4, 5, 50, 51, 9])
    hits, num_hit = m.get_computed_blocks(b)
    assert ids_of(hits) == [0, 1] and num_hit == 8


def ids_of(blocks):
    return [b.block_id for b in blocks]


def test_prefix_hit_shares_blocks_with_ref_counts():
    m = mgr()
    prompt = list(range(10))
    a, b = req("a", prompt), req("b", prompt)
    assert admit(m, a) == ([0, 1, 2], 0)
    new_ids, num_hit = admit(m, b)
    assert num_hit == 8 and new_ids == [0, 1, 3]
    assert m.get_block_ids("b") == [0, 1, 3]
    assert [m.block_pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    m.free(a)
    assert [m.block_pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 0, 1]
    assert m.num_free_blocks == 10 - 3


def test_n_way_sharing_of_long_prompt():
    m = mgr(num_blocks=20)
    prompt = list(range(33))  # 8 full blocks + 1 token
    reqs = [req(f"r{i}", prompt) for i in range(3)]
    admit(m, reqs[0])
    for r in reqs[1:]:
        _, num_hit = admit(m, r)
        assert num_hit == 32
    tables = [m.get_block_ids(r.request_id) for r in reqs]
    assert tables[0][:8] == tables[1][:8] == tables[2][:8] == list(range(8))
    assert [t[8] for t in tables] == [8, 9, 10]
    assert all(m.block_pool.blocks[i].ref_cnt == 3 for i in range(8))
    assert m.num_free_blocks == 20 - 11


def test_never_hits_the_whole_prompt():
    m = mgr()
    a = req("a", range(8))  # exactly two full blocks
    admit(m, a)
    hits, num_hit = m.get_computed_blocks(req("b", range(8)))
    assert ids_of(hits) == [0] and num_hit == 4  # last block dropped: the last token must be computed
    hits, num_hit = m.get_computed_blocks(req("c", range(9)))
    assert ids_of(hits) == [0, 1] and num_hit == 8
    hits, num_hit = m.get_computed_blocks(req("d", range(4)))
    assert hits == [] and num_hit == 0


def test_prefix_cache_counters_in_tokens():
    m = mgr()
    admit(m, req("a", range(10)))
    m.get_computed_blocks(req("b", range(10)))
    m.get_computed_blocks(req("c", [0, 1, 2, 3, 99, 99, 99]))
    m.get_computed_blocks(req("d", range(10)), record_stats=False)
    assert m.prefix_cache_queries == 10 + 10 + 7
    assert m.prefix_cache_hits == 0 + 8 + 4


def test_hit_stops_at_first_miss():
    m = mgr()
    admit(m, req("a", list(range(12)) + [0]))
    probe = req("b", [0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11, 0])  # block 1 differs, block 2 same tokens
    hits, num_hit = m.get_computed_blocks(probe)
    assert ids_of(hits) == [0] and num_hit == 4


def test_lora_blocks_never_match_other_adapters():
    m = mgr()
    admit(m, req("a", range(9), lora_id=1))
    assert m.get_computed_blocks(req("b", range(9)))[1] == 0
    assert m.get_computed_blocks(req("c", range(9), lora_id=2))[1] == 0
    assert m.get_computed_blocks(req("d", range(9), lora_id=1))[1] == 8


def test_free_returns_blocks_tail_first_and_keeps_them_cached():
    m = mgr(num_blocks=6)
    a = req("a", range(13))  # blocks 0..3, three full
    admit(m, a)
    m.free(a)
    assert m.block_pool.free_block_queue.block_ids() == [4, 5, 3, 2, 1, 0]
    assert m.get_block_ids("a") == []
    b = req("b", range(13))
    hits, num_hit = m.get_computed_blocks(b)
    assert ids_of(hits) == [0, 1, 2] and num_hit == 12


def test_eviction_takes_freed_requests_tail_blocks_first():
    m = mgr(num_blocks=4)
    a = req("a", range(12))  # 3 full cached blocks 0,1,2
    admit(m, a)
    m.free(a)  # queue: 3, 2, 1, 0
    c = req("c", range(100, 108))  # needs 2 fresh blocks -> takes 3 then evicts 2
    assert m.allocate_slots(c, 8) == [3, 2]
    hits, num_hit = m.get_computed_blocks(req("b", range(13)))
    assert ids_of(hits) == [0, 1] and num_hit == 8  # block 2's content was evicted


def test_evictable_hits_count_against_free_blocks():
    m = mgr(num_blocks=4)
    a = req("a", range(9))  # blocks 0,1 cached, 2 partial
    admit(m, a)
    m.free(a)  # all 4 free, two of them cached
    b = req("b", list(range(8)) + list(range(200, 209)))  # 17 tokens -> 5 blocks: too many
    hits, num_hit = m.get_computed_blocks(b)
    assert num_hit == 8
    assert m.allocate_slots(b, b.num_tokens - num_hit, hits) is None
    assert all(blk.ref_cnt == 0 for blk in m.block_pool.blocks)
    c = req("c", list(range(8)) + list(range(200, 208)))  # 16 tokens -> 4 blocks: exactly fits
    hits, num_hit = m.get_computed_blocks(c)
    assert m.allocate_slots(c, c.num_tokens - num_hit, hits) == [0, 1, 3, 2]
    assert m.num_free_blocks == 0


def test_concurrent_duplicate_prefix_stays_single_cached_copy():
    m = mgr()
    a, b = req("a", range(8)), req("b", range(8))
    m.allocate_slots(a, 8)
    m.allocate_slots(b, 8)  # no lookup in between: computes the same blocks again
    h = a.block_hashes
    assert m.block_pool.get_cached_block(h[0]).block_id == 0
    assert m.block_pool.get_cached_block(h[1]).block_id == 1
    assert m.block_pool.blocks[2].block_hash is None and m.block_pool.blocks[3].block_hash is None
    m.free(a)
    m.free(b)
    assert m.num_free_blocks == 10


def test_caching_disabled():
    m = mgr(caching=False)
    a = req("a", range(9))
    admit(m, a)
    assert a.block_hashes == [] and m.block_pool.cached_blocks == {}
    assert m.get_computed_blocks(req("b", range(9))) == ([], 0)
    assert m.prefix_cache_queries == 0


def test_hits_only_for_requests_without_blocks():
    m = mgr()
    a = req("a", range(9))
    admit(m, a)
    b = req("b", range(9))
    m.allocate_slots(b, 1)
    with pytest.raises(ValueError):
        m.allocate_slots(b, 1, m.get_computed_blocks(req("x", range(9)))[0])


def test_usage_and_reset():
    m = mgr(num_blocks=4)
    a = req("a", range(8))
    admit(m, a)
    assert m.get_usage() == 0.5
    assert m.reset_prefix_cache() is False
    m.free(a)
    assert m.get_usage() == 0.0
    assert m.reset_prefix_cache() is True
    assert m.get_computed_blocks(req("b", range(9)))[1] == 0


# ---------------------------------------------------------------- partial blocks (beam forks)

def test_finished_partial_block_is_offered_to_a_continuation():
    m = mgr(num_blocks=8)
    parent = req("p", range(10))  # blocks [0..3] [4..7] full, [8, 9] partial in block 2
    assert admit(m, parent) == ([0, 1, 2], 0)
    parent.append_output_token_ids([50])  # sampled, not computed
    m.free(parent, remember_partial=True)
    child = req("c", list(range(10)) + [50, 51])
    hits, num_hit = m.get_computed_blocks(child)
    assert [b.block_id for b in hits] == [0, 1] and num_hit == 8
    assert m.partial_block_hit(child, num_hit) == (2, 2)  # block 2 holds tokens 8, 9
    other = req("o", list(range(8)) + [7, 9, 3])  # differs inside the partial block: no hit
    assert m.partial_block_hit(other, m.get_computed_blocks(other)[1]) is None
    lora = req("l", list(range(10)) + [50], lora_id=3)  # another adapter: other K/V
    assert m.partial_block_hit(lora, 8) is None
    # the last token is always computed: a request equal to the parent's computed tokens + 1 gets them all but one
    exact = req("e", list(range(10)) + [50])
    assert m.partial_block_hit(exact, 8) == (2, 2)
    short = req("s", list(range(9)) + [4])
    assert m.partial_block_hit(short, 8) is None  # [8, 4] is not [8, 9]


def test_partial_block_forgotten_when_handed_out_and_on_reset():
    m = mgr(num_blocks=4)
    parent = req("p", range(6))  # blocks 0 (full) and 1 (2 tokens)
    admit(m, parent)
    m.free(parent, remember_partial=True)
    # the free queue (head first): 2, 3, then the freed blocks tail-first: 1 (partial), 0
    other = req("x", range(100, 113))  # 4 blocks: takes every free block, block 1 among them
    assert admit(m, other)[0] == [2, 3, 1, 0]
    assert len(m.partial_blocks) == 0
    m.free(other)
    parent2 = req("p2", range(6))
    admit(m, parent2)
    m.free(parent2, remember_partial=True)
    assert len(m.partial_blocks) == 1
    assert m.reset_prefix_cache() and len(m.partial_blocks) == 0
    # preemption (free without remember_partial) and full tails offer nothing
    full = req("f", range(8))
    admit(m, full)
    m.free(full, remember_partial=True)
    assert len(m.partial_blocks) == 0


def test_no_partial_blocks_without_prefix_caching():
    m = mgr(caching=False)
    parent = req("p", range(6))
    admit(m, parent)
    m.free(parent, remember_partial=True)
    assert m.partial_block_hit(req("c", list(range(6)) + [1]), 4) is None
