"""Incremental detokenization: token ids arrive a few at a time, text deltas go out.

Two strategies, same contract (the concatenated deltas equal decoding the output ids in the context of
the prompt, and a delta never ends in a half character):
  * fast tokenizers with tokenizers' `DecodeStream` (Rust): decodes a small sliding window of ids per
    token, holding text back while it ends in an incomplete UTF-8 sequence.
  * otherwise (slow tokenizers, or if DecodeStream rejects a sequence) the prefix/read-offset method:
    decode tokens[prefix_offset:] and tokens[prefix_offset:read_offset] and emit the difference once
    it no longer ends in U+FFFD. Both windows stay a few tokens long, so a step is O(1).

The prompt's last few tokens seed the window so that context-dependent decoding (sentencepiece's
leading space, a space after a newline) matches decoding prompt + output as a whole; up to its last whole
character (a token-id prompt can end in half of one: the output's bytes do not finish it).

`spaces_between_special_tokens` only changes slow tokenizers (it is a slow-tokenizer option; fast
tokenizers' decode() ignores it too), so both strategies match `tokenizer.decode`.
"""
from __future__ import annotations

import functools
import random
import weakref
from typing import Any, Iterable, Optional, Sequence

try:  # tokenizers >= 0.21
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover
    DecodeStream = None

_REPLACEMENT = "\ufffd"
# Prompt tokens kept as context for the offset method (vLLM uses the same 5 + 1).
_PREFIX_CONTEXT = 5
_MAX_STREAM_PRIMING = 24

_token_str_caches: "weakref.WeakKeyDictionary[Any, dict[int, str]]" = weakref.WeakKeyDictionary()


def _token_str_cache(tokenizer: Any) -> dict[int, str]:
    try:
        return _token_str_caches.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable
        return {}


def _skipped_ids(tokenizer: Any) -> set[int]:
    """The ids decode(skip_special_tokens=True) drops: the named special tokens and every added token marked special
    (Gemma's <start_of_turn> / <end_of_turn> are not among all_special_ids, and the Rust decode skips them too)."""
    ids = set(tokenizer.all_special_ids)
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(i for i, tok in added.items() if getattr(tok, "special", False))
    return ids


class _OffsetDecoder:
    """prefix/read-offset incremental decoding over token strings (works for any HF tokenizer)."""

    def __init__(self, tokenizer: Any, context_ids: list[int], skip_special_tokens: bool,
                 spaces_between_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.special_ids = _skipped_ids(tokenizer) if skip_special_tokens else set()
        self.use_added_vocab_split = not getattr(tokenizer, "is_fast", False) and bool(tokenizer.get_added_vocab())
        self.added_tokens = set(tokenizer.get_added_vocab()) if self.use_added_vocab_split else set()
        self.tokens: list[str] = self._to_tokens(context_ids[-(_PREFIX_CONTEXT + 1):])
        self.prefix_offset = max(len(self.tokens) - _PREFIX_CONTEXT, 0)
        self.read_offset = len(self.tokens)

    def _to_tokens(self, ids: Iterable[int]) -> list[str]:
        ids = [i for i in ids if i not in self.special_ids]
        return [t if t is not None else "" for t in self.tokenizer.convert_ids_to_tokens(ids)]

    def _to_string(self, tokens: list[str]) -> str:
        if not self.use_added_vocab_split:
            return self.tokenizer.convert_tokens_to_string(tokens)
        # Slow tokenizers: added tokens are not passed through the decoder (same as their decode()).
        parts: list[str] = []
        run: list[str] = []
        for tok in tokens:
            if tok in self.added_tokens:
                if run:
                    parts.append(self.tokenizer.convert_tokens_to_string(run))
                    run = []
                parts.append(tok)
            else:
                run.append(tok)
        if run:
            parts.append(self.tokenizer.convert_tokens_to_string(run))
        return (" " if self.spaces_between_special_tokens else "").join(parts)

    def step(self, token_id: int) -> str:
        new_tokens = self._to_tokens([token_id])
        if not new_tokens:
            return ""
        self.tokens.extend(new_tokens)
        prefix_text = self._to_string(self.tokens[self.prefix_offset:self.read_offset])
        new_text = self._to_string(self.tokens[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""  # incomplete character (or nothing visible yet): wait for more tokens
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """The text of the tokens step() still holds back (IncrementalDetokenizer.flush)."""
        if self.read_offset == len(self.tokens):
            return ""
        held = self.tokens[self.read_offset:]
        prefix_text = self._to_string(self.tokens[self.prefix_offset:self.read_offset])
        new_text = self._to_string(self.tokens[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.tokens)
        # (byte fallback: invalid bytes turn the whole run of byte tokens into U+FFFD, the prefix's text too)
        return new_text[len(prefix_text):] if new_text.startswith(prefix_text) else self._to_string(held)


class _StreamDecoder:
    """tokenizers.DecodeStream primed with a prompt suffix that decodes cleanly."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool) -> None:
        self.backend = tokenizer.backend_tokenizer
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        suffix = prompt_ids[-4:]
        for length in range(4, min(len(prompt_ids), _MAX_STREAM_PRIMING) + 1):
            candidate = prompt_ids[-length:]
            try:  # the Rust tokenizer itself: transformers' decode() costs milliseconds in argument checks
                text = self.backend.decode(candidate, skip_special_tokens=skip_special_tokens)
            except Exception:  # noqa: BLE001 - ids the backend refuses: the slow path says what is wrong
                text = tokenizer.decode(candidate, skip_special_tokens=skip_special_tokens)
            if _REPLACEMENT not in text:
                suffix = candidate
                break
        for token_id in suffix:
            self.stream.step(self.backend, token_id)
        self._rust_step = functools.partial(self.stream.step, self.backend)
        self.num_held = 0  # output ids stepped since the last text (flush decodes them)

    def step_or_none(self, token_id: int) -> Optional[str]:
        """token id -> its text or None (not "": the caller maps it)."""
        text = self._rust_step(token_id)
        self.num_held = 0 if text else self.num_held + 1
        return text

    def step(self, token_id: int) -> str:
        return self.step_or_none(token_id) or ""

    def flush(self, tokenizer: Any, ids: list[int], skip_special_tokens: bool) -> str:
        """The text of the last num_held ids (`ids`: prompt + output), decoded after the ids before them (context
        for sentencepiece's leading space); alone where that context's text is not a prefix (IncrementalDetokenizer.
        flush)."""
        held, self.num_held = self.num_held, 0
        if not held:
            return ""
        context, tail = ids[:-held][-_PREFIX_CONTEXT:], ids[-held:]
        text = tokenizer.decode(context + tail, skip_special_tokens=skip_special_tokens)
        prefix = tokenizer.decode(context, skip_special_tokens=skip_special_tokens) if context else ""
        return text[len(prefix):] if text.startswith(prefix) else tokenizer.decode(tail, skip_special_tokens=
                                                                                    skip_special_tokens)


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte <-> printable character map (what tokenizers' ByteLevel pre-tokenizer / decoder use)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class _ByteTable:
    """A byte-level BPE tokenizer's ids as bytes, for one skip_special_tokens setting.

    Valid only where tokenizers' decode(ids) is exactly String::from_utf8_lossy of the ids' bytes concatenated
    (the ByteLevel decoder and nothing else): `byte_table` builds it only after checking that against the
    tokenizer itself, every id alone and mixed sequences, and returns None otherwise.
      raw:   id -> its bytes (b"" for a skipped special token)
      texts: id -> its text, for ids whose bytes are whole valid UTF-8 not ending in U+FFFD (a step of such a
             token with nothing held back emits exactly that text)
    """

    __slots__ = ("raw", "texts", "backend", "skip_special_tokens", "__weakref__")

    def __init__(self, raw: dict[int, bytes], backend: Any, skip_special_tokens: bool) -> None:
        self.raw = raw
        self.backend = backend
        self.skip_special_tokens = skip_special_tokens
        texts: dict[int, str] = {}
        for token_id, data in raw.items():
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            if text and not text.endswith(_REPLACEMENT):
                texts[token_id] = text
        self.texts = texts

    def token_bytes(self, token_id: int) -> bytes:
        """An id outside the table (the model's vocabulary can be larger than the tokenizer's): tokenizers drops
        ids it has no token for, so it has no bytes; anything else (a negative id, ...) raises like the backend."""
        data = self.raw.get(token_id)
        if data is not None:
            return data
        if self.backend.decode([token_id], skip_special_tokens=self.skip_special_tokens) != "":
            raise ValueError(f"token id {token_id} is not in the byte table")
        return b""

    def text_of(self, ids: Sequence[int]) -> str:
        get = self.raw.get
        parts = [get(i) for i in ids]
        if None in parts:  # an id outside the table: token_bytes says what it is
            parts = [self.token_bytes(i) for i in ids]
        return b"".join(parts).decode("utf-8", "replace")


_byte_tables: "weakref.WeakKeyDictionary[Any, dict[bool, Optional[_ByteTable]]]" = weakref.WeakKeyDictionary()


def byte_table(tokenizer: Any, skip_special_tokens: bool) -> Optional[_ByteTable]:
    """The tokenizer's _ByteTable for this skip setting (built and checked once per tokenizer), or None where it
    cannot be shown to decode exactly like the tokenizer (not byte-level BPE, another decoder, a mismatch)."""
    try:
        tables = _byte_tables.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: not cached, so not worth building per request
        return None
    if skip_special_tokens not in tables:
        try:
            tables[skip_special_tokens] = _build_byte_table(tokenizer, skip_special_tokens)
        except Exception:  # noqa: BLE001 - anything unexpected: the tokenizer's own decoding stays in charge
            tables[skip_special_tokens] = None
    return tables[skip_special_tokens]


def _build_byte_table(tokenizer: Any, skip: bool) -> Optional[_ByteTable]:
    from tokenizers import decoders

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or DecodeStream is None or type(backend.decoder) is not decoders.ByteLevel:
        return None
    chars = _byte_level_chars()
    size = backend.get_vocab_size(with_added_tokens=True)
    added = backend.get_added_tokens_decoder()
    special = {tok.content for tok in added.values() if tok.special}
    raw: dict[int, bytes] = {}
    for token_id in range(size):
        token = backend.id_to_token(token_id)
        if token is None or (skip and token in special):
            raw[token_id] = b""
            continue
        try:  # the ByteLevel decoder: each character's byte, or the token's own UTF-8 if one has none
            raw[token_id] = bytes([chars[c] for c in token])
        except KeyError:
            raw[token_id] = token.encode("utf-8")
    table = _ByteTable(raw, backend, skip)
    # The proof that decode(ids) == from_utf8_lossy(bytes of ids): every id alone ...
    ids = list(range(size))
    decoded = backend.decode_batch([[i] for i in ids], skip_special_tokens=skip)
    for token_id, text in zip(ids, decoded):
        if raw[token_id].decode("utf-8", "replace") != text:
            return None
    # ... and sequences mixing added tokens, single bytes (halves of characters) and anything else.
    rng = random.Random(0)
    pool = [i for i in ids if len(raw[i]) == 1][:256] + list(added) + rng.sample(ids, min(size, 256))
    for _ in range(64):
        seq = [rng.choice(pool) for _ in range(rng.randint(2, 24))]
        if table.text_of(seq) != backend.decode(seq, skip_special_tokens=skip):
            return None
    return table


class _ByteTableDecoder:
    """DecodeStream's steps on a byte table, in Python (no window re-decoded per token).

    Why it is the same: DecodeStream emits decode(window)[len(prefix):] once that is longer than the prefix and
    does not end in U+FFFD. After it emitted (or was primed with ids that decode without U+FFFD), the window's
    bytes end on a whole character and its prefix is their decoding, so with decode(ids) == from_utf8_lossy of
    the bytes, what it emits next is lossy(bytes since that point), at the first step where that is non-empty and
    does not end in U+FFFD. So the whole state is those bytes (`pending`)."""

    __slots__ = ("step_or_none", "flush")

    def __init__(self, table: _ByteTable) -> None:
        texts_get = table.texts.get
        token_bytes = table.token_bytes
        pending = b""

        def step_or_none(token_id: int) -> Optional[str]:
            nonlocal pending
            if not pending:
                text = texts_get(token_id)
                if text is not None:
                    return text
            data = pending + token_bytes(token_id)
            text = data.decode("utf-8", "replace")
            if text and text[-1] != _REPLACEMENT:
                pending = b""
                return text
            pending = data
            return None

        def flush() -> str:
            nonlocal pending
            text, pending = pending.decode("utf-8", "replace"), b""
            return text

        self.step_or_none = step_or_none
        self.flush = flush  # the text of the bytes held back (IncrementalDetokenizer.flush)

    @staticmethod
    def primed(tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool) -> Optional["_ByteTableDecoder"]:
        """One for a request whose prompt ends as _StreamDecoder would prime it cleanly (the same choice of
        prompt suffix, on the table); None where _StreamDecoder must do it (no table, a dirty suffix)."""
        table = byte_table(tokenizer, skip_special_tokens)
        if table is None:
            return None
        try:
            for length in range(4, min(len(prompt_ids), _MAX_STREAM_PRIMING) + 1):
                if _REPLACEMENT not in table.text_of(prompt_ids[-length:]):
                    return _ByteTableDecoder(table)
            if len(prompt_ids) < 4 and _REPLACEMENT not in table.text_of(prompt_ids):
                return _ByteTableDecoder(table)  # a short prompt: _StreamDecoder primes with all of it
        except Exception:  # noqa: BLE001 - ids the table refuses: _StreamDecoder as before
            return None
        return None


# A character is at most 4 bytes: the tokens of a prompt's unfinished last character, with skipped special tokens
# between them, are within this many of its end.
_MAX_UNFINISHED_TAIL = 8


def _finished_prompt(tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool) -> list[int]:
    """The prompt without its last tokens where they are bytes of a character it does not finish (a token-id prompt
    can end so). The output's text is decode(output ids): bytes it continues that character with are its own U+FFFD,
    not the prompt's character finished, and the prompt's partial character is no U+FFFD of the output."""
    backend = getattr(tokenizer, "backend_tokenizer", None)

    def decode(ids: list[int]) -> str:
        if backend is not None:
            try:  # the Rust tokenizer itself (transformers' decode() costs milliseconds in argument checks)
                return backend.decode(ids, skip_special_tokens=skip_special_tokens)
            except Exception:  # noqa: BLE001 - ids the backend refuses: the tokenizer's own decode says why
                pass
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    n = len(prompt_ids)
    try:
        for drop in range(min(n, _MAX_UNFINISHED_TAIL) + 1):
            end = n - drop
            if end == 0 or not decode(prompt_ids[max(0, end - _MAX_UNFINISHED_TAIL):end]).endswith(_REPLACEMENT):
                return prompt_ids[:end]
    except Exception:  # noqa: BLE001 - ids no decode takes: the decoders' own fallbacks deal with the whole prompt
        return prompt_ids
    return prompt_ids  # U+FFFD for as far as it looks: invalid bytes (or the character itself), not an unfinished one


class IncrementalDetokenizer:
    """Turns a request's output token ids into text as they arrive.

    Invariant: output_text == concatenation of every delta returned by update() (and flush()); update() never
    leaves it ending in a partial UTF-8 character (that text is held back until the character completes, or until
    flush() at the end gives it as decode does).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, *, use_decode_stream: Optional[bool] = None,
                 token_str_cache: Optional[dict[int, str]] = None, use_byte_table: bool = True) -> None:
        self.tokenizer = tokenizer
        self.prompt_token_ids = list(prompt_token_ids)
        # The decoders' context: the prompt up to its last whole character.
        self._context_ids = (_finished_prompt(tokenizer, self.prompt_token_ids, skip_special_tokens)
                             if self.prompt_token_ids else [])
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.token_ids: list[int] = []
        self._pieces: list[str] = []  # every delta returned, joined on demand (no copy of the text per token)
        self._token_strs = token_str_cache if token_str_cache is not None else _token_str_cache(tokenizer)
        if use_decode_stream is None:
            use_decode_stream = DecodeStream is not None and getattr(tokenizer, "is_fast", False)
        self._decoder: Any
        if use_decode_stream:
            # Byte-level BPE: the same steps from a byte table (_ByteTableDecoder); else tokenizers' DecodeStream.
            try:
                self._decoder = ((use_byte_table and
                                  _ByteTableDecoder.primed(tokenizer, self._context_ids, skip_special_tokens))
                                 or _StreamDecoder(tokenizer, self._context_ids, skip_special_tokens))
                self._step_or_none = self._decoder.step_or_none
            except Exception:  # noqa: BLE001 - DecodeStream refused the prompt suffix it was primed with ("Invalid
                # prefix": byte-fallback bytes that are invalid UTF-8 turn text already decoded into U+FFFD, a
                # token-id prompt can end so): the offset method, as after a step that fails (vLLM restarts it).
                self._decoder = self._offset_decoder()
                self._step_or_none = self._decoder.step
        else:
            self._decoder = self._offset_decoder()
            self._step_or_none = self._decoder.step

    def _offset_decoder(self) -> _OffsetDecoder:
        context = self._context_ids + self.token_ids
        return _OffsetDecoder(self.tokenizer, context, self.skip_special_tokens, self.spaces_between_special_tokens)

    @property
    def output_text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Append new output token ids; return the text they complete (may be "")."""
        if len(new_token_ids) == 1:  # the common case: one token per step, in as few Python calls as it takes
            token_id = new_token_ids[0]
            try:
                text = self._step_or_none(token_id) or ""
            except Exception as e:
                text = self._after_failed_step(token_id, e)
            self.token_ids.append(token_id)
        else:
            text = "".join([self.step_text(token_id) for token_id in new_token_ids])
        return self._pieces_add(text)

    def step_text(self, token_id: int) -> str:
        """update([token_id]) for a caller that keeps the text itself (a plain stream sends it and forgets it):
        the delta, not added to output_text."""
        try:
            text = self._step_or_none(token_id) or ""
        except Exception as e:
            text = self._after_failed_step(token_id, e)
        self.token_ids.append(token_id)
        return text

    def flush(self, keep: bool = True) -> str:
        """At the end of the output: the text the steps still hold back (the last tokens end in an incomplete UTF-8
        character, or decode to a legitimate U+FFFD), decoded as tokenizer.decode does (U+FFFD for the partial
        bytes), so that output_text == decode(all ids). Without it a request that stops by length in the middle of
        a character, or whose last token is "\ufffd", loses that text. Call it once, after the last update.
        keep=False: the text is not added to output_text (step_text's callers)."""
        decoder = self._decoder
        if isinstance(decoder, _StreamDecoder):
            text = decoder.flush(self.tokenizer, self._context_ids + self.token_ids, self.skip_special_tokens)
        else:
            text = decoder.flush()
        return self._pieces_add(text) if keep else text

    def _pieces_add(self, text: str) -> str:
        if text:
            self._pieces.append(text)
        return text

    def _after_failed_step(self, token_id: int, error: Exception) -> str:
        """A step raised `error`. DecodeStream refuses sequences whose decoded prefix changes; continue with the
        offset method, seeded with everything decoded so far. The offset method's errors are the caller's."""
        if not isinstance(self._decoder, (_StreamDecoder, _ByteTableDecoder)):
            raise error
        self._decoder = self._offset_decoder()
        self._step_or_none = self._decoder.step
        return self._decoder.step(token_id)

    def decode_token(self, token_id: int) -> str:
        """The token on its own as text (for logprobs); cached per tokenizer."""
        text = self._token_strs.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._token_strs[token_id] = text
        return text

    def decode_tokens(self, token_ids: list[int]) -> list[str]:
        cache = self._token_strs
        missing = [t for t in dict.fromkeys(token_ids) if t not in cache]
        if missing:
            for t, text in zip(missing, self.tokenizer.batch_decode([[t] for t in missing])):
                cache[t] = text
        return [cache[t] for t in token_ids]
