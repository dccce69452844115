"""Incremental detokenization: token ids arrive a few at a time, text deltas go out.

Two strategies, same contract (the concatenated deltas equal decoding the output ids in the context of
the prompt, and a delta never ends in a half character):
  * fast tokenizers with tokenizers' `DecodeStream` (Rust): decodes a small sliding window of ids per
    token, holding text back while it ends in an incomplete UTF-8 sequence.
  * otherwise (slow tokenizers, or if DecodeStream rejects a sequence) the prefix/read-offset method:
    decode tokens[prefix_offset:] and tokens[prefix_offset:read_offset] and emit the difference once
    it no longer ends in U+FFFD. Both windows stay a few tokens long, so a step is O(1).

The prompt's last few tokens seed the window so that context-dependent decoding (sentencepiece's
leading space, a space after a newline) matches decoding prompt + output as a whole.

`spaces_between_special_tokens` only changes slow tokenizers (it is a slow-tokenizer option; fast
tokenizers' decode() ignores it too), so both strategies match `tokenizer.decode`.
"""
from __future__ import annotations

import functools
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


class _OffsetDecoder:
    """prefix/read-offset incremental decoding over token strings (works for any HF tokenizer)."""

    def __init__(self, tokenizer: Any, context_ids: list[int], skip_special_tokens: bool,
                 spaces_between_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.special_ids = set(tokenizer.all_special_ids) if skip_special_tokens else set()
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
        # token id -> its text or None (not "": the caller maps it), straight into Rust: one call per token
        self.step_or_none = functools.partial(self.stream.step, self.backend)

    def step(self, token_id: int) -> str:
        return self.step_or_none(token_id) or ""


class IncrementalDetokenizer:
    """Turns a request's output token ids into text as they arrive.

    Invariant: output_text == concatenation of every delta returned by update(); it never ends in a
    partial UTF-8 character (that text is held back until the character completes).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, *, use_decode_stream: Optional[bool] = None,
                 token_str_cache: Optional[dict[int, str]] = None) -> None:
        self.tokenizer = tokenizer
        self.prompt_token_ids = list(prompt_token_ids)
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.token_ids: list[int] = []
        self._pieces: list[str] = []  # every delta returned, joined on demand (no copy of the text per token)
        self._token_strs = token_str_cache if token_str_cache is not None else _token_str_cache(tokenizer)
        if use_decode_stream is None:
            use_decode_stream = DecodeStream is not None and getattr(tokenizer, "is_fast", False)
        self._decoder: Any
        if use_decode_stream:
            self._decoder = _StreamDecoder(tokenizer, self.prompt_token_ids, skip_special_tokens)
            self._step_or_none = self._decoder.step_or_none
        else:
            self._decoder = self._offset_decoder()
            self._step_or_none = self._decoder.step

    def _offset_decoder(self) -> _OffsetDecoder:
        context = self.prompt_token_ids + self.token_ids
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
            text = "".join([self._step(token_id) for token_id in new_token_ids])
        return self._pieces_add(text)

    def _pieces_add(self, text: str) -> str:
        if text:
            self._pieces.append(text)
        return text

    def _step(self, token_id: int) -> str:
        try:
            text = self._step_or_none(token_id) or ""
        except Exception as e:
            text = self._after_failed_step(token_id, e)
        self.token_ids.append(token_id)
        return text

    def _after_failed_step(self, token_id: int, error: Exception) -> str:
        """A step raised `error`. DecodeStream refuses sequences whose decoded prefix changes; continue with the
        offset method, seeded with everything decoded so far. The offset method's errors are the caller's."""
        if not isinstance(self._decoder, _StreamDecoder):
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
