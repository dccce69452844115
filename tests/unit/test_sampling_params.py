"""SamplingParams: normalisation and clear ValueErrors for every user mistake."""
import pytest

from pagedllm.sampling_params import SamplingParams


def test_defaults_and_normalisation():
    p = SamplingParams(stop="###", top_k=-1, stop_token_ids=(5, 6))
    assert p.stop == ["###"] and p.top_k == 0 and p.stop_token_ids == [5, 6]
    assert p.best_of == 1 and p.max_tokens == 16 and not p.greedy
    assert p.all_stop_token_ids == {5, 6}
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(stop=None).stop == []
    assert isinstance(SamplingParams(temperature=1).temperature, float)


def test_clone_keeps_values_and_revalidates():
    p = SamplingParams(n=3, seed=1, stop=["a"], temperature=0.5)
    c = p.clone(n=1, best_of=1, seed=2)
    assert (c.n, c.seed, c.stop, c.temperature) == (1, 2, ["a"], 0.5)
    with pytest.raises(ValueError, match="top_p"):
        p.clone(top_p=2.0)


def test_fields_set_after_construction_are_checked_and_normalized_again():
    """vLLM's examples set fields on a built SamplingParams; checked() (LLM.generate's copy) normalizes and
    validates them as the constructor does, an unset best_of follows a new n, and the original stays as it is."""
    p = SamplingParams(stop_token_ids=[5])
    p.n, p.stop, p.stop_token_ids, p.logit_bias, p.top_k = 3, "##", [7], {"9": 1}, -1
    p.structured_outputs = {"choice": ["a", "b"]}
    c = p.checked()
    assert (c.n, c.best_of, c.stop, c.all_stop_token_ids, c.logit_bias, c.top_k) == (3, 3, ["##"], {7}, {9: 1.0}, 0)
    assert c.structured_outputs.choice == ["a", "b"] and p.stop == "##" and p.all_stop_token_ids == {5}
    assert SamplingParams().clone(n=2).best_of == 2 and SamplingParams(n=2, best_of=2).clone().best_of == 2
    p.max_tokens = 0
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        p.checked()


@pytest.mark.parametrize("kwargs, field", [
    (dict(n=0), "n must be"),
    (dict(n=1.5), "n must be an integer"),
    (dict(n=True), "n must be an integer"),
    (dict(n=2, best_of=1), "best_of must be >= n"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2.5), "top_k must be an integer"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.1), "min_p"),
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(temperature=float("inf")), "temperature must be a finite number"),
    (dict(temperature="hot"), "temperature must be a finite number"),
    (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(max_tokens=-5), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=10, max_tokens=5), r"min_tokens \(10\) must be <= max_tokens \(5\)"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(logprobs=-2), r"logprobs must be an integer >= 0, or -1 for the whole vocabulary"),
    (dict(prompt_logprobs=-3), "prompt_logprobs must be"),
    (dict(seed=1.5), "seed must be an integer"),
    (dict(stop=""), "stop must be a non-empty string"),
    (dict(stop=["ok", 3]), "stop must be"),
    (dict(stop=7), "stop must be a string or a list"),
    (dict(stop_token_ids=[1, -2]), "stop_token_ids"),
    (dict(stop_token_ids=3), "stop_token_ids must be a list"),
    (dict(stop="x", detokenize=False), "detokenize=True"),
    (dict(output_kind="stream"), "output_kind"),
])
def test_invalid_values_raise_clear_errors(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_valid_edge_values():
    SamplingParams(top_p=1.0, min_p=0.0, top_k=0, temperature=0.0, logprobs=20, max_tokens=1, min_tokens=1)
    SamplingParams(max_tokens=None, presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=1e-3)
    SamplingParams(seed=-5, stop_token_ids=[0], logprobs=0)
    SamplingParams(logprobs=-1, prompt_logprobs=-1)  # the whole vocabulary (vLLM); the engine checks its limit


@pytest.mark.parametrize("name", ["ignore_eos", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
                                  "include_stop_str_in_output"])
@pytest.mark.parametrize("value", ["no", 2, None])
def test_flags_must_be_booleans(name, value):
    """A string such as "no" would be truthy: the flag would turn on."""
    with pytest.raises(ValueError, match=f"{name} must be True or False"):
        SamplingParams(**{name: value})


def test_from_optional_fills_defaults_where_none_means_unset():
    """vLLM's SamplingParams.from_optional: None stands for the default of a field that takes no None, and keeps its
    meaning where the field has one (max_tokens: up to the context, seed: unseeded); values given are checked."""
    sp = SamplingParams.from_optional(n=None, temperature=None, top_p=0.5, top_k=None, max_tokens=None, seed=None,
                                      stop=None, ignore_eos=None, presence_penalty=None, logprobs=None,
                                      bad_words_token_ids=None)
    assert (sp.n, sp.best_of, sp.temperature, sp.top_p, sp.top_k) == (1, 1, 1.0, 0.5, 0)
    assert (sp.max_tokens, sp.seed, sp.stop, sp.ignore_eos, sp.presence_penalty, sp.logprobs) == \
        (None, None, [], False, 0.0, None)
    assert sp.bad_words_token_ids == []
    assert SamplingParams.from_optional(temperature=0.0, max_tokens=7, stop="x") == \
        SamplingParams(temperature=0.0, max_tokens=7, stop="x")
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_optional(top_p=0.0)
    with pytest.raises(TypeError, match="bogus"):
        SamplingParams.from_optional(bogus=1)
