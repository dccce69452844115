"""Chained block hashes: determinism, chaining, LoRA salt, incremental extension."""
import os
import subprocess
import sys

import pytest

from pagedllm.core import block_hash as bh
from pagedllm.core.block_hash import extend_block_hashes, hash_block_tokens, hash_full_blocks


def test_same_inputs_same_hash_and_range():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, (1, 2, 3, 4))
    assert isinstance(a, int) and 0 <= a < 2**128


def test_same_tokens_different_parent_differ():
    first = hash_block_tokens(None, [1, 2, 3, 4])
    other_first = hash_block_tokens(None, [9, 9, 9, 9])
    assert hash_block_tokens(first, [5, 6, 7, 8]) != hash_block_tokens(other_first, [5, 6, 7, 8])
    # No parent is not the same as a parent whose hash happens to be 0.
    assert hash_block_tokens(None, [5, 6, 7, 8]) != hash_block_tokens(0, [5, 6, 7, 8])


def test_token_order_and_content_matter():
    assert hash_block_tokens(None, [1, 2, 3, 4]) != hash_block_tokens(None, [4, 3, 2, 1])
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [1, 2, 0])
    assert hash_block_tokens(None, [256, 1]) != hash_block_tokens(None, [1, 256])


def test_lora_salt_separates_adapters():
    tokens = [1, 2, 3, 4]
    hashes = {hash_block_tokens(None, tokens, lora) for lora in (None, 0, 1, 2)}
    assert len(hashes) == 4
    assert hash_block_tokens(None, tokens, 1) == hash_block_tokens(None, tokens, 1)


def test_hash_is_pinned_and_process_independent():
    # Pinned: a change of serialization must be deliberate (bump the version tag).
    code = (
        "from pagedllm.core.block_hash import hash_full_blocks;"
        "print(hash_full_blocks(list(range(10)), 4, 7))"
    )
    outs = set()
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        outs.add(res.stdout.strip())
    pinned = [233239146105285887556100757626942920899, 127007454511282862530930992790101560081]
    assert outs == {str(pinned)}
    assert hash_full_blocks(list(range(10)), 4, 7) == pinned


def test_hash_full_blocks_ignores_partial_block():
    tokens = list(range(10))
    hashes = hash_full_blocks(tokens, 4)
    assert len(hashes) == 2
    assert hashes[0] == hash_block_tokens(None, [0, 1, 2, 3])
    assert hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7])
    assert hash_full_blocks([1, 2, 3], 4) == []


def test_extend_is_incremental(monkeypatch):
    tokens = list(range(6))
    hashes: list[int] = []
    assert extend_block_hashes(hashes, tokens, 4) == hashes and len(hashes) == 1
    calls = []
    real = bh.hash_block_tokens
    monkeypatch.setattr(bh, "hash_block_tokens", lambda *a: calls.append(a) or real(*a))
    tokens += [6, 7, 8]  # block 1 becomes full, block 2 is partial
    new = extend_block_hashes(hashes, tokens, 4)
    assert len(calls) == 1 and len(new) == 1 and len(hashes) == 2
    assert extend_block_hashes(hashes, tokens, 4) == []  # nothing new: no work
    assert len(calls) == 1
    monkeypatch.undo()
    assert hashes == hash_full_blocks(tokens, 4)


def test_extend_rejects_hashes_beyond_tokens():
    with pytest.raises(ValueError):
        extend_block_hashes([1, 2], [0, 1, 2, 3], 4)


def test_chain_roots_keep_chains_apart():
    """A cache salt and LongRoPE's long factors root the chain (block_hash.chain_root): each root its own blocks,
    none shared with the plain chain or another root's; a plain request has no root."""
    from pagedllm.core.block_hash import chain_root

    tokens = list(range(12))
    assert chain_root() is None and chain_root(None, False) is None
    roots = [chain_root("a"), chain_root("b"), chain_root(None, True), chain_root("a", True)]
    assert roots[0] == chain_root("a")  # deterministic
    chains = [hash_full_blocks(tokens, 4)] + [hash_full_blocks(tokens, 4, root=r) for r in roots]
    assert len({h for chain in chains for h in chain}) == 3 * len(chains)  # no block shared between chains
    # extending block by block gives the same chain (the root only parents the first block)
    grown: list[int] = []
    for end in range(0, 13, 3):
        extend_block_hashes(grown, tokens[:end], 4, root=None if grown else roots[0])
    assert grown == chains[1]
