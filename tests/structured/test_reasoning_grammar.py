"""The grammar after the reasoning (StructuredOutputsParams.reasoning_end, set by the server under --reasoning-parser)
through the real engine. A random model never writes `</think>`, so the end marker here is a token its free greedy
answer emits anyway: the tokens up to it must be the free answer's (no mask while reasoning), those after it must
match the grammar from its start. Reasoning ended at the prompt: the grammar from the first token. With n-gram
speculation (drafts crossing the marker) and async scheduling the outputs are the plain engine's."""
from __future__ import annotations

import json

import numpy as np
import pytest

jsonschema = pytest.importorskip("jsonschema", reason="validates the structured outputs")

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.structured_output import StructuredOutputsParams  # noqa: E402
from pagedllm.structured_output.manager import marker_end  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"]}
REGEX = r"[a-c]{2}-[0-9]{3}"


def _so(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(disable_any_whitespace=True, **kw)


def _greedy(llm: LLM, prompts: list[str], so=None, max_tokens: int = 60, n: int = 1) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n, structured_outputs=so)
    return llm.generate(prompts, params, use_tqdm=False)


def _marker_at(tokens: list[int], at: int = 4) -> int:
    """An index >= at whose token is new in the answer (it ends the reasoning there, not before)."""
    return next(i for i in range(at, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir: str) -> LLM:
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=128, max_num_seqs=16)
    yield llm
    llm.shutdown()


def test_marker_end_finds_single_and_multi_token_markers() -> None:
    assert marker_end([], [7], [1, 2, 7, 3]) == 3 and marker_end([], [7], [1, 2]) is None
    assert marker_end([5], [5, 6], [6, 1]) == 1  # the marker began in the earlier tokens
    assert marker_end([], [5, 6], [1, 5, 6, 2]) == 3 and marker_end([], [5, 6], [5, 1, 6]) is None


@pytest.mark.parametrize("width", [1, 2], ids=["one-token-marker", "two-token-marker"])
def test_free_until_the_marker_then_the_grammar(tiny_llm: LLM, width: int) -> None:
    prompts = ["hello there", "a b c"]
    free = [list(o.outputs[0].token_ids) for o in _greedy(tiny_llm, prompts)]
    marks = [_marker_at(t) for t in free]
    ends = [t[m:m + width] for t, m in zip(free, marks)]
    constrained = _greedy(tiny_llm, prompts, _so(json=SCHEMA))  # (the grammar from the start: another answer)
    assert all(list(c.outputs[0].token_ids[:1]) != t[:1] for c, t in zip(constrained, free))
    outs = [tiny_llm.generate([p], SamplingParams(temperature=0.0, max_tokens=80,
                                                  structured_outputs=_so(json=SCHEMA, reasoning_end=e)),
                              use_tqdm=False)[0] for p, e in zip(prompts, ends)]
    tok = tiny_llm.get_tokenizer()
    for out, t, m in zip(outs, free, marks):
        ids = list(out.outputs[0].token_ids)
        cut = m + width
        assert ids[:cut] == t[:cut]  # the reasoning: the free answer's tokens, marker included
        jsonschema.validate(json.loads(tok.decode(ids[cut:], skip_special_tokens=True)), SCHEMA)
        assert out.outputs[0].finish_reason == "stop"


def test_reasoning_ended_at_the_prompt_means_the_grammar_at_once(tiny_llm: LLM) -> None:
    plain = _greedy(tiny_llm, ["hello there"], _so(regex=REGEX))[0].outputs[0]
    ended = _greedy(tiny_llm, ["hello there"], _so(regex=REGEX, reasoning_end=[5], reasoning_ended=True))[0]
    assert list(ended.outputs[0].token_ids) == list(plain.token_ids) and ended.outputs[0].text == plain.text


def test_reasoning_cut_by_max_tokens_and_n(tiny_llm: LLM) -> None:
    free = list(_greedy(tiny_llm, ["hello there"])[0].outputs[0].token_ids)
    m = _marker_at(free, 8)
    cut = _greedy(tiny_llm, ["hello there"], _so(json=SCHEMA, reasoning_end=[free[m]]), max_tokens=m)[0]
    assert list(cut.outputs[0].token_ids) == free[:m] and cut.outputs[0].finish_reason == "length"
    both = _greedy(tiny_llm, ["hello there"], _so(json=SCHEMA, reasoning_end=[free[m]]), max_tokens=80, n=2)[0]
    assert len(both.outputs) == 2
    for o in both.outputs:  # each choice has its own reasoning state
        assert list(o.token_ids[:m + 1]) == free[:m + 1]
        json.loads(tiny_llm.get_tokenizer().decode(list(o.token_ids[m + 1:]), skip_special_tokens=True))


def test_preempted_requests_keep_their_reasoning_state(tiny_llama_dir: str, tiny_llm: LLM) -> None:
    prompts = ["hello there", "a b c", "json please", "pick one", "count to ten", "free two"]
    free = [list(o.outputs[0].token_ids) for o in _greedy(tiny_llm, prompts)]
    params = [SamplingParams(temperature=0.0, max_tokens=80,
                             structured_outputs=_so(json=SCHEMA, reasoning_end=[t[_marker_at(t)]])) for t in free]
    want = [list(o.outputs[0].token_ids) for o in tiny_llm.generate(prompts, params, use_tqdm=False)]
    small = LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=12, block_size=8, max_model_len=96,
                max_num_seqs=16)
    try:
        got = small.generate(prompts, params, use_tqdm=False)
        assert small.engine.get_stats().num_preemptions > 0
    finally:
        small.shutdown()
    assert [list(o.outputs[0].token_ids) for o in got] == want


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
RECORD = '{"name": "fox", "age": 7}'
SPEC_PROMPTS = [f"Think: one two three four five six. Then repeat this JSON: {RECORD}\nThink: one two three four five "
                f"six. Then repeat this JSON: {RECORD}\nThink: one two",
                "Code: ab-123 ab-123 ab-123. Think: red green blue red green blue. The code is "]
COMMON = dict(max_model_len=512, kv_cache_memory_bytes=1 << 26)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_speculation_gives_the_plain_engines_outputs(smollm2_gguf_path: str, async_scheduling: bool,
                                                     monkeypatch) -> None:
    from pagedllm.structured_output.manager import RequestStructuredOutput

    crossed = []  # verify steps whose drafts hold the end marker (rows: free, then the grammar's)
    fill = RequestStructuredOutput.fill_draft_rows
    monkeypatch.setattr(RequestStructuredOutput, "fill_draft_rows",
                        lambda so, d, rows: (crossed.append(so.reasoning), fill(so, d, rows))[1])
    plain = LLM(smollm2_gguf_path, **COMMON)
    try:
        free = [list(o.outputs[0].token_ids) for o in _greedy(plain, SPEC_PROMPTS, max_tokens=40)]
        marks = [_marker_at(t, 6) for t in free]
        params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(
                      json=SCHEMA, reasoning_end=[free[0][marks[0]]])),
                  SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(
                      regex=REGEX, reasoning_end=free[1][marks[1]:marks[1] + 2])),
                  SamplingParams(temperature=0.0, max_tokens=30)]
        prompts = SPEC_PROMPTS + [SPEC_PROMPTS[0]]
        want = [list(o.outputs[0].token_ids) for o in plain.generate(prompts, params, use_tqdm=False)]
    finally:
        plain.shutdown()
    spec = LLM(smollm2_gguf_path, speculative_config=NGRAM, async_scheduling=async_scheduling, **COMMON)
    try:
        got = spec.generate(prompts, params, use_tqdm=False)
        drafted = spec.engine.scheduler.spec_stats.num_draft_tokens
    finally:
        spec.shutdown()
    assert [list(o.outputs[0].token_ids) for o in got] == want
    assert drafted > 0 and any(crossed)
    assert want[0][:marks[0] + 1] == free[0][:marks[0] + 1]
    assert got[0].outputs[0].finish_reason == "stop" and got[1].outputs[0].finish_reason == "stop"


def test_draft_rows_inside_the_reasoning(tiny_llm: LLM) -> None:
    """Below the engine: drafts are all valid up to the marker, then the grammar's from its start; the verify rows
    up to the marker allow everything, the one after it is the grammar's first; the matcher does not move."""
    tok = tiny_llm.get_tokenizer()
    manager = tiny_llm.engine.structured._get_manager()
    if True:
        so = manager.submit(_so(regex=REGEX, reasoning_end=[5]))
        so.future.result(timeout=60)
        assert so.is_ready() and so.reasoning
        a = tok.encode("a", add_special_tokens=False)[-1]
        drafts = [9, 10, 5, a, 9]
        assert so.validate(drafts) == 4  # the free two, the marker, "a"; not 9 (a digit is not a letter...)
        rows = so.grammar_backend.allocate_bitmask(len(drafts))
        so.fill_draft_rows(drafts, rows)
        assert bool((rows[0] == -1).all()) and bool((rows[1] == -1).all())
        assert not bool((rows[2] == -1).all()) and not bool((rows[3] == -1).all())
        first = manager.bitmask([so])
        assert bool(np.all(first == -1))  # the first row: reasoning, all allowed
        assert so.accept([9, 5]) and not so.reasoning and not so.accept([9])


def test_async_scheduling_gives_the_sync_outputs(tiny_llama_dir: str, tiny_llm: LLM) -> None:
    """Async scheduling fills the mask while the step's forward runs (after applying the previous step's tokens): the
    step after the marker must be masked, the ones before not, as in the sync engine."""
    prompts = ["hello there", "a b c", "json please", "pick one"]
    free = [list(o.outputs[0].token_ids) for o in _greedy(tiny_llm, prompts)]
    params = [SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=_so(
        json=SCHEMA, reasoning_end=[t[_marker_at(t)]])) for t in free]
    params.append(SamplingParams(temperature=0.0, max_tokens=20))
    want = [list(o.outputs[0].token_ids) for o in tiny_llm.generate(prompts + ["free"], params, use_tqdm=False)]
    fast = LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=128, max_num_seqs=16,
               async_scheduling=True)
    try:
        got = fast.generate(prompts + ["free"], params, use_tqdm=False)
    finally:
        fast.shutdown()
    assert [list(o.outputs[0].token_ids) for o in got] == want


def test_offline_llm_takes_the_reasoning_parser_key(tiny_llama_dir: str, tiny_llm: LLM, tmp_path) -> None:
    """Offline, structured_outputs_config's reasoning_parser (vLLM's key) gives each grammar request the end marker
    as the server does: free until `</think>` (an added token of the model renamed so), the grammar after it; a
    prompt that closed the block gets the grammar at once; enable_in_reasoning keeps it on the whole answer."""
    import json
    import shutil

    free = _greedy(tiny_llm, ["hello there"], max_tokens=80)[0].outputs[0].token_ids
    model = str(tmp_path / "model")
    shutil.copytree(tiny_llama_dir, model)
    with open(f"{model}/tokenizer.json") as f:
        added = {t["id"] for t in json.load(f)["added_tokens"] if t["content"].startswith("<|extra_")}
    at = next(i for i in range(3, len(free)) if free[i] in added and free[i] not in free[:i])
    for name, key in (("tokenizer.json", "added_tokens"), ("tokenizer_config.json", "added_tokens_decoder")):
        with open(f"{model}/{name}") as f:
            data = json.load(f)
        entries = data[key] if key == "added_tokens" else [data.get(key, {}).get(str(free[at]))]
        for entry in entries:
            if entry is not None and entry.get("id", free[at]) == free[at]:
                entry["content"] = "</think>"
        with open(f"{model}/{name}", "w") as f:
            json.dump(data, f)
    want = _greedy(tiny_llm, ["hello there"], _so(json=SCHEMA, reasoning_end=[free[at]]))[0].outputs[0].token_ids
    at_once = _greedy(tiny_llm, ["hello there"], _so(json=SCHEMA))[0].outputs[0].token_ids
    assert want[:at + 1] == free[:at + 1] and want != at_once
    for extra, prompt, expected in (({}, "hello there", want), ({"enable_in_reasoning": True}, "hello there", at_once)):
        llm = LLM(model=model, dtype="float32", num_gpu_blocks_override=128,
                  structured_outputs_config={"reasoning_parser": "qwen3", **extra})
        try:
            assert _greedy(llm, [prompt], _so(json=SCHEMA))[0].outputs[0].token_ids == expected, extra
            if not extra:  # the prompt closed the block (thinking off): the grammar from the first token
                closed = _greedy(llm, ["hello there</think>"], _so(json=SCHEMA))[0].outputs[0].token_ids
                ref = _greedy(llm, ["hello there</think>"], _so(json=SCHEMA, reasoning_end=[free[at]],
                                                                reasoning_ended=True))[0].outputs[0].token_ids
                assert closed == ref
        finally:
            llm.shutdown()
