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
