"""N-gram prompt lookup: propose the tokens that followed the latest earlier occurrence of the sequence's suffix.

For each request, try n = prompt_lookup_max down to prompt_lookup_min: if the last n tokens (prompt + output)
occurred earlier in the sequence, propose the (up to) k tokens that followed that occurrence. The search is
vectorized over the batch: one sliding-window comparison per n over a [num_reqs, max_len] token matrix.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: np.ndarray, rows: Sequence[int], num_tokens: Sequence[int],
                max_drafts: Sequence[int], req_ids: Optional[Sequence[str]] = None) -> list[list[int]]:
        """token_ids: [max_reqs, max_model_len] the runner's token matrix; per request its row, its token count
        and the most drafts worth proposing (room left before max_tokens / max_model_len). Returns one draft
        list per request (possibly empty)."""
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
            # A match must end before the suffix starts' own position (i.e. start < len - n) so that at least
            # one token follows it.
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
