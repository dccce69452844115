"""Data-parallel routing in the API process: which engine core gets a new request.

The least-loaded core (fewest unfinished requests sent to it), unless a core recently got a request with the
same first blocks of prompt: it likely still holds them in its prefix cache, so it gets the request as long
as it is at most `slack` requests busier than the least-loaded one (a cache hit saves the whole prefill of
those blocks; a much busier core would cost more in queueing than that).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence


class DPRouter:
    def __init__(self, num_engines: int, block_size: int = 16, slack: int = 4, max_prefixes: int = 8192,
                 max_prefix_blocks: int = 4) -> None:
        self.load = [0] * num_engines
        self.block_size = block_size
        self.slack = slack
        self.max_prefixes = max_prefixes
        self.max_prefix_blocks = max_prefix_blocks
        self._prefix_owner: OrderedDict[int, int] = OrderedDict()  # prefix key -> engine, LRU order

    def _keys(self, prompt: Sequence[int], cache_salt: Optional[str] = None) -> list[int]:
        """Keys of the prompt's leading 1..max_prefix_blocks full blocks, longest first, under its cache salt (a
        core holding another salt's blocks of the same prompt has nothing this request can reuse)."""
        num_blocks = min(len(prompt) // self.block_size, self.max_prefix_blocks)
        return [hash((cache_salt, tuple(prompt[:k * self.block_size]))) for k in range(num_blocks, 0, -1)]

    def choose(self, prompt: Sequence[int], n: int = 1, cache_salt: Optional[str] = None,
               pinned: Optional[int] = None) -> int:
        """Pick the engine for a request (n sibling samples go together: they share the prompt's blocks).
        pinned: the engine a client chose (vLLM's X-data-parallel-rank header); it gets the request, and its
        prefix cache will hold these blocks, so later requests with them are routed there too."""
        keys = self._keys(prompt, cache_salt)
        if pinned is not None:
            engine = pinned
        else:
            least = min(range(len(self.load)), key=self.load.__getitem__)
            engine = least
            for key in keys:
                owner = self._prefix_owner.get(key)
                if owner is not None:
                    if self.load[owner] <= self.load[least] + self.slack:
                        engine = owner
                    break
        for key in keys:
            self._prefix_owner[key] = engine
            self._prefix_owner.move_to_end(key)
        while len(self._prefix_owner) > self.max_prefixes:
            self._prefix_owner.popitem(last=False)
        self.load[engine] += n
        return engine

    def finished(self, engine: int, n: int = 1) -> None:
        self.load[engine] = max(0, self.load[engine] - n)
