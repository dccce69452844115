"""Structured outputs through the real engine (offline LLM): the grammar mask makes even a random model emit
output that matches the schema / regex / choice / grammar, unconstrained neighbours in the same batch keep the
tokens the unconstrained engine gives them, and bad specs are refused with the library's reason."""
from __future__ import annotations

import json
import re

import pytest

jsonschema = pytest.importorskip("jsonschema", reason="validates the structured outputs")

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.structured_output import GuidedDecodingParams, StructuredOutputsParams  # noqa: E402

# Bounded everywhere (maxLength, integer ranges, enums) so even a random model finishes within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "color", "ok"],
}
REGEX = r"[a-c]{2}-[0-9]{3}"
CHOICES = ["alpha", "beta", "gamma"]
GRAMMAR = 'root ::= "(" digit ("+" digit)* ")"\ndigit ::= [0-9]'


def _so(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(disable_any_whitespace=True, **kw)


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir: str) -> LLM:
    return LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=128, max_num_seqs=16)


def test_random_model_follows_every_kind_batched_with_free_requests(tiny_llm: LLM) -> None:
    prompts = ["hello there", "a b c", "json please", "pick one", "count", "free two"]
    greedy = dict(temperature=0.0, max_tokens=80)
    params = [
        SamplingParams(**greedy),
        SamplingParams(**greedy, structured_outputs=_so(json=SCHEMA)),
        SamplingParams(**greedy, structured_outputs=_so(regex=REGEX)),
        SamplingParams(**greedy, structured_outputs=_so(choice=CHOICES)),
        SamplingParams(**greedy, structured_outputs=_so(grammar=GRAMMAR)),
        SamplingParams(temperature=0.0, max_tokens=12),
    ]
    outs = tiny_llm.generate(prompts, params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    jsonschema.validate(json.loads(texts[1]), SCHEMA)
    assert re.fullmatch(REGEX, texts[2]), texts[2]
    assert texts[3] in CHOICES
    assert re.fullmatch(r"\([0-9](\+[0-9])*\)", texts[4]), texts[4]
    for i in (1, 2, 3, 4):
        assert outs[i].outputs[0].finish_reason == "stop", (i, texts[i])
    # The unconstrained rows are exactly what the engine gives them alone.
    alone = tiny_llm.generate([prompts[0], prompts[5]], [params[0], params[5]], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in alone] == [outs[0].outputs[0].token_ids, outs[5].outputs[0].token_ids]


def test_random_sampling_and_json_object(tiny_llm: LLM) -> None:
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=80, structured_outputs=_so(json=SCHEMA))
              for s in range(3)]
    params.append(SamplingParams(temperature=0.0, max_tokens=60, guided_decoding=GuidedDecodingParams(
        choice=["yes", "no"])))
    outs = tiny_llm.generate(["x", "y", "z", "w"], params, use_tqdm=False)
    for o in outs[:3]:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    assert outs[3].outputs[0].text in ("yes", "no")


def test_min_json_object_and_dict_params(tiny_llm: LLM) -> None:
    # A dict is accepted for structured_outputs; json_object gives some JSON object (bounded by max_tokens, so
    # only a prefix check: the text starts an object and uses only JSON characters).
    sp = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs={"choice": ["on", "off"]})
    assert tiny_llm.generate(["q"], sp, use_tqdm=False)[0].outputs[0].text in ("on", "off")
    obj = tiny_llm.generate(["q"], SamplingParams(temperature=0.0, max_tokens=8,
                                                  structured_outputs=_so(json_object=True)), use_tqdm=False)
    assert obj[0].outputs[0].text.startswith("{")


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_choices_beyond_ascii(tiny_llama_dir: str, backend: str) -> None:
    """Each backend's choice grammar takes the string's own tokens: xgrammar's emitted an emoji as two UTF-16
    surrogates (invalid UTF-8: an empty text), llguidance's refused 'é' with a lexer error."""
    from pagedllm.structured_output.backend import backend_class
    from pagedllm.tokenizer import get_tokenizer

    tok = get_tokenizer(tiny_llama_dir)
    grammars = backend_class(backend)(tok, len(tok), [tok.eos_token_id])
    text = 'café 🙂 "\\ ok\n'
    grammar = grammars.new_grammar(grammars.compile(_so(choice=[text, "no"])))
    assert grammar.accept_tokens(tok.encode(text, add_special_tokens=False) + [tok.eos_token_id])
    assert grammar.is_terminated()


@pytest.mark.parametrize("spec, reason", [
    ({"json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}, "no-such-type"),
    ({"regex": "(unclosed"}, "regex"),
    ({"grammar": "root ::= undefined_rule"}, "undefined_rule"),
    # Compiles, but allows no first token (once: an aborted request with empty text).
    ({"regex": "[^\\x00-\\U0010FFFF]"}, "matches no text at all"),
    ({"grammar": 'root ::= [^\\x00-\\U0010FFFF]'}, "matches no text at all"),
    ({"json": {"anyOf": []}}, "no JSON value satisfies the schema (anyOf is empty)"),
])
def test_invalid_specs_are_value_errors_with_the_reason(tiny_llm: LLM, spec: dict, reason: str) -> None:
    with pytest.raises(ValueError, match="Invalid structured_outputs") as e:
        tiny_llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=spec), use_tqdm=False)
    assert reason in str(e.value) or "parenthesis" in str(e.value)
    # The engine is still fine afterwards.
    assert tiny_llm.generate(["x"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_params_shape_errors() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(structured_outputs=_so(regex="a"), guided_decoding=_so(regex="b"))
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="Unknown structured_outputs field"):
        SamplingParams(structured_outputs={"jsn": {}})
    # The switches are booleans (a string would fail to decode in the engine process); null is the default.
    for bad in ({"json_object": "yes"}, {"json": {}, "disable_any_whitespace": "no"},
                {"regex": "a", "disable_additional_properties": 1}):
        with pytest.raises(ValueError, match=f"structured_outputs.{next(reversed(bad))} must be true or false"):
            StructuredOutputsParams.from_dict(bad)
    default = StructuredOutputsParams.from_dict({"json": {}, "disable_any_whitespace": None})
    assert default.disable_any_whitespace is False
    # msgpack carries 64-bit integers only (a wider one could not be sent to the engine process)
    with pytest.raises(ValueError, match="integer 1000000000000000000000000000000, beyond 64 bits"):
        StructuredOutputsParams(json={"anyOf": [{"enum": [1, 10 ** 30]}]})
    assert StructuredOutputsParams(json={"type": "integer", "maximum": 2 ** 63 - 1, "minimum": -(2 ** 63)}).json


def _mixed_batch() -> tuple[list[str], list[SamplingParams]]:
    prompts = ["one", "two", "three", "four"]
    params = [SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=_so(json=SCHEMA)),
              SamplingParams(temperature=0.0, max_tokens=10),
              SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=_so(regex=REGEX)),
              SamplingParams(temperature=0.0, max_tokens=10)]
    return prompts, params


def test_async_scheduling_gives_the_same_tokens(tiny_llm: LLM, tiny_llama_dir: str) -> None:
    """With async scheduling a masked request waits for its previous token; the result is the synchronous one."""
    prompts, params = _mixed_batch()
    sync = tiny_llm.generate(prompts, params, use_tqdm=False)
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=128, max_num_seqs=16,
              async_scheduling=True)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in sync]
    jsonschema.validate(json.loads(got[0].outputs[0].text), SCHEMA)


def test_guidance_backend(tiny_llama_dir: str) -> None:
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=128,
              structured_outputs_config={"backend": "guidance"})
    schema = dict(SCHEMA, properties=dict(SCHEMA["properties"], name={"type": "string", "maxLength": 6}))
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=80, structured_outputs=_so(json=schema))
              for s in range(2)]
    params.append(SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=_so(grammar='start: "x" "y"+')))
    # EBNF grammars and choices go through llguidance's GBNF converter (once refused: "'module' object is not
    # callable" with llguidance 1.x, where gbnf_to_lark became a module).
    params.append(SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=_so(grammar=GRAMMAR)))
    params.append(SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=_so(choice=CHOICES)))
    outs = llm.generate(["a", "b", "c", "d", "e"], params, use_tqdm=False)
    for o in outs[:2]:
        jsonschema.validate(json.loads(o.outputs[0].text), schema)
    assert re.fullmatch("xy+", outs[2].outputs[0].text)
    assert re.fullmatch(r"\([0-9](\+[0-9])*\)", outs[3].outputs[0].text), outs[3].outputs[0].text
    assert outs[4].outputs[0].text in CHOICES
    with pytest.raises(ValueError, match="backend must be one of"):
        LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=16, max_model_len=256,
            structured_outputs_config={"backend": "nope"})
    # vLLM's reasoning keys are the server's (it gives requests their reasoning end): accepted, checked for type
    with pytest.raises(ValueError, match="enable_in_reasoning must be true or false"):
        LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=16, max_model_len=256,
            structured_outputs_config={"reasoning_parser": "qwen3", "enable_in_reasoning": "yes"})


def test_offline_chat_with_tools_returns_parsed_calls(tiny_llm: LLM) -> None:
    """LLM.chat(tools=...): tools and earlier calls reach the prompt; a (here grammar-forced) hermes call comes
    back parsed on the output's tool_calls, the text left as the model wrote it."""
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
                                                                                   "properties": {}}}}]
    history = [{"role": "user", "content": "time?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
               {"role": "user", "content": "again?"}]
    forced = r'<tool_call>\n\{"name": "get_time", "arguments": \{\}\}\n</tool_call>'
    # A short template that takes tools (the tiny model has 512 positions): the native path, arguments as objects.
    template = ("{% for t in tools or [] %}{{ t.function.name }};{% endfor %}{% for m in messages %}<|{{ m.role }}|>"
                "{{ m.content or '' }}{% for c in m.tool_calls or [] %}{{ c.function.name }}{{ c.function.arguments"
                " | tojson }}{% endfor %}<|eos|>{% endfor %}<|assistant|>")
    out = tiny_llm.chat(history, SamplingParams(temperature=0.0, max_tokens=60,
                                                structured_outputs=_so(regex=forced)), tools=tools,
                        chat_template=template, use_tqdm=False)[0]
    assert out.prompt.startswith("get_time;") and "get_time{}" in out.prompt and "noon" in out.prompt
    call = out.outputs[0].tool_calls[0]
    assert (call.name, json.loads(call.arguments)) == ("get_time", {}) and call.id.startswith("call_")
    plain = tiny_llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0.0, max_tokens=4),
                          use_tqdm=False)[0]
    assert plain.outputs[0].tool_calls is None


@pytest.mark.parametrize("temperature", [0.0, 1.0])  # the greedy LM-head shortcut, the sampler
def test_grammar_that_dead_ends_fails_the_request_saying_why(tiny_llm: LLM, temperature: float) -> None:
    """After "a" this grammar allows nothing: the request ends with finish_reason "error" and the reason in the
    log (the greedy shortcut once took a forbidden token: an "abort" with no reason); the engine goes on."""
    sp = SamplingParams(temperature=temperature, seed=0, max_tokens=8,
                        structured_outputs=_so(grammar='root ::= "a" [^\\x00-\\U0010FFFF]'))
    out = tiny_llm.generate(["x"], sp, use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason) == ("a", "error")
    assert tiny_llm.generate(["x"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_regex_with_an_inner_anchor_is_kept_to(tiny_llm: LLM) -> None:
    """'^' starting an alternative: xgrammar would ignore it (a warning only), so "auto" compiles this regex with
    llguidance, and the output matches it whole; an anchor no output can meet is refused."""
    regex = r"(^a|b)c{1,3}"
    outs = tiny_llm.generate(["x", "y"], [SamplingParams(temperature=1.0, seed=s, max_tokens=8,
                                                         structured_outputs=_so(regex=regex)) for s in range(2)],
                             use_tqdm=False)
    for o in outs:
        assert re.fullmatch(r"[ab]c{1,3}", o.outputs[0].text), o.outputs[0].text
    with pytest.raises(ValueError, match="the anchor '\\^' at position 1 of the regex cannot be honoured"):
        tiny_llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=_so(regex="a^b")), use_tqdm=False)


def test_refused_duplicate_id_leaves_the_running_requests_grammar_alone(tiny_llm: LLM) -> None:
    """A second request under a grammar added with the id of a running one is refused; the running one keeps its
    mask and finishes on its grammar (the duplicate's grammar took its place in the engine's structured-output
    state before the refusal: the running request lost its mask, took a forbidden token and was aborted)."""
    from pagedllm.core.engine_core import EngineCoreRequest

    core = tiny_llm.engine
    ids = tiny_llm.get_tokenizer().encode("count")
    sp = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=_so(grammar=GRAMMAR))
    core.add_request(EngineCoreRequest("dup", ids, sp))
    tokens, reason = [], None
    for _ in range(3):
        for out in core.step():
            tokens += out.new_token_ids
            reason = out.finish_reason
    assert reason is None and core.has_unfinished_requests()
    with pytest.raises(ValueError, match="already in use"):
        core.add_request(EngineCoreRequest("dup", ids, SamplingParams(max_tokens=4, structured_outputs=_so(
            regex="x+"))))
    while core.has_unfinished_requests():
        for out in core.step():
            tokens += out.new_token_ids
            reason = out.finish_reason
    text = tiny_llm.get_tokenizer().decode(tokens, skip_special_tokens=True)
    assert reason == "stop" and re.fullmatch(r"\([0-9](\+[0-9])*\)", text), (reason, text)
    assert not core.pop_request_errors()
    kv = core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_multiple_of_a_number_is_enforced(tiny_llm: LLM) -> None:
    """xgrammar ignores multipleOf on numbers (3.7 passed {"multipleOf": 0.5}): such a schema goes to llguidance."""
    schema = {"type": "array", "minItems": 3, "maxItems": 3,
              "items": {"type": "number", "multipleOf": 0.5, "minimum": 0, "maximum": 9}}
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=_so(json=schema))
    (out,) = tiny_llm.generate(["numbers"], params, use_tqdm=False)
    values = json.loads(out.outputs[0].text)
    assert len(values) == 3 and all((2 * v) % 1 == 0 and 0 <= v <= 9 for v in values), values
