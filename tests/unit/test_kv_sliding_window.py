"""The KV manager with sliding windows: blocks before a window freed, prefix hits that need only the window's
blocks, several KV-cache groups from one pool (core/kv_cache_groups.py), and the groups' layout."""
import pytest

from pagedllm.core.block_hash import hash_full_blocks
from pagedllm.core.kv_cache_groups import kv_cache_groups
from pagedllm.core.kv_cache_manager import NULL_BLOCK_ID, KVCacheManager
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams

BS = 4


def req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=1000))


def held(m, rid, group=0):
    return [None if b is None else b.block_id for b in m.group_blocks[group][rid]]


def run(m, r, new_tokens):
    """Prefill r whole, then decode new_tokens one at a time (what the scheduler asks of the manager)."""
    assert m.allocate_slots(r, r.num_tokens) is not None
    r.num_computed_tokens = r.num_tokens
    for t in range(new_tokens):
        r.append_output_token_ids([1000 + t])
        assert m.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1


def test_blocks_before_the_window_are_freed_and_positions_keep_their_index():
    m = KVCacheManager(block_size=BS, num_blocks=20, group_windows=(6,))
    r = req("a", range(10))  # blocks 0, 1, 2
    run(m, r, 0)
    assert held(m, "a") == [0, 1, 2]
    r.append_output_token_ids([50])
    m.allocate_slots(r, 1)  # the query at position 10 sees 5..10: block 0 (0..3) is freed
    assert held(m, "a") == [None, 1, 2] and m.get_block_ids("a") == [NULL_BLOCK_ID, 1, 2]
    assert m.block_pool.num_used_blocks == 2
    r.num_computed_tokens = 11
    for t in range(30):
        r.append_output_token_ids([60 + t])
        m.allocate_slots(r, 1)
        r.num_computed_tokens += 1
        # the window (6 keys) and the new token's block: at most 3 blocks of 4
        assert m.block_pool.num_used_blocks <= 3
    assert held(m, "a")[:8] == [None] * 8 and len(held(m, "a")) == 11
    m.free(r)
    assert m.block_pool.num_used_blocks == 0 and m.num_free_blocks == 20


def test_freed_window_blocks_stay_cached_and_a_hit_needs_only_the_window():
    m = KVCacheManager(block_size=BS, num_blocks=20, group_windows=(6,))
    a = req("a", range(30))
    run(m, a, 6)  # decoding to position 35 frees blocks 0..6 (the last query sees positions 30..35)
    assert held(m, "a")[0] is None
    hashes = hash_full_blocks(list(range(30)), BS)
    assert all(m.block_pool.get_cached_block(h) is not None for h in hashes)  # freed, still cached
    m.free(a)
    # evict blocks 0..2's contents: 11 never-used blocks, then the ones freed first are handed out first
    filler = req("f", range(500, 500 + 14 * BS))
    m.allocate_slots(filler, filler.num_tokens)
    gone = [m.block_pool.get_cached_block(h) is None for h in hashes]
    assert gone[:3] == [True] * 3 and not any(gone[3:]), gone
    m.free(filler)
    b = req("b", list(range(30)) + [7, 7])  # 32 tokens: a hit can cover at most 7 blocks (28 tokens)
    hits, num_hit = m.get_computed_blocks(b)
    # at 28 computed tokens the window sees positions 23..: blocks 5, 6 are needed, and cached
    assert num_hit == 28 and [h is None for h in hits] == [True] * 5 + [False] * 2
    ids = m.allocate_slots(b, b.num_tokens - num_hit, hits)
    assert ids[:5] == [NULL_BLOCK_ID] * 5 and len(ids) == 8
    c = req("c", list(range(14)) + [9])  # 15 tokens: 3 blocks of hit would need blocks 0..2: gone
    assert m.get_computed_blocks(c) == ([], 0)


def test_hits_stop_where_the_window_needs_an_evicted_block():
    m = KVCacheManager(block_size=BS, num_blocks=30, group_windows=(9,))
    a = req("a", range(40))
    run(m, a, 0)
    m.free(a)
    hashes = hash_full_blocks(list(range(40)), BS)
    m.block_pool.cached_blocks.pop(hashes[6]).block_hash = None  # block 6's contents are gone
    hits, num_hit = m.get_computed_blocks(req("b", range(40)))
    # 9 blocks (36 tokens) need blocks 7, 8 (positions >= 28): cached, so the hole at 6 does not matter
    assert num_hit == 36 and [h is None for h in hits] == [True] * 7 + [False] * 2
    hits, num_hit = m.get_computed_blocks(req("c", list(range(30)) + [1, 2]))
    # 7 blocks need 5, 6 (positions >= 20): 6 is gone; 6 blocks need 4, 5 (positions >= 16): the hit is 6 blocks
    assert num_hit == 24 and [h is None for h in hits] == [True] * 4 + [False] * 2


def test_full_attention_hits_still_stop_at_the_first_miss():
    m = KVCacheManager(block_size=BS, num_blocks=30)
    a = req("a", range(40))
    run(m, a, 0)
    m.free(a)
    hashes = hash_full_blocks(list(range(40)), BS)
    m.block_pool.cached_blocks.pop(hashes[2]).block_hash = None
    assert m.get_computed_blocks(req("b", range(40)))[1] == 8


def test_groups_allocate_alike_from_one_pool_all_or_nothing():
    m = KVCacheManager(block_size=BS, num_blocks=12, group_windows=(None, 5))
    r = req("a", range(9))  # 3 blocks per group
    ids = m.allocate_slots(r, 9)
    assert [len(g) for g in ids] == [3, 3] and m.block_pool.num_used_blocks == 6
    assert m.get_block_ids("a") == ids[0] and m.get_group_block_ids("a") == [ids[1]]
    big = req("b", range(100, 130))  # 8 blocks per group: 16 > 6 free
    before = (m.num_free_blocks, m.block_pool.free_block_queue.block_ids())
    assert m.allocate_slots(big, 30) is None
    assert (m.num_free_blocks, m.block_pool.free_block_queue.block_ids()) == before and "b" not in m.req_to_blocks
    r.num_computed_tokens = 9
    for t in range(12):
        r.append_output_token_ids([t])
        assert m.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
    # 21 tokens: the full group holds 6 blocks, the sliding one (window 5) at most 3
    assert len(held(m, "a", 0)) == len(held(m, "a", 1)) == 6
    assert None not in held(m, "a", 0) and sum(b is not None for b in held(m, "a", 1)) <= 3
    kept = m.trim(r, 14)  # a speculative rollback cuts every group
    assert kept == 4 and len(held(m, "a", 0)) == len(held(m, "a", 1)) == 4
    m.free(r)
    assert m.num_free_blocks == 12


def test_group_hits_are_valid_in_every_group():
    m = KVCacheManager(block_size=BS, num_blocks=40, group_windows=(5, None))
    a = req("a", range(24))
    run(m, a, 8)  # the sliding group frees its first blocks
    m.free(a)
    hits, num_hit = m.get_computed_blocks(req("b", range(24)))
    assert num_hit == 20 and len(hits) == 2
    assert [h is None for h in hits[1]] == [False] * 5  # the full group: every block
    assert [h is None for h in hits[0]] == [True] * 4 + [False]  # the sliding one: positions >= 16
    # the same prefix in each group has its own block (hash spaces per group)
    assert {b.block_id for b in hits[1]}.isdisjoint({b.block_id for b in hits[0] if b is not None})
    # the full group's block 2 gone: hits stop before it, whatever the sliding group holds
    m.block_pool.cached_blocks.pop(hits[1][2].block_hash).block_hash = None
    assert m.get_computed_blocks(req("c", range(24)))[1] == 8


def test_partial_blocks_are_one_group_only():
    assert KVCacheManager(block_size=BS, num_blocks=8, group_windows=(None, 4)).partial_blocks is None
    assert KVCacheManager(block_size=BS, num_blocks=8, group_windows=(4,)).partial_blocks is not None


def test_max_request_tokens():
    full = KVCacheManager(block_size=8, num_blocks=20)
    assert full.max_request_tokens(2048) == 160
    sliding = KVCacheManager(block_size=8, num_blocks=20, group_windows=(32,))
    assert sliding.max_request_tokens(32) > 10 ** 12  # chunks of 32 + the window: 9 blocks, any length
    assert sliding.max_request_tokens(2048) == 160  # one chunk of the whole prompt must fit
    mixed = KVCacheManager(block_size=8, num_blocks=40, group_windows=(None, 16))
    # the full group takes cdiv(T, 8), the sliding one at most cdiv(16 + 16, 8) + 1 = 5
    assert mixed.max_request_tokens(16) == 35 * 8


def test_groups_of_a_uniform_model_are_its_layers():
    g = kv_cache_groups([None] * 4, 512)
    assert g.windows == (None,) and g.layer_slot == (0, 1, 2, 3) and g.num_slots == 4
    g = kv_cache_groups([16] * 3, 512)
    assert g.windows == (16,) and g.num_slots == 3
    # a window that hides nothing at max_model_len is full attention
    assert kv_cache_groups([None, 600, None], 512).windows == (None,)


def test_gemma3_like_groups():
    # 26 layers, every sixth global: 22 local, 4 global -> groups of 4 (six local with two empty places, one global)
    windows = [None if i % 6 == 5 else 512 for i in range(26)]
    g = kv_cache_groups(windows, 32768)
    assert g.num_slots == 4 and g.windows == (512,) * 6 + (None,)
    global_layers = (5, 11, 17, 23)
    assert [g.layer_group[i] for i in global_layers] == [6] * 4
    assert [g.layer_slot[i] for i in global_layers] == [0, 1, 2, 3]
    local = [i for i in range(26) if windows[i]]
    assert [(g.layer_group[i], g.layer_slot[i]) for i in local[:5]] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)]
    assert len({(g.layer_group[i], g.layer_slot[i]) for i in range(26)}) == 26  # no two layers share a place
    assert g.slots_of([5, 11]) == [0, 1]


def test_bad_group_windows_are_refused():
    with pytest.raises(ValueError, match="group_windows"):
        KVCacheManager(block_size=BS, num_blocks=8, group_windows=())
    with pytest.raises(ValueError, match="group_windows"):
        KVCacheManager(block_size=BS, num_blocks=8, group_windows=(0,))
