"""Chained hashes of full KV-cache blocks: the keys of the prefix cache.

The hash of full block i is sha256(hash of block i-1, the block's token ids, the extra key), truncated to
128 bits. Chaining makes a block's hash name its whole prefix, so two blocks with the same tokens after
different prefixes never match. The extra key is the request's LoRA id: KV computed under one adapter must
never serve another. A request's chain root (`chain_root`: its cache salt, vLLM's `cache_salt`; LongRoPE's long
factors; dynamic NTK's prompt length past the model's context) stands in for the first block's parent: only
requests of the same root share blocks, so one tenant cannot learn from hit timings what another's prompts were.
Only *full* blocks are hashed; a partial last block is never cached.

Invariants:
  * deterministic across processes and machines (explicit little-endian serialization, no builtin hash(),
    so PYTHONHASHSEED does not matter);
  * hashes are non-negative ints below 2**128 (collisions are astronomically unlikely at any pool size).
"""
from __future__ import annotations

import hashlib
import struct
from typing import Optional, Sequence

BlockHash = int

_HASH_BYTES = 16  # 128 bits of the sha256 digest
_VERSION_TAG = b"pagedllm.block_hash.v1"
# Header: has_parent flag, parent hash bytes, has_extra flag, extra key (signed 64-bit), token count.
_HEADER = struct.Struct(f"<B{_HASH_BYTES}sBqI")
_NO_PARENT = bytes(_HASH_BYTES)


def check_cache_salt(cache_salt: object) -> None:
    """vLLM's rule: a salt, when given, is a non-empty string (an empty one would look salted and share blocks)."""
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise ValueError(f"'cache_salt' must be a non-empty string if given, got {cache_salt!r}.")


def chain_root(cache_salt: Optional[str] = None, rope_long: bool = False,
               ntk_prompt_len: Optional[int] = None, embeds_key: Optional[bytes] = None) -> Optional[BlockHash]:
    """The stand-in parent of a request's first block: None for a plain request, else a hash of what keeps its
    chain apart from every other (its cache salt: other tenants' prompts; LongRoPE's long factors: the same tokens
    rotated with the short ones; dynamic NTK's prompt length past the model's context: the base it rotated with;
    a prompt given as embeddings: the sha256 of their content, its token ids being placeholders)."""
    if cache_salt is None and not rope_long and ntk_prompt_len is None and embeds_key is None:
        return None
    salt = b"" if cache_salt is None else cache_salt.encode("utf-8", "surrogatepass")
    # One tag (a model has one kind of rope), then the salt: "N" and digits up to ":" read as no "S"-tagged salt.
    rope = b"N%d:" % ntk_prompt_len if ntk_prompt_len is not None else b"L" if rope_long else b"S"
    # Embeds: a tag of their own and a fixed-length digest first, so no salt can spell the same bytes.
    embeds = b"" if embeds_key is None else b"-embeds" + hashlib.sha256(embeds_key).digest()
    digest = hashlib.sha256(_VERSION_TAG + b".root" + embeds + rope + salt).digest()
    return int.from_bytes(digest[:_HASH_BYTES], "little")


def hash_block_tokens(
    parent_block_hash: Optional[BlockHash],
    token_ids: Sequence[int],
    lora_id: Optional[int] = None,
) -> BlockHash:
    """Hash of one full block given the hash of the block before it (None for the first block)."""
    if parent_block_hash is None:
        parent = _NO_PARENT
        has_parent = 0
    else:
        parent = parent_block_hash.to_bytes(_HASH_BYTES, "little")
        has_parent = 1
    has_extra = 0 if lora_id is None else 1
    header = _HEADER.pack(has_parent, parent, has_extra, lora_id or 0, len(token_ids))
    # Token ids as signed 64-bit: any vocabulary fits, and the encoding is fixed-width (unambiguous).
    body = struct.pack(f"<{len(token_ids)}q", *token_ids)
    digest = hashlib.sha256(_VERSION_TAG + header + body).digest()
    return int.from_bytes(digest[:_HASH_BYTES], "little")


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    lora_id: Optional[int] = None,
    root: Optional[BlockHash] = None,
) -> list[BlockHash]:
    """Hashes of every full block of token_ids (a trailing partial block is ignored)."""
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, token_ids, block_size, lora_id, root)
    return hashes


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    lora_id: Optional[int] = None,
    root: Optional[BlockHash] = None,
) -> list[BlockHash]:
    """Append, in place, the hashes of the full blocks of token_ids not yet in block_hashes. `root`: the parent
    of the first block (None: none; chain_root: what separates whole chains).

    block_hashes must be the hashes of the first len(block_hashes) blocks of token_ids (a request's
    token list only grows, so its earlier hashes stay valid). Returns only the newly added hashes;
    cost is proportional to the new blocks, so calling this every step is cheap.
    """
    num_full_blocks = len(token_ids) // block_size
    start = len(block_hashes)
    if start > num_full_blocks:
        raise ValueError(
            f"block_hashes has {start} entries but token_ids only has {num_full_blocks} full blocks."
        )
    parent = block_hashes[-1] if block_hashes else root
    for i in range(start, num_full_blocks):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size], lora_id)
        block_hashes.append(parent)
    return block_hashes[start:]
