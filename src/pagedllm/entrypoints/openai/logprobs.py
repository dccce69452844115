"""Logprob formatting shared by chat and completions: token strings, per-position (chosen, top-k) entries."""
from __future__ import annotations

from typing import Any, Optional

_REPLACEMENT = "\ufffd"


def token_str(tokenizer: Any, token_id: int, lp: Any = None) -> str:
    s = getattr(lp, "decoded_token", None)
    if s is None:
        s = tokenizer.decode([token_id])
    return s


def token_label(tokenizer: Any, token_id: int, lp: Any = None, as_ids: bool = False) -> str:
    """A logprob entry's `token`: its text, or with vLLM's `return_tokens_as_token_ids` "token_id:<id>" (a token
    that is part of a multi-byte character has no text of its own; the id names it exactly)."""
    return f"token_id:{token_id}" if as_ids else token_str(tokenizer, token_id, lp)


def token_bytes(tokenizer: Any, token_id: int, label: str) -> list[int]:
    """OpenAI's `bytes` of a logprob entry whose `token` is `label`: its UTF-8, but for a token that is part of a
    multi-byte character (its text alone is U+FFFD) the token's own bytes where the tokenizer is byte-level BPE or
    has byte-fallback tokens (sentencepiece's "<0xE4>": Gemma, Llama 2), which a client joins to rebuild the
    character (what the field is for); U+FFFD's bytes would rebuild nothing."""
    if _REPLACEMENT in label:
        from pagedllm.detokenizer import byte_table

        table = byte_table(tokenizer, False)
        raw = table.raw.get(token_id) if table is not None else _fallback_byte(tokenizer, token_id)
        if raw:
            return list(raw)
    return list(label.encode("utf-8"))


def _fallback_byte(tokenizer: Any, token_id: int) -> Optional[bytes]:
    """The byte of a byte-fallback token ("<0xE4>", which tokenizers' ByteFallback decoder turns into that byte)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or "ByteFallback" not in type(backend.decoder).__name__ + str(backend.decoder):
        return None
    piece = backend.id_to_token(token_id)
    if piece is None or len(piece) != 6 or not piece.startswith("<0x") or not piece.endswith(">"):
        return None
    try:
        return bytes([int(piece[3:5], 16)])
    except ValueError:
        return None


def iter_logprobs(tokenizer: Any, token_ids: list[int], logprobs: Optional[list], as_ids: bool = False,
                  with_ids: bool = False):
    """Yield (token_str, logprob, [(top_str, top_logprob, rank), ...] by rank) per generated position; `as_ids`:
    the strings are "token_id:<id>" (`token_label`). `with_ids`: (token_id, token_str, logprob, [(top_id, top_str,
    top_logprob, rank), ...]) instead."""
    if not logprobs:
        return
    for tid, entry in zip(token_ids, logprobs):
        chosen = entry.get(tid) if entry else None
        lp = float(chosen.logprob) if chosen is not None else float("-inf")
        tops = []
        for top_id, top in sorted((entry or {}).items(), key=lambda kv: getattr(kv[1], "rank", 0) or 0):
            item = (token_label(tokenizer, top_id, top, as_ids), float(top.logprob), getattr(top, "rank", None))
            tops.append((top_id, *item) if with_ids else item)
        label = token_label(tokenizer, tid, chosen, as_ids)
        yield (tid, label, lp, tops) if with_ids else (label, lp, tops)


def text_lengths(tokenizer: Any, token_ids: list[int], logprobs: Optional[list]) -> list[int]:
    """The text length of each position `iter_logprobs` yields (completions' text_offset counts text, also when
    the token strings are ids)."""
    if not logprobs:
        return []
    return [len(token_str(tokenizer, tid, entry.get(tid) if entry else None))
            for tid, entry in zip(token_ids, logprobs)]


def safe_float(x: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number.
    return x if x > -9999.0 else -9999.0


def prompt_logprobs_json(tokenizer: Any, prompt_logprobs: Optional[list]) -> Optional[list]:
    """vLLM's `prompt_logprobs` field: per prompt position None (the first) or {token id: {logprob, rank,
    decoded_token}} for the prompt's token and the top-k."""
    if prompt_logprobs is None:
        return None
    return [None if entry is None else
            {str(tid): {"logprob": safe_float(float(lp.logprob)), "rank": lp.rank,
                        "decoded_token": token_str(tokenizer, tid, lp)} for tid, lp in entry.items()}
            for entry in prompt_logprobs]
