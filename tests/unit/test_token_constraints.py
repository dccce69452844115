"""logit_bias, allowed_token_ids and bad_words in the batched sampler, against a direct computation, plus their
validation in SamplingParams and the engine-side checks."""
import pytest
import torch

from pagedllm.layers.sampler import Sampler, SamplingMetadata
from pagedllm.sampling_constraints import banned_by_bad_words, check_against_engine, tokenize_bad_words
from pagedllm.sampling_params import SamplingParams

V = 64


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return request.param


def run(logits, params, device, outputs=None):
    outputs = outputs if outputs is not None else [[] for _ in params]
    meta = SamplingMetadata.build(params, [[] for _ in params], outputs, [None] * len(params), V, device)
    return meta, Sampler()(logits.clone().to(device), meta).sampled_token_ids.cpu()


def test_logit_bias_matches_direct_computation(device):
    torch.manual_seed(0)
    logits = torch.randn(4, V)
    greedy = logits.argmax(-1)
    biases = [{int(greedy[0]): -100.0}, {}, {3: 100.0, 5: -2.5}, {int(greedy[3]): -100.0, 7: 0.5}]
    params = [SamplingParams(temperature=0.0, logit_bias=b or None) for b in biases]
    meta, got = run(logits, params, device)
    assert not meta.argmax_only  # a biased step never takes the argmax-only shortcut
    want = logits.clone()
    for i, b in enumerate(biases):
        for t, v in b.items():
            want[i, t] += v
    assert torch.equal(got, want.argmax(-1))
    assert got[0] != greedy[0] and got[1] == greedy[1] and got[2] == 3


def test_allowed_token_ids_restrict_greedy_and_random_rows(device):
    torch.manual_seed(1)
    logits = torch.randn(6, V)
    allowed = [5, 9, 40]
    params = [SamplingParams(temperature=0.0, allowed_token_ids=allowed),
              SamplingParams(temperature=0.0)] + [SamplingParams(temperature=1.5, allowed_token_ids=allowed)] * 4
    _, got = run(logits, params, device)
    assert got[0] == allowed[int(logits[0, allowed].argmax())]
    assert got[1] == logits[1].argmax()  # the unconstrained row of the same batch is untouched
    assert set(got[2:].tolist()) <= set(allowed)
    # many draws: every allowed id turns up, nothing else ever does
    many = [SamplingParams(temperature=5.0, allowed_token_ids=allowed)] * 300
    _, draws = run(torch.zeros(300, V), many, device)
    assert set(draws.tolist()) == set(allowed)


def test_bad_words_ban_the_last_token_only_after_the_rest(device):
    logits = torch.zeros(3, V)
    logits[:, 7] = 5.0  # the favourite
    logits[:, 8] = 4.0
    seqs = [[7], [2, 8]]  # a one-token word and a two-token word
    params = [SamplingParams(temperature=0.0, bad_words=["x"], bad_words_token_ids=seqs)] * 3
    outputs = [[], [1, 2], [2, 1]]
    _, got = run(logits, params, device, outputs)
    # row 0: 7 banned -> 8; row 1 ends with 2: 7 and 8 banned -> the first of the zeros (0); row 2: 8 allowed
    assert got.tolist() == [8, 0, 8]
    assert banned_by_bad_words(seqs, [1, 2]) == [7, 8] and banned_by_bad_words(seqs, [2, 1]) == [7]


def test_unconstrained_greedy_batch_keeps_the_shortcut():
    meta = SamplingMetadata.build([SamplingParams(temperature=0.0)] * 2, [[], []], [[], []], [None, None], V, "cpu")
    assert meta.argmax_only and meta.constraints is None
    for kw in (dict(logit_bias={1: 1.0}), dict(allowed_token_ids=[1]),
               dict(bad_words=["a"], bad_words_token_ids=[[3]])):
        params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, **kw)]
        assert not SamplingMetadata.build(params, [[], []], [[], []], [None, None], V, "cpu").argmax_only, kw


def test_tokenize_bad_words_spells_both_forms():
    class Tok:
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]
    assert tokenize_bad_words(["ab"], Tok()) == [[97, 98], [32, 97, 98]]


@pytest.mark.parametrize("kwargs, message", [
    (dict(logit_bias={"x": 1.0}), "logit_bias keys must be token ids"),
    (dict(logit_bias={-1: 1.0}), "logit_bias keys must be token ids"),
    (dict(logit_bias={str(2 ** 70): 1.0}), "logit_bias keys must be token ids"),
    (dict(allowed_token_ids=[2 ** 64]), "allowed_token_ids must be a list of non-negative"),
    (dict(logit_bias={1: 101.0}), r"logit_bias values must be in \[-100, 100\]"),
    (dict(logit_bias={1: float("nan")}), "logit_bias values must be finite"),
    (dict(logit_bias=[1, 2]), "logit_bias must be a mapping"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must be a non-empty list"),
    (dict(allowed_token_ids=[1, -1]), "allowed_token_ids must be a list of non-negative"),
    (dict(bad_words="word"), "bad_words must be a list of strings"),
    (dict(bad_words=["ok", " "]), "bad_words must be a list of non-empty strings"),
    (dict(n=2, best_of=3), r"best_of > n is not supported yet"),
])
def test_invalid_constraints_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_logit_bias_string_keys_from_json_become_ints():
    assert SamplingParams(logit_bias={"12": -100, 3: 2}).logit_bias == {12: -100.0, 3: 2.0}


def test_engine_checks_vocab_and_max_logprobs():
    with pytest.raises(ValueError, match=r"logit_bias has token id\(s\) out of vocabulary \(0..63\): \[64\]"):
        check_against_engine(SamplingParams(logit_bias={64: 1.0}), V, 20)
    with pytest.raises(ValueError, match="allowed_token_ids has token id"):
        check_against_engine(SamplingParams(allowed_token_ids=[1, 99]), V, 20)
    with pytest.raises(ValueError, match="logprobs=21 is more than this server allows"):
        check_against_engine(SamplingParams(logprobs=21), V, 20)
    with pytest.raises(ValueError, match="prompt_logprobs=6 is more than"):
        check_against_engine(SamplingParams(prompt_logprobs=6), V, 5)
    with pytest.raises(ValueError, match="bad_words need a tokenizer"):
        check_against_engine(SamplingParams(bad_words=["x"]), V, 20)
    check_against_engine(SamplingParams(logprobs=64), V, -1)  # -1: up to the vocabulary
    check_against_engine(SamplingParams(logprobs=-1, prompt_logprobs=-1), V, -1)  # the whole vocabulary
    check_against_engine(SamplingParams(logprobs=-1), V, V)
    with pytest.raises(ValueError, match=r"prompt_logprobs=-1 \(the whole vocabulary: 64 tokens\) is more than "
                                         r"this server allows \(63\); start the engine with --max-logprobs -1"):
        check_against_engine(SamplingParams(prompt_logprobs=-1), V, V - 1)
