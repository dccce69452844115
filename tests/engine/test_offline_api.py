"""The offline LLM API's edges, as vLLM's: a request that fails mid-run, min_tokens past the context's room,
logprobs=-1, truncate_prompt_tokens, a tqdm-like use_tqdm. One tiny random model, CPU."""
from __future__ import annotations

import logging
import math
import re

import pytest
import torch

from pagedllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=64, max_model_len=64)


def _greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, **kwargs)


@pytest.mark.parametrize("n", [1, 2])
def test_a_request_failing_mid_run_ends_with_error_and_the_others_finish(llm, caplog, n):
    """allowed_token_ids = a stop token with min_tokens not reached leaves no token at step 1: that request (or one
    of its n samples) ends with finish_reason "error" and a warning; every other prompt gets its whole output."""
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}, {"prompt_token_ids": [10, 11, 12]}]
    ok = _greedy(max_tokens=6)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, ok, use_tqdm=False)]
    doomed = SamplingParams(max_tokens=4, allowed_token_ids=[40], stop_token_ids=[40], min_tokens=2, n=n, seed=3)
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        outs = llm.generate(prompts, [ok, doomed, ok], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in (outs[0], outs[2])] == [alone[0], alone[2]]
    assert all(o.outputs[0].finish_reason == "length" for o in (outs[0], outs[2]))
    failed = outs[1]
    assert failed.finished and len(failed.outputs) == n
    assert all(c.finish_reason == "error" and c.token_ids == [] for c in failed.outputs)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "finish_reason 'error'" in r.message]
    assert warned and "Prompt 1" in warned[0].message and "no token satisfies" in warned[0].message
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.kv_cache_manager.get_usage() == 0


@pytest.mark.parametrize("max_tokens, asked", [(40, "max_tokens=40"), (None, "max_tokens unset")])
def test_min_tokens_past_the_contexts_room_names_what_was_asked(llm, max_tokens, asked):
    """max_tokens is clamped to the room the prompt leaves (64 - 50 = 14): a min_tokens beyond it is refused with
    the user's own values and why, not with the clamped max_tokens they never gave."""
    params = SamplingParams(max_tokens=max_tokens, min_tokens=20)
    with pytest.raises(ValueError) as e:
        llm.generate({"prompt_token_ids": [5] * 50}, params, use_tqdm=False)
    message = str(e.value)
    assert "min_tokens=20" in message and asked in message and "room for 14" in message and "(14)" not in message
    assert not llm.engine.has_unfinished_requests()


def test_logprobs_minus_one_is_the_whole_vocabulary(tiny_llama_dir, llm):
    """As vLLM: -1 asks for every token's logprob, allowed where max_logprobs covers the vocabulary (-1 does)."""
    with pytest.raises(ValueError, match=r"logprobs=-1 \(the whole vocabulary: 512 tokens\) is more than"):
        llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(logprobs=-1), use_tqdm=False)
    wide = LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=16, max_model_len=128, max_logprobs=-1)
    out = wide.generate({"prompt_token_ids": [5, 6, 7]}, _greedy(max_tokens=2, logprobs=-1, prompt_logprobs=-1),
                        use_tqdm=False)[0]
    positions = out.outputs[0].logprobs + out.prompt_logprobs[1:]
    assert len(positions) == 2 + 2
    for position in positions:
        assert len(position) == 512 and sorted(lp.rank for lp in position.values()) == list(range(1, 513))
        assert math.isclose(sum(math.exp(lp.logprob) for lp in position.values()), 1.0, rel_tol=1e-4)
    for token, position in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        assert position[token].rank == 1  # greedy
    few = wide.generate({"prompt_token_ids": [5, 6, 7]}, _greedy(max_tokens=2, logprobs=3), use_tqdm=False)[0]
    assert few.outputs[0].token_ids == out.outputs[0].token_ids
    assert all(len(p) == 3 for p in few.outputs[0].logprobs)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    """As vLLM's SamplingParams.truncate_prompt_tokens: the prompt's last k tokens (-1: max_model_len), for token
    and text prompts; the same tokens as giving those k alone."""
    ids = list(range(5, 25))
    kept = llm.generate({"prompt_token_ids": ids}, _greedy(max_tokens=4, truncate_prompt_tokens=6), use_tqdm=False)[0]
    alone = llm.generate({"prompt_token_ids": ids[-6:]}, _greedy(max_tokens=4), use_tqdm=False)[0]
    assert kept.prompt_token_ids == ids[-6:] and kept.outputs[0].token_ids == alone.outputs[0].token_ids
    text = "the quick brown fox jumps over the lazy dog"
    whole = llm.get_tokenizer().encode(text)
    out = llm.generate(text, _greedy(max_tokens=2, truncate_prompt_tokens=3), use_tqdm=False)[0]
    assert out.prompt_token_ids == whole[-3:] and out.prompt == text
    for k in (-1, len(ids), 64):  # nothing to cut
        assert llm.generate({"prompt_token_ids": ids}, _greedy(max_tokens=1, truncate_prompt_tokens=k),
                            use_tqdm=False)[0].prompt_token_ids == ids
    long = list(range(5, 105))  # longer than the context: -1 keeps max_model_len tokens, which leave no room
    with pytest.raises(ValueError, match="leaves no room"):
        llm.generate({"prompt_token_ids": long}, _greedy(max_tokens=1, truncate_prompt_tokens=-1), use_tqdm=False)
    assert llm.generate({"prompt_token_ids": long}, _greedy(max_tokens=1, truncate_prompt_tokens=63),
                        use_tqdm=False)[0].prompt_token_ids == long[-63:]
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens \(65\) is greater than max_model_len \(64\)"):
        llm.generate({"prompt_token_ids": ids}, _greedy(max_tokens=1, truncate_prompt_tokens=65), use_tqdm=False)
    for bad in (0, -2):
        with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1"):
            SamplingParams(truncate_prompt_tokens=bad)


class _Bar:
    """A tqdm-like bar that records what the LLM does with it."""

    made: list["_Bar"] = []

    def __init__(self, **kwargs) -> None:
        self.kwargs, self.n, self.postfix, self.closed = kwargs, 0, None, False
        _Bar.made.append(self)

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text

    def close(self) -> None:
        self.closed = True


def test_use_tqdm_takes_a_tqdm_like_class(llm):
    """As vLLM: a callable use_tqdm builds the progress bar (generate and chat)."""
    _Bar.made.clear()
    llm.generate([{"prompt_token_ids": [5, 6]}] * 3, _greedy(max_tokens=2), use_tqdm=_Bar)
    llm.chat([{"role": "user", "content": "hi"}], _greedy(max_tokens=2), use_tqdm=_Bar)
    assert [(b.kwargs["total"], b.n, b.closed) for b in _Bar.made] == [(3, 3, True), (1, 1, True)]
    assert _Bar.made[0].kwargs["desc"] == "Processed prompts" and "toks/s" in _Bar.made[0].postfix


def test_fields_set_on_sampling_params_after_construction_are_honoured(llm):
    """vLLM's examples edit llm.get_default_sampling_params() in place: stop_token_ids set so stopped nothing
    (the stop set was computed at construction), a bad value passed unchecked."""
    prompt = {"prompt_token_ids": [5, 6, 7]}
    params = _greedy(max_tokens=6)
    first = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids[0]
    params.stop_token_ids = [first]
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([first], "stop", first)
    params.max_tokens = 0
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        llm.generate(prompt, params, use_tqdm=False)


def test_calls_from_two_threads_run_one_after_another(llm):
    """A second thread's generate() while one runs stepped the same engine and took its outputs (a KeyError in the
    model runner, or the first call's "engine stopped with unfinished requests"): it now waits its turn."""
    import threading

    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(max_tokens=4), use_tqdm=False)]
    got: dict = {}

    def second() -> None:
        got["second"] = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(max_tokens=4), use_tqdm=False)]

    other = threading.Thread(target=second)

    class _StartsTheOther(_Bar):  # built inside the first call, its requests queued
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            other.start()
            other.join(0.3)
            got["waited"] = other.is_alive()

    got["first"] = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(max_tokens=4),
                                                                 use_tqdm=_StartsTheOther)]
    other.join(30)
    assert got == {"waited": True, "first": alone, "second": alone}


def test_vllm_calls_that_are_not_built_say_so(llm):
    """llm.reward() on a causal LM served for generation, and llm.llm_engine (vLLM's), were a bare AttributeError."""
    with pytest.raises(ValueError, match="LLM.reward needs a token or sequence classifier, or convert / task 'reward'"):
        llm.reward("hi")
    with pytest.raises(AttributeError, match="no llm_engine .* use llm.get_tokenizer"):
        llm.llm_engine.get_tokenizer()


def test_vllm_prompt_types(llm):
    """`from vllm import TokensPrompt, TextPrompt` (vllm.inputs) as vLLM scripts write them: the prompt dicts."""
    from pagedllm import TextPrompt, TokensPrompt

    text = llm.get_tokenizer().decode([5, 6, 7])
    outs = llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7]), TextPrompt(prompt=text)], _greedy(max_tokens=2),
                        use_tqdm=False)
    assert outs[0].prompt_token_ids == [5, 6, 7] and outs[1].prompt == text


def test_vllm_output_kind_enum_and_extra_args(llm):
    """vLLM scripts pass output_kind=RequestOutputKind.X (vllm.sampling_params) and extra_args: both were refused
    (an import error, a TypeError). generate still returns each request's final output, as vLLM's offline LLM."""
    from pagedllm.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, output_kind=RequestOutputKind.DELTA,
                            extra_args={"plugin": [1, "x"]})
    assert params.output_kind == "delta" and params.extra_args == {"plugin": [1, "x"]}
    assert SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY).output_kind == "final_only"
    out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0]
    assert out.finished and out.outputs[0].token_ids == \
        llm.generate([[5, 6, 7]], _greedy(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="output_kind must be"):
        SamplingParams(output_kind=1)
    with pytest.raises(ValueError, match="extra_args must be a dict or None, got list"):
        SamplingParams(extra_args=[1])


def test_chat_tools_must_be_a_list(llm):
    """tools={...} (one tool, not a list) was read key by key: "tools[0] must be {'type': 'function', ...}"."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(ValueError, match="tools must be a list of tool dicts, got dict"):
        llm.chat([{"role": "user", "content": "hi"}], _greedy(max_tokens=1), tools=tool, use_tqdm=False)
    with pytest.raises(ValueError, match=re.escape("tools[1] must be {'type': 'function'")):  # a tuple is a list
        llm.chat([{"role": "user", "content": "hi"}], _greedy(max_tokens=1), tools=(tool, 5), use_tqdm=False)


def test_torch_tensor_token_ids(llm):
    """{"prompt_token_ids": tokenizer(..., return_tensors="pt").input_ids[0]}: a tensor's items are 0-d tensors, refused
    as 'must be integers in [0, V), got tensor(5)'; integer ones are token ids now, float / bool ones still refused."""
    ref = llm.generate([[5, 6, 7]], _greedy(max_tokens=3), use_tqdm=False)[0]
    out = llm.generate({"prompt_token_ids": torch.tensor([5, 6, 7])}, _greedy(max_tokens=3), use_tqdm=False)[0]
    assert out.prompt_token_ids == [5, 6, 7] and type(out.prompt_token_ids[0]) is int
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    for bad in (torch.tensor([5.0, 6.0]), torch.tensor([True, False])):
        with pytest.raises(ValueError, match="Prompt token ids must be integers"):
            llm.generate({"prompt_token_ids": bad}, _greedy(max_tokens=1), use_tqdm=False)


@pytest.mark.parametrize("content, fragment", [
    ([{"type": "image_url", "image_url": {"url": "x"}}], "messages[0]: Message content of type 'image_url' is not "
                                                         "supported yet; only 'text' parts are."),
    ([{"type": "text", "text": 3}], "messages[0]: A message content part of type 'text' needs a 'text' string."),
    (["plain"], "messages[0]: Message content of type None"),
    ([{"text": "hi"}], "messages[0]: A message content part needs a 'type' ('text' for text), got an object with keys "
                       "['text']."),
    (["plain"], "(a part is an object such as {'type': 'text', 'text': ...}, got a str)."),
    (5, "messages[0]: 'content' must be a string or a list of text parts."),
])
def test_chat_refuses_the_content_the_server_refuses(llm, content, fragment):
    """chat() reads content with the server's chat_template.message_text: the same parts are refused, with a
    ValueError naming the message."""
    with pytest.raises(ValueError, match=re.escape(fragment)):
        llm.chat([{"role": "user", "content": content}], _greedy(max_tokens=1), use_tqdm=False)


def test_chat_template_file_or_text_as_vllm_reads_it(llm, tmp_path):
    """chat_template is a file's template or the template itself; a path that cannot be read, or a template that
    does not parse, is a ValueError (a missing file's path was rendered as the prompt)."""
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    plain = llm.get_tokenizer().encode("[hi]", add_special_tokens=False)
    for source in (str(tmp_path / "t.jinja"), template):
        out = llm.chat([{"role": "user", "content": "hi"}], _greedy(max_tokens=1), use_tqdm=False,
                       chat_template=source)
        assert out[0].prompt_token_ids == plain, source
    with pytest.raises(ValueError, match=re.escape("The chat template '/no/such/template.jinja' looks like a file "
                                                   "path, but it could not be read (FileNotFoundError")):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False, chat_template="/no/such/template.jinja")
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match=re.escape(f"The chat template file {tmp_path / 'bad.jinja'} does not "
                                                   "parse as a Jinja template: Unexpected end of template.")):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False, chat_template=str(tmp_path / "bad.jinja"))
    from pagedllm.entrypoints.openai.chat_template import load_chat_template

    # --chat-template's text: a typed \n is a newline there (vLLM), and non-ASCII text stays as it is
    assert load_chat_template("é{{ x }}\\n▁", from_command_line=True) == "é{{ x }}\n▁"


def test_chat_template_kwargs_win_over_the_named_arguments(llm):
    """As vLLM's chat(): chat_template_kwargs are merged over chat_template / add_generation_prompt /
    continue_final_message / tools (they were "got multiple values for keyword argument"); what chat() itself
    decides (tokenize) is refused by name."""
    conv = [{"role": "user", "content": "hi"}]
    one = _greedy(max_tokens=1)
    bare = llm.chat(conv, one, use_tqdm=False, add_generation_prompt=False)[0].prompt_token_ids
    assert llm.chat(conv, one, use_tqdm=False, chat_template_kwargs={"add_generation_prompt": False}
                    )[0].prompt_token_ids == bare
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    assert llm.chat(conv, one, use_tqdm=False, chat_template_kwargs={"chat_template": template}
                    )[0].prompt_token_ids == llm.get_tokenizer().encode("[hi]", add_special_tokens=False)
    with pytest.raises(ValueError, match=re.escape("chat_template_kwargs ['tokenize']: chat() tokenizes")):
        llm.chat(conv, one, use_tqdm=False, chat_template_kwargs={"tokenize": False})
    with pytest.raises(ValueError, match=re.escape("chat_template_kwargs may not set ['messages']: the template")):
        llm.chat(conv, one, use_tqdm=False, chat_template_kwargs={"messages": []})  # once "got multiple values"


def test_chat_joins_text_parts_as_the_server_does(llm):
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    joined = llm.chat([{"role": "user", "content": "one\ntwo"}], _greedy(max_tokens=1), use_tqdm=False)[0]
    assert llm.chat([{"role": "user", "content": parts}], _greedy(max_tokens=1),
                    use_tqdm=False)[0].prompt_token_ids == joined.prompt_token_ids


# Shows which form the content came in: S(string) or L(part) per text part
PARTS_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{% if m['content'] is string %}S({{ m['content'] }})"
                  "{% else %}{% for p in m['content'] %}L({{ p['text'] }}){% endfor %}{% endif %}{% endfor %}")


def test_chat_template_content_format_as_vllm(llm):
    """vLLM's chat_template_content_format: "string" hands the template one string (text parts joined by
    newlines), "openai" a list of text parts (a string is one part), "auto" the form the template reads (parts
    where it loops over a message's content). Each equals transformers' rendering of the content in that form."""
    tok = llm.get_tokenizer()
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    conv = [{"role": "user", "content": parts}, {"role": "assistant", "content": "three"}]
    as_string = [{"role": "user", "content": "one\ntwo"}, {"role": "assistant", "content": "three"}]
    as_parts = [{"role": "user", "content": parts}, {"role": "assistant", "content": [{"type": "text", "text": "three"}]}]

    def chat(fmt, template=PARTS_TEMPLATE, messages=conv):
        return llm.chat(messages, _greedy(max_tokens=1), use_tqdm=False, chat_template=template,
                        add_generation_prompt=False, chat_template_content_format=fmt)[0]

    def hf(messages, template=PARTS_TEMPLATE):
        ids = tok.apply_chat_template(messages, chat_template=template, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)

    assert chat("openai").prompt == "<user>L(one)L(two)<assistant>L(three)"
    assert chat("openai").prompt_token_ids == chat("auto").prompt_token_ids == hf(as_parts)
    assert chat("string").prompt == "<user>S(one\ntwo)<assistant>S(three)"
    assert chat("string").prompt_token_ids == hf(as_string)
    # a template that reads content as a string: "auto" is "string"; "openai" hands it the list all the same
    plain = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    assert chat("auto", plain).prompt_token_ids == chat("string", plain).prompt_token_ids == hf(as_string, plain)
    one = [{"role": "user", "content": "hi"}]  # (the list's repr is long for the tiny model's context)
    assert chat("openai", plain, one).prompt_token_ids == hf([{"role": "user", "content": [
        {"type": "text", "text": "hi"}]}], plain)


@pytest.mark.parametrize("bad", ["json", "OpenAI", None, 1])
def test_chat_template_content_format_refuses_other_values(llm, bad):
    with pytest.raises(ValueError, match=re.escape("chat_template_content_format must be 'auto', 'string' or "
                                                   f"'openai', got {bad!r}.")):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False, chat_template_content_format=bad)


@pytest.mark.parametrize("bad", [10 ** 9, -3, 2.0, True, "7"])
def test_a_bad_prompt_id_in_a_batch_fails_the_call_and_leaves_nothing_running(llm, bad):
    """The engine checks the prompt ids (the one check: the LLM no longer repeats it) before the detokenizer sees
    them; the prompts queued before it are taken back; numpy integers are token ids."""
    import numpy as np

    prompts = [{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": np.array([7, 8])}, {"prompt_token_ids": [9, bad]}]
    with pytest.raises(ValueError, match=re.escape(f"Prompt token ids must be integers in [0, 512), got {bad!r}.")):
        llm.generate(prompts, _greedy(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    outs = llm.generate(prompts[:2], _greedy(max_tokens=2), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [[5, 6], [7, 8]] and type(outs[1].prompt_token_ids[0]) is int
    # one prompt of numpy integers, as a plain list of ids is (it was read as a list of prompts, each refused)
    assert llm.generate(list(np.array([7, 8])), _greedy(max_tokens=2), use_tqdm=False)[0].prompt_token_ids == [7, 8]


@pytest.mark.parametrize("bad", [5, b"hi", 2.5])
def test_a_prompt_of_the_wrong_type_is_a_type_error_naming_prompts(llm, bad):
    """generate(5) was "'int' object is not iterable" and generate(b"hi") read each byte as a prompt ("Unsupported
    prompt type int"); both calls, and beam_search's, name the argument. The engine serves the next call."""
    from pagedllm import BeamSearchParams

    with pytest.raises(TypeError, match=r"generate\(\) takes prompts: a string, a token-id list, a prompt dict"):
        llm.generate(bad, _greedy(max_tokens=2), use_tqdm=False)
    with pytest.raises(TypeError, match=r"beam_search\(\) takes prompts: a string"):
        llm.beam_search(bad, BeamSearchParams(beam_width=2, max_tokens=2))
    (out,) = llm.generate((p for p in [{"prompt_token_ids": [5, 6]}]), _greedy(max_tokens=2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


def test_prompts_and_prompt_token_ids_together_are_refused(llm):
    """generate("hi", prompt_token_ids=[[5]]) ran "hi" and dropped the ids without a word; the legacy keyword alone
    still runs its prompts."""
    with pytest.raises(ValueError, match="prompts or prompt_token_ids, not both"):
        llm.generate("hi", _greedy(max_tokens=2), prompt_token_ids=[[5, 6]], use_tqdm=False)
    (out,) = llm.generate(sampling_params=_greedy(max_tokens=2), prompt_token_ids=[[5, 6]], use_tqdm=False)
    assert out.prompt_token_ids == [5, 6] and len(out.outputs[0].token_ids) == 2


def test_start_and_stop_profile_write_a_trace_as_vllm(llm, tmp_path, monkeypatch):
    """vLLM's documented llm.start_profile() / llm.stop_profile() were a bare AttributeError: they trace the calls in
    between into $VLLM_TORCH_PROFILER_DIR, and say so when that is unset."""
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    monkeypatch.delenv("PAGEDLLM_TORCH_PROFILER_DIR", raising=False)
    with pytest.raises(RuntimeError, match="VLLM_TORCH_PROFILER_DIR"):
        llm.start_profile()
    with pytest.raises(RuntimeError, match="No profile is running"):
        llm.stop_profile()
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "traces"))
    llm.start_profile(profile_prefix="run1")
    with pytest.raises(RuntimeError, match="already running"):
        llm.start_profile()
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, _greedy(max_tokens=2), use_tqdm=False)
    llm.stop_profile()
    assert len(out[0].outputs[0].token_ids) == 2
    traces = list((tmp_path / "traces").glob("run1.*.pt.trace.json"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0


def test_profiler_config_as_vllm_names_it(tiny_llama_dir, tmp_path, monkeypatch):
    """vLLM's LLM(profiler_config={"profiler": "torch", "torch_profiler_dir": DIR}) was "Unknown engine argument": it
    is where start_profile() writes; what pagedllm cannot honour is refused when the LLM is built."""
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    monkeypatch.delenv("PAGEDLLM_TORCH_PROFILER_DIR", raising=False)
    from pagedllm.config import EngineArgs

    for bad, message in [({"profiler": "cuda", "torch_profiler_dir": "x"}, "profiler 'cuda' is not supported"),
                         ({"profiler": "torch"}, "needs both profiler 'torch' and torch_profiler_dir"),
                         ({"profiler": "torch", "torch_profiler_dir": "x", "delay_iterations": 2}, "delay_iterations"),
                         ({"profiler": "torch", "torch_profiler_dir": "x", "torch_profiler_with_stack": "yes"},
                          "with_stack must be true or false"), ("x", "must be a dict")]:
        with pytest.raises(ValueError, match=message):
            EngineArgs(model=tiny_llama_dir, profiler_config=bad).validate()
    with LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=16, max_model_len=32,
             profiler_config={"profiler": "torch", "torch_profiler_dir": tmp_path / "p",
                              "torch_profiler_with_stack": True}) as llm:
        llm.start_profile()
        llm.generate({"prompt_token_ids": [5, 6]}, _greedy(max_tokens=2), use_tqdm=False)
        llm.stop_profile()
    assert len(list((tmp_path / "p").glob("pagedllm.*.pt.trace.json"))) == 1


def test_set_tokenizer_tokenizes_renders_and_detokenizes_with_the_new_one(smollm2_gguf_path, smollm2_cache_dir,
                                                                          monkeypatch):
    """vLLM's LLM.set_tokenizer on the default model: a copy of its tokenizer that lower-cases what it encodes,
    writes spaces as "_" when it decodes, has another chat template and EOS; every later call uses it."""
    import copy

    from tokenizers import decoders, normalizers

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", smollm2_cache_dir)
    llm = LLM(model=smollm2_gguf_path, num_gpu_blocks_override=64, max_model_len=512)
    old = llm.get_tokenizer()
    new = copy.deepcopy(old)
    new.backend_tokenizer.normalizer = normalizers.Lowercase()
    new.backend_tokenizer.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Replace(" ", "_")])
    new.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}<|im_start|>assistant\n")
    new.eos_token = "<|endoftext|>"
    greedy = _greedy(max_tokens=8)
    text, chat = "The Capital of FRANCE is", [{"role": "user", "content": "Say hi"}]
    before = llm.generate(text, greedy, use_tqdm=False)[0]
    chat_before = llm.chat(chat, greedy, use_tqdm=False)[0]
    from pagedllm.structured_output import StructuredOutputsParams

    choice = SamplingParams(temperature=0.0, max_tokens=5,
                            structured_outputs=StructuredOutputsParams(choice=["Paris city", "London"]))
    assert llm.generate(text, choice, use_tqdm=False)[0].outputs[0].text in ("Paris city", "London")
    assert llm.engine.structured.manager._tokenizer is old
    assert " " in before.outputs[0].text and llm.engine.eos_token_ids[0] == old.eos_token_id != new.eos_token_id

    llm.set_tokenizer(new)
    assert llm.get_tokenizer() is new and llm.engine.eos_token_ids[0] == new.eos_token_id
    after = llm.generate(text, greedy, use_tqdm=False)[0]
    assert after.prompt_token_ids == new.encode(text) != before.prompt_token_ids == old.encode(text)
    assert after.outputs[0].text == new.decode(after.outputs[0].token_ids) and " " not in after.outputs[0].text
    # the same ids decoded by each tokenizer: only the text changes
    same = llm.generate({"prompt_token_ids": before.prompt_token_ids}, greedy, use_tqdm=False)[0].outputs[0]
    assert same.token_ids == before.outputs[0].token_ids
    assert same.text == before.outputs[0].text.replace(" ", "_") != before.outputs[0].text
    chat_after = llm.chat(chat, greedy, use_tqdm=False)[0]
    want = new.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "input_ids") else want
    assert chat_after.prompt_token_ids == list(want) != chat_before.prompt_token_ids
    assert chat_after.prompt == new.decode(want) and chat_after.prompt.startswith("<|im_start|>user\nsay_hi")
    # grammars compile against the new tokenizer (the structured-output manager built before it is dropped)
    assert llm.generate(text, choice, use_tqdm=False)[0].outputs[0].text in ("Paris_city", "London")
    assert llm.engine.structured.manager._tokenizer is new
    with pytest.raises(TypeError, match="set_tokenizer\\(\\) takes a tokenizer"):
        llm.set_tokenizer("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert llm.get_tokenizer() is new
    llm.shutdown()
