"""N-gram prompt lookup: propose the tokens that followed the latest earlier occurrence of the sequence's suffix.

For each request, try n = prompt_lookup_max down to prompt_lookup_min: if the last n tokens (prompt + output)
occurred earlier in the sequence, propose the (up to) k tokens that followed that occurrence.

Per request the proposer keeps an index: for every n, n-gram -> the latest start p whose n-gram has a known
continuation (p + n < number of tokens). After a step only the new tokens' n-grams are added, so a lookup costs
O(new tokens x n values) whatever the context length (a full scan per step would make a long generation
quadratic in its length). `propose_scan` is the same rule as one sliding-window comparison over a
[num_reqs, max_len] token matrix: the reference the index is tested against, and the path for callers that give
no request ids.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class _RequestIndex:
    """One request's tokens and n-gram -> latest start maps (n-grams whose continuation is known)."""

    __slots__ = ("row", "tokens", "maps", "indexed")

    def __init__(self, row: int, ns: Sequence[int]) -> None:
        self.row = row
        self.tokens: list[int] = []
        self.maps: dict[int, dict[tuple, int]] = {n: {} for n in ns}
        self.indexed = 0  # tokens whose n-grams (with a continuation) are in the maps: starts p < indexed - n

    def extend(self, new_tokens: list[int]) -> None:
        tokens = self.tokens
        tokens.extend(new_tokens)
        length = len(tokens)
        for n, table in self.maps.items():
            # starts newly having a continuation: indexed - n <= p < length - n (later starts overwrite earlier)
            lo, hi = max(0, self.indexed - n), length - n
            if hi - lo > 32:  # a prompt: build in bulk
                windows = sliding_window_view(np.asarray(tokens[lo:hi + n - 1], dtype=np.int64), n)
                table.update(zip(map(tuple, windows.tolist()), range(lo, hi)))
            else:
                for p in range(lo, hi):
                    table[tuple(tokens[p:p + n])] = p
        self.indexed = length

    def lookup(self, k: int) -> list[int]:
        tokens = self.tokens
        length = len(tokens)
        for n in sorted(self.maps, reverse=True):
            if length <= n:
                continue
            p = self.maps[n].get(tuple(tokens[length - n:]))
            if p is not None:
                return tokens[p + n:min(p + n + k, length)]
        return []


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self._ns = list(range(prompt_lookup_min, prompt_lookup_max + 1))
        self._index: dict[str, _RequestIndex] = {}

    def drop(self, req_ids) -> None:
        """Finished requests: forget their indexes."""
        for r in req_ids:
            self._index.pop(r, None)

    def propose(self, token_ids: np.ndarray, rows: Sequence[int], num_tokens: Sequence[int],
                max_drafts: Sequence[int], req_ids: Optional[Sequence[str]] = None) -> list[list[int]]:
        """token_ids: [max_reqs, max_model_len] the runner's token matrix; per request its row, its token count
        and the most drafts worth proposing (room left before max_tokens / max_model_len). Returns one draft
        list per request (possibly empty)."""
        if req_ids is None:
            return self.propose_scan(token_ids, rows, num_tokens, max_drafts)
        drafts: list[list[int]] = []
        for req_id, row, length, room in zip(req_ids, rows, num_tokens, max_drafts):
            index = self._index.get(req_id)
            length = int(length)
            if index is None or index.row != row or index.indexed > length:  # new, moved or rolled back: rebuild
                index = self._index[req_id] = _RequestIndex(row, self._ns)
            if length > index.indexed:
                index.extend(token_ids[row, index.indexed:length].tolist())
            k = min(self.k, int(room))
            drafts.append(index.lookup(k) if k > 0 else [])
        return drafts

    def propose_scan(self, token_ids: np.ndarray, rows: Sequence[int], num_tokens: Sequence[int],
                     max_drafts: Sequence[int]) -> list[list[int]]:
        """The same proposals from one sliding-window comparison per n over the whole sequences (no index)."""
        num_reqs = len(rows)
        drafts: list[list[int]] = [[] for _ in range(num_reqs)]
        if num_reqs == 0:
            return drafts
        lens = np.asarray(num_tokens, dtype=np.int64)
        width = int(lens.max())
        seqs = token_ids[np.asarray(rows, dtype=np.int64), :width]  # [R, W] (garbage past each length)
        found = np.zeros(num_reqs, dtype=bool)
        starts = np.zeros(num_reqs, dtype=np.int64)  # where the proposal begins (index after the match)
        for n in range(self.max_n, self.min_n - 1, -1):
            if width <= n:
                continue
            todo = ~found & (lens > n)
            if not todo.any():
                continue
            idx = np.nonzero(todo)[0]
            sub, sub_lens = seqs[idx], lens[idx]
            suffix = sub[np.arange(len(idx))[:, None], sub_lens[:, None] - n + np.arange(n)]  # [r, n]
            windows = sliding_window_view(sub, n, axis=1)  # [r, W - n + 1, n]
            match = (windows == suffix[:, None, :]).all(axis=2)
            # A match must start before the suffix's own position (start < len - n) so that a token follows it.
            positions = np.arange(windows.shape[1])
            match &= positions[None, :] < (sub_lens - n)[:, None]
            has = match.any(axis=1)
            if not has.any():
                continue
            last = windows.shape[1] - 1 - np.argmax(match[:, ::-1], axis=1)  # latest matching start
            hit = idx[has]
            found[hit] = True
            starts[hit] = last[has] + n
        for i in np.nonzero(found)[0].tolist():
            k = min(self.k, int(max_drafts[i]))
            if k <= 0:
                continue
            s = int(starts[i])
            drafts[i] = seqs[i, s:min(s + k, int(lens[i]))].tolist()
        return drafts
