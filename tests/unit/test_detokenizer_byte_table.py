"""The byte-table detokenizer (_ByteTableDecoder) against tokenizers' DecodeStream (_StreamDecoder), the path it
replaces for byte-level BPE: the same delta at every step, on the real SmolLM2 tokenizer and the tests' tiny
byte-level tokenizer (added tokens, special and not), for random id sequences that split multibyte characters,
hold invalid UTF-8, skipped specials and ids past the vocabulary; prompts that prime cleanly and ones that do not."""
import random

import pytest

from pagedllm import detokenizer as mod
from pagedllm.detokenizer import IncrementalDetokenizer, byte_table
from tests.conftest import build_tiny_tokenizer
from tests.unit.test_detokenizer import TEXTS, tokenizer  # noqa: F401 - the SmolLM2 fixture


@pytest.fixture(scope="module")
def tiny_tokenizer():
    tok = build_tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    tok.add_tokens(["wörd", " spaced token"])  # non-special added tokens, one with characters outside the byte map
    return tok


def _pools(tok, table):
    size = len(tok)
    single = [i for i in range(size) if len(table.raw[i]) == 1]  # single bytes: halves of characters, 0x80+
    partial = [i for i in range(size) if i not in table.texts]  # ids whose bytes alone are not clean text
    added = list(tok.backend_tokenizer.get_added_tokens_decoder())
    return single, partial, added


def _draw(rng, tok, pools, text_ids):
    single, partial, added = pools
    r = rng.random()
    if r < 0.35:
        return rng.choice(single)
    if r < 0.45 and partial:
        return rng.choice(partial)
    if r < 0.52:
        return rng.choice(added)
    if r < 0.54:
        return len(tok) + rng.randrange(50)  # past the tokenizer's vocabulary (a padded embedding): no text
    if r < 0.75:
        return rng.choice(text_ids)
    return rng.randrange(len(tok))


def _compare(tok, seed, rounds):
    rng = random.Random(seed)
    table = byte_table(tok, False)
    assert table is not None and byte_table(tok, True) is not None
    pools = _pools(tok, table)
    text_ids = tok.encode("".join(TEXTS), add_special_tokens=False)
    used = 0
    for _ in range(rounds):
        if rng.random() < 0.5:
            prompt = [_draw(rng, tok, pools, text_ids) for _ in range(rng.randint(0, 10))]
        else:  # a real prompt's tail, whole characters
            prompt = tok.encode(rng.choice(TEXTS), add_special_tokens=False)[-rng.randint(1, 30):]
        output = [_draw(rng, tok, pools, text_ids) for _ in range(rng.randint(1, 40))]
        for skip in (True, False):
            new = IncrementalDetokenizer(tok, prompt, skip, use_decode_stream=True)
            old = IncrementalDetokenizer(tok, prompt, skip, use_decode_stream=True, use_byte_table=False)
            assert isinstance(old._decoder, mod._StreamDecoder)
            used += isinstance(new._decoder, mod._ByteTableDecoder)
            i = 0
            while i < len(output):
                step = rng.choice((1, 1, 1, 2, 3))
                assert new.update(output[i:i + step]) == old.update(output[i:i + step]), (prompt, output, i, skip)
                i += step
            assert new.output_text == old.output_text and new.token_ids == old.token_ids
    return used


def test_byte_table_equals_decode_stream_smollm2(tokenizer):  # noqa: F811
    used = _compare(tokenizer, seed=0, rounds=1500)
    assert used > 1500  # most prompts prime cleanly: the table is what runs


def test_byte_table_equals_decode_stream_tiny_tokenizer(tiny_tokenizer):
    used = _compare(tiny_tokenizer, seed=1, rounds=1500)
    assert used > 1500


def test_byte_table_on_real_text_split_anywhere(tokenizer):  # noqa: F811
    """Real text (emoji, CJK, combining marks) cut at every position: deltas equal DecodeStream's, and join to
    the full decode."""
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        for cut in range(len(ids)):
            prompt, output = ids[:cut], ids[cut:]
            new = IncrementalDetokenizer(tokenizer, prompt, False)
            old = IncrementalDetokenizer(tokenizer, prompt, False, use_byte_table=False)
            for t in output:
                assert new.update([t]) == old.update([t])
            if "\ufffd" not in tokenizer.decode(prompt):
                assert isinstance(new._decoder, mod._ByteTableDecoder)
                assert new.output_text == tokenizer.decode(output)


def test_dirty_prompt_keeps_decode_stream(tokenizer):  # noqa: F811
    """A prompt ending in half a character is context up to its last whole character (the byte table primes on
    it); one that ends in U+FFFD for as far as that looks (invalid bytes: no clean suffix to prime with) stays with
    DecodeStream."""
    ids = tokenizer.encode(" 🎉", add_special_tokens=False)
    assert len(ids) >= 2
    detok = IncrementalDetokenizer(tokenizer, ids[:1], False)
    assert isinstance(detok._decoder, mod._ByteTableDecoder)
    invalid = {b: c for c, b in mod._byte_level_chars().items()}[0xE4]  # lead bytes that no byte continues
    detok = IncrementalDetokenizer(tokenizer, [tokenizer.convert_tokens_to_ids(invalid)] * 12, False)
    assert isinstance(detok._decoder, mod._StreamDecoder)


def test_table_tokens_match_the_tokenizer(tokenizer):  # noqa: F811
    for skip in (False, True):
        table = byte_table(tokenizer, skip)
        ids = list(range(len(tokenizer)))
        for token_id, text in zip(ids, tokenizer.backend_tokenizer.decode_batch([[i] for i in ids],
                                                                                skip_special_tokens=skip)):
            assert table.raw[token_id].decode("utf-8", "replace") == text
        assert (table.raw[tokenizer.eos_token_id] == b"") == skip


def test_no_table_for_other_decoders(tmp_path):
    """A tokenizer whose decoder is not exactly ByteLevel (here WordPiece) gets no table: DecodeStream as before."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "##lo": 2, "world": 3}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    assert byte_table(fast, True) is None
    detok = IncrementalDetokenizer(fast, [1], True)
    assert isinstance(detok._decoder, mod._StreamDecoder)
    assert detok.update([3]) == " world"


def test_no_table_when_the_tokenizer_decodes_differently(monkeypatch, tiny_tokenizer):
    """The table is only used where it decodes like the tokenizer: a mismatch found while checking it -> None."""
    backend = tiny_tokenizer.backend_tokenizer

    class Lying:
        decoder = backend.decoder

        def __getattr__(self, name):
            return getattr(backend, name)

        def decode(self, ids, skip_special_tokens=True):
            return backend.decode(ids, skip_special_tokens=skip_special_tokens) + "x"

    class Wrapper:
        backend_tokenizer = Lying()

    assert mod._build_byte_table(Wrapper(), True) is None


def test_gemma_sentencepiece_keeps_decode_stream(gemma3_270m_gguf_path):
    """A real tokenizer that is not byte-level BPE (Gemma 3: sentencepiece-style, byte fallback): no table."""
    from pagedllm.tokenizer import get_tokenizer

    tok = get_tokenizer(gemma3_270m_gguf_path)
    assert byte_table(tok, True) is None and byte_table(tok, False) is None
    ids = tok.encode("Héllo wörld 🎉", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("Say:", add_special_tokens=False))
    assert isinstance(detok._decoder, mod._StreamDecoder)
    assert "".join(detok.update([t]) for t in ids) == tok.decode(ids)


def test_chat_logprob_bytes_rebuild_split_characters(tokenizer):  # noqa: F811
    """Chat logprobs' `bytes`: a token that is part of a multi-byte character (its text alone is U+FFFD) carries its
    own bytes, so the entries' bytes joined are the text's UTF-8 (what OpenAI's field is for); with
    return_tokens_as_token_ids, the label's bytes (as vLLM)."""
    from types import SimpleNamespace

    from pagedllm.entrypoints.openai.chat_completions import _chat_logprobs

    ids = tokenizer.encode("é 😀🎉 ok", add_special_tokens=False)
    entries = [{t: SimpleNamespace(logprob=-0.5, rank=1, decoded_token=None)} for t in ids]
    content = _chat_logprobs(tokenizer, ids, entries, top_n=1)["content"]
    assert any(e["token"] == "\ufffd" for e in content)  # the emoji are split across tokens
    assert bytes(b for e in content for b in e["bytes"]).decode("utf-8") == "é 😀🎉 ok"
    assert all(e["top_logprobs"][0]["bytes"] == e["bytes"] for e in content)
    as_ids = _chat_logprobs(tokenizer, ids, entries, top_n=0, as_ids=True)["content"]
    assert as_ids[0]["bytes"] == list(f"token_id:{ids[0]}".encode())


def test_offset_method_skips_special_added_tokens(gemma3_270m_gguf_path):
    """The offset method (slow tokenizers; a fast one's fallback when DecodeStream refuses a sequence, as after
    invalid byte-fallback bytes) skips every added token marked special, as decode does: Gemma's <start_of_turn> /
    <end_of_turn> are special but not in all_special_ids (was: their text leaked with skip_special_tokens=True)."""
    from pagedllm.tokenizer import get_tokenizer

    tok = get_tokenizer(gemma3_270m_gguf_path)
    ids = tok.encode("<start_of_turn>user\nhi<end_of_turn>", add_special_tokens=False)
    for use_decode_stream in (True, False):
        detok = IncrementalDetokenizer(tok, [2], skip_special_tokens=True, use_decode_stream=use_decode_stream)
        assert "".join(detok.update([i]) for i in ids) == tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_prompt_that_decode_stream_refuses(gemma3_270m_gguf_path):
    """A token-id prompt ending in byte-fallback bytes that are not UTF-8 ("A", then <0xE2>, then a word): priming
    DecodeStream with it raises "Invalid prefix" (the "A" it decoded becomes U+FFFD); the detokenizer takes the
    offset method instead (was: that exception out of add_request, the request failed)."""
    from pagedllm.tokenizer import get_tokenizer

    tok = get_tokenizer(gemma3_270m_gguf_path)
    hi = tok.encode("Hi", add_special_tokens=False)
    prompt = hi + tok.convert_tokens_to_ids(["<0x41>", "<0xE2>"]) + hi
    output = tok.encode(" there 🎉", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    assert "".join(detok.update([t]) for t in output) == tok.decode(output) == " there 🎉"


def test_chat_logprob_bytes_of_byte_fallback_tokens():
    """A sentencepiece-style vocabulary (Gemma's, Llama 2's) spells a character it lacks as byte-fallback tokens
    ("<0xE4>"), each U+FFFD alone: their logprob `bytes` are those bytes, so the entries rebuild the text as for
    byte-level BPE (they were U+FFFD's bytes, which rebuild nothing)."""
    from types import SimpleNamespace

    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    from pagedllm.entrypoints.openai.chat_completions import _chat_logprobs

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    vocab.update({piece: len(vocab) + i for i, piece in enumerate(["▁", "o", "k", "▁o", "▁ok"])})
    backend = Tokenizer(models.BPE(vocab, [("▁", "o"), ("▁o", "k")], unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    ids = tok.encode("中😀 ok", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids)[:2] == ["<0xE4>", "<0xB8>"] and tok.decode(ids) == "中😀 ok"
    entries = [{t: SimpleNamespace(logprob=-0.5, rank=1, decoded_token=None)} for t in ids]
    content = _chat_logprobs(tok, ids, entries, top_n=1)["content"]
    assert content[0]["token"] == "\ufffd" and content[0]["bytes"] == [0xE4]
    assert bytes(b for e in content for b in e["bytes"]).decode("utf-8") == "中😀 ok"
    assert all(e["top_logprobs"][0]["bytes"] == e["bytes"] for e in content)
