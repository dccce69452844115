"""DPRouter (data-parallel routing in the API process): prefix affinity within a cache salt only."""
from __future__ import annotations

from pagedllm.entrypoints.dp_router import DPRouter


def test_prefix_affinity_is_per_cache_salt():
    """A salted request reuses only blocks of its own salt (cache_salt), so the core holding another salt's copy of
    the prompt is no better for it than the least-loaded one; before, affinity ignored the salt and piled every
    tenant's copy of a shared prompt onto one core."""
    prompt = list(range(64))
    router = DPRouter(2, block_size=16)
    first = router.choose(prompt, cache_salt="tenant-a")
    assert router.choose(prompt, cache_salt="tenant-a") == first  # its own prefix: affinity holds
    assert router.choose(prompt, cache_salt="tenant-b") != first  # another salt: the least-loaded core
    unsalted = DPRouter(2, block_size=16)
    owner = unsalted.choose(prompt)
    assert unsalted.choose(prompt) == owner  # unsalted requests keep their affinity


def test_a_pinned_request_counts_and_teaches_its_prefix():
    """A request pinned to a core (X-data-parallel-rank) goes there whatever the load, counts in the core's load,
    and that core's prefix cache then holds its blocks: later unpinned requests with the prefix follow it."""
    prompt = list(range(40))
    router = DPRouter(3, block_size=16)
    assert router.choose(prompt, pinned=2) == 2 and router.load == [0, 0, 1]
    assert router.choose(prompt) == 2  # affinity learned from the pinned request (within the slack)
    assert router.choose(list(range(100, 140))) == 0  # another prompt: the least-loaded core
    router.load[2] += 10
    assert router.choose(prompt, pinned=2) == 2  # a pin wins over the load
    assert router.choose(prompt) != 2  # unpinned: too busy for affinity
