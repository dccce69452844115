"""Fast checks of serving pieces without a server: wire messages, flag/YAML merging, bench prompt sampling."""
from __future__ import annotations

import argparse

import pytest

for _dep in ("fastapi", "pydantic", "msgspec", "zmq"):  # absent where only the engine is installed (GPU machine)
    pytest.importorskip(_dep, reason=f"the OpenAI server's modules need {_dep}")

from pagedllm.core.batch_plan import EngineCoreOutput, TokenLogprobs  # noqa: E402
from pagedllm.entrypoints import messages as m  # noqa: E402
from pagedllm.entrypoints.openai.cli_args import add_serve_args, parse_serve_args, to_engine_args  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402


def test_messages_round_trip() -> None:
    enc = m.Encoder()
    params = SamplingParams(temperature=0.5, max_tokens=7, stop=["x"], seed=3, stop_token_ids=[9])
    add = m.input_decoder().decode(enc.encode(m.AddRequest("r1", [1, 2, 3], params, 12.5)))
    assert isinstance(add, m.AddRequest) and add.sampling_params == params and add.prompt_token_ids == [1, 2, 3]
    assert isinstance(m.input_decoder().decode(enc.encode(m.AbortRequests(["a", "b"]))), m.AbortRequests)
    out = EngineCoreOutput("r1", [5], [TokenLogprobs([5, 6], [-0.1, -2.0], [1, 2])], "stop", 9, 16)
    msg = m.output_decoder().decode(enc.encode(m.EngineOutputs([out], m.SchedulerStatsMsg(1, 2, 0.25), 1.0)))
    assert isinstance(msg, m.EngineOutputs) and msg.outputs == [out] and msg.stats.kv_cache_usage == 0.25
    ask = m.input_decoder().decode(enc.encode(m.GetDashboard(7, with_info=True)))
    assert isinstance(ask, m.GetDashboard) and ask.seq == 7 and ask.with_info
    reply = m.output_decoder().decode(enc.encode(m.DashboardReply(7, bytes([0, 1, 2, 3]), 2, {"device": "cpu"},
                                                                  1, {0: (1, 2), 5: (3, 0)})))
    assert isinstance(reply, m.DashboardReply) and reply.block_states == b"\x00\x01\x02\x03"
    assert (reply.num_preempted, reply.info, reply.engine_index, reply.lora_requests) == \
        (2, {"device": "cpu"}, 1, {0: (1, 2), 5: (3, 0)})


def _parse(argv: list[str]) -> argparse.Namespace:
    return parse_serve_args(add_serve_args(argparse.ArgumentParser(), positional_model=True), argv)


def test_defaults_match_vllm() -> None:
    a = _parse([])
    assert (a.host, a.port, a.block_size, a.max_num_seqs, a.gpu_memory_utilization, a.dtype, a.seed) == \
        ("127.0.0.1", 8000, 16, 256, 0.9, "auto", 0)
    assert a.enable_prefix_caching is True and a.model is None
    assert _parse(["--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert a.dashboard is True and _parse(["--no-dashboard"]).dashboard is False


def test_config_yaml_command_line_wins(tmp_path, capsys) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: /m/from-yaml\nport: 9001\nmax-num-seqs: 8\nserved-model-name: smol\n"
                   "enable_prefix_caching: false\n")
    a = _parse(["--config", str(cfg), "--port", "9002"])
    assert (a.port, a.max_num_seqs, a.served_model_name, a.enable_prefix_caching, a.model) == \
        (9002, 8, ["smol"], False, "/m/from-yaml")
    assert _parse(["/m/cli", "--config", str(cfg)]).model == "/m/cli"
    ea = to_engine_args(a)
    assert ea.max_num_seqs == 8 and ea.served_model_name == "smol" and ea.enable_prefix_caching is False
    cfg.write_text("bogus-flag: 1\n")
    with pytest.raises(SystemExit):
        _parse(["--config", str(cfg)])
    assert "unknown key 'bogus-flag'" in capsys.readouterr().err


def test_model_given_as_positional_and_flag(tmp_path, capsys) -> None:
    """`serve /a --model /b` served /a and dropped --model without a word: two different models are refused; the
    same one twice, or the positional over the YAML's model, still parse."""
    with pytest.raises(SystemExit):
        _parse(["/m/a", "--model", "/m/b"])
    assert "the model is given twice: MODEL '/m/a' and --model '/m/b'" in capsys.readouterr().err
    assert _parse(["/m/a", "--model", "/m/a"]).model == "/m/a"
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: /m/from-yaml\n")
    assert _parse(["/m/a", "--config", str(cfg)]).model == "/m/a"
    assert _parse(["--model", "/m/b", "--config", str(cfg)]).model == "/m/b"


@pytest.mark.parametrize("yaml_text, fragment", [
    ("log-level: shouting\n", "key 'log-level': invalid choice: 'shouting' (choose from 'critical'"),
    ("tool-call-parser: nonsense\n", "key 'tool-call-parser': invalid choice: 'nonsense'"),
    ("port: 99999\n", "key 'port': a TCP port is 0..65535, got 99999"),
    ("max-num-seqs: many\n", "key 'max-num-seqs': invalid int value: 'many'"),
    ("max-request-body-bytes: 0\n", "key 'max-request-body-bytes': must be >= 1, got 0"),
    ("served-model-name: ['smol', ' ']\n", "key 'served-model-name': must not be empty or blank"),
    ("enforce-eager: maybe\n", "key 'enforce-eager': expected true or false, got 'maybe'"),
    ("max-num-seqs: [1, 2]\n", "key 'max-num-seqs': expected one value, got a list"),
    ("host: null\n", "key 'host': needs a value"),
    ("structured-outputs-config: '[1]'\n", "key 'structured-outputs-config': must be a JSON object"),
    ("chat-template-content-format: json\n", "key 'chat-template-content-format': invalid choice: 'json'"),
])
def test_config_yaml_values_are_checked_like_flags(tmp_path, capsys, yaml_text: str, fragment: str) -> None:
    """A YAML value goes through its flag's type and choices, as on the command line (they skipped both)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml_text)
    with pytest.raises(SystemExit) as e:
        _parse(["--config", str(cfg)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"error: --config {cfg}: {fragment}" in err, err


@pytest.mark.parametrize("flag", ["--hf-overrides", "--override-generation-config", "--pooler-config"])
def test_json_object_flags_say_what_they_got(capsys, flag: str) -> None:
    """Not another flag's example (it read '{"backend": "xgrammar"}', the structured-outputs config's keys)."""
    with pytest.raises(SystemExit) as e:
        _parse(["m", flag, "[1]"])
    err = capsys.readouterr().err.strip().splitlines()[-1]  # (the usage above it names xgrammar in a help)
    assert e.value.code == 2 and f"argument {flag}" in err and "must be a JSON object ({...}), got an array" in err, err
    assert "xgrammar" not in err


def test_config_yaml_values_convert_like_flags(tmp_path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("uvicorn-log-level: debug\ntool_call_parser: hermes\nport: '9003'\ngpu-memory-utilization: 0.5\n"
                   "structured-outputs-config: {backend: xgrammar}\ndashboard: false\nenforce-eager: true\n"
                   "max-model-len: null\nserved-model-name: [a, b]\n")
    a = _parse(["--config", str(cfg)])
    assert (a.log_level, a.tool_call_parser, a.port, a.gpu_memory_utilization, a.structured_outputs_config) == \
        ("debug", "hermes", 9003, 0.5, {"backend": "xgrammar"})
    assert (a.dashboard, a.enforce_eager, a.max_model_len, a.served_model_name) == (False, True, None, ["a", "b"])


def test_config_yaml_takes_the_vllm_frontend_flags(tmp_path) -> None:
    """The flags added for vLLM 0.24's frontend read from --config as from the command line; --middleware, a
    repeatable flag, takes a list (the command line's adding to it, as vLLM merges a config file's flags)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("enable-log-requests: true\nenable-log-outputs: true\nmax-log-len: 50\n"
                   "enable-tokenizer-info-endpoint: true\nlog-error-stack: true\n"
                   "h11-max-incomplete-event-size: 65536\nh11-max-header-count: 64\ntokens-only: false\n"
                   "middleware: [m.A, m.b]\n")
    a = _parse(["--config", str(cfg), "--middleware", "m.C"])
    assert (a.enable_log_requests, a.enable_log_outputs, a.max_log_len, a.enable_tokenizer_info_endpoint,
            a.log_error_stack, a.tokens_only) == (True, True, 50, True, True, False)
    assert (a.h11_max_incomplete_event_size, a.h11_max_header_count) == (65536, 64)
    assert a.middleware == ["m.A", "m.b", "m.C"]
    cfg.write_text("middleware: m.A\n")
    assert _parse(["--config", str(cfg)]).middleware == ["m.A"]


def test_random_requests_are_deterministic_and_in_range() -> None:
    from pagedllm.entrypoints.cli.bench_serve import sample_random_requests

    pool = list(range(100, 200))
    a = sample_random_requests(pool, 32, 88, 88, 72 / 88, seed=0)
    b = sample_random_requests(pool, 32, 88, 88, 72 / 88, seed=0)
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    assert all(16 <= len(r.prompt_token_ids) <= 160 and 16 <= r.output_len <= 160 for r in a)
    assert all(t in pool for r in a for t in r.prompt_token_ids)


def test_result_block_format() -> None:
    from pagedllm.entrypoints.cli.bench_serve import RequestResult, format_result, summarize

    res = [RequestResult(True, 10, 5, 0.1, 0.5, [0.1] * 4), RequestResult(False, error="boom")]
    block = format_result(summarize(res, 2.0), 4, float("inf"))
    assert block.splitlines()[0] == "============ Serving Benchmark Result ============"
    assert "Successful requests:                     1" in block and "Failed requests:" in block
    assert "Output token throughput (tok/s):         2.50" in block and "P99 ITL (ms):" in block
    assert "Tokens per Chunk" not in block  # no chunk carried its usage: not measured, not printed as zeros
    lumps = RequestResult(True, 10, 12, 0.1, 0.5, [0.1] * 4, chunk_tokens=[1, 1, 1, 1, 8])
    m = summarize([lumps, RequestResult(True, 10, 3, 0.1, 0.2, [0.05] * 2, chunk_tokens=[1, 1, 1])], 2.0)
    assert (m["mean_tokens_per_chunk"], m["median_tokens_per_chunk"], m["max_tokens_per_chunk"]) == (15 / 8, 1, 8)
    assert 1 < m["p99_tokens_per_chunk"] <= 8
    block = format_result(m, 4, float("inf"))
    assert "Max tokens per chunk:                    8" in block and "Mean tokens per chunk:                   1.88" in block


def test_issue12_flags_reach_engine_args() -> None:
    ea = to_engine_args(_parse(["acme/tiny", "--revision", "v2", "--download-dir", "/d", "--generation-config", "vllm",
                                "--max-logprobs", "5", "--no-enable-chunked-prefill", "--trust-remote-code",
                                "--cpu-offload-gb", "1.5"]))
    assert (ea.model, ea.revision, ea.download_dir, ea.generation_config, ea.max_logprobs, ea.enable_chunked_prefill,
            ea.trust_remote_code, ea.cpu_offload_gb) == ("acme/tiny", "v2", "/d", "vllm", 5, False, True, 1.5)
    defaults = to_engine_args(_parse([]))
    assert (defaults.generation_config, defaults.max_logprobs, defaults.enable_chunked_prefill) == ("auto", 20, True)


def test_vllm_embedding_and_generation_flags_reach_engine_args() -> None:
    ea = to_engine_args(_parse(["m", "--task", "embed", "--override-pooler-config", '{"pooling_type": "MEAN"}',
                                "--override-generation-config", '{"temperature": 0.5}']))
    ea.validate()
    assert (ea.task, ea.embeddings_only, ea.pooler_config, ea.override_generation_config) == (
        "embed", True, {"pooling_type": "mean"}, {"temperature": 0.5})
    ea = to_engine_args(_parse(["m", "--runner", "pooling", "--pooler-config", '{"normalize": false}']))
    assert ea.runner == "pooling" and ea.pooler_config == {"normalize": False}
    defaults = to_engine_args(_parse(["m"]))
    assert (defaults.runner, defaults.convert, defaults.task, defaults.embeddings_only) == ("auto", "auto", None, False)
    ea = to_engine_args(_parse(["m", "--hf-overrides", '{"rope_theta": 5e5}', "--long-prefill-token-threshold", "64"]))
    assert ea.hf_overrides == {"rope_theta": 5e5} and ea.long_prefill_token_threshold == 64


def test_messages_carry_token_constraints() -> None:
    params = SamplingParams(logit_bias={"7": -100, 3: 2.5}, allowed_token_ids=[3, 7, 9], bad_words=["no"],
                            bad_words_token_ids=[[4, 5]])
    add = m.input_decoder().decode(m.Encoder().encode(m.AddRequest("r1", [1], params, 0.0)))
    got = add.sampling_params
    assert got.logit_bias == {7: -100.0, 3: 2.5} and got.allowed_token_ids == [3, 7, 9]
    assert got.bad_words == ["no"] and got.bad_words_token_ids == [[4, 5]]


def test_large_bodies_are_tokenized_off_the_event_loop() -> None:
    """body.tokenize_work: a body from OFF_LOOP_BYTES on is tokenized in a worker thread (a few MB of text would stall
    every stream on the event loop), a small one inline; the result and the function's exceptions are the same."""
    import asyncio
    import threading

    from pagedllm.entrypoints.openai.body import OFF_LOOP_BYTES, tokenize_work

    class Body:  # (what tokenize_work reads of a starlette Request)
        def __init__(self, size: int) -> None:
            self.raw = b"x" * size

        async def body(self) -> bytes:
            return self.raw

    def work(text: str, bad: bool = False) -> tuple[str, bool]:
        if bad:
            raise ValueError("refused")
        return text.upper(), threading.current_thread() is threading.main_thread()

    async def run(size: int, **kw):
        return await tokenize_work(Body(size), work, "ab", **kw)

    assert asyncio.run(run(100)) == ("AB", True)
    assert asyncio.run(run(OFF_LOOP_BYTES)) == ("AB", False)
    for size in (100, OFF_LOOP_BYTES):
        with pytest.raises(ValueError, match="refused"):
            asyncio.run(run(size, bad=True))


def test_large_bodies_are_parsed_off_the_event_loop(monkeypatch) -> None:
    """body.parse_body: a body from OFF_LOOP_BYTES on is decoded and validated in a worker thread (megabytes of JSON
    take a good part of a second), a small one inline; the model and the 400s are the same either way."""
    import asyncio
    import json
    import threading

    from pagedllm.entrypoints.openai import body as body_mod
    from pagedllm.entrypoints.openai.errors import APIError
    from pagedllm.entrypoints.openai.protocol import CompletionRequest

    threads = []
    real = body_mod.loads_body

    def spy(raw: bytes):
        threads.append(threading.current_thread() is threading.main_thread())
        return real(raw)

    monkeypatch.setattr(body_mod, "loads_body", spy)

    class Body:
        def __init__(self, payload: bytes) -> None:
            self.raw = payload

        async def body(self) -> bytes:
            return self.raw

    def payload(size: int, **extra) -> bytes:
        return json.dumps({"prompt": "x" * size, "max_tokens": 3, **extra}).encode()

    for size, inline in ((100, True), (body_mod.OFF_LOOP_BYTES, False)):
        req = asyncio.run(body_mod.parse_body(Body(payload(size)), CompletionRequest))
        assert (len(req.prompt), req.max_tokens, threads[-1]) == (size, 3, inline)
        with pytest.raises(APIError, match="max_tokens"):
            asyncio.run(body_mod.parse_body(Body(payload(size, max_tokens="many")), CompletionRequest))
        assert threads[-1] is inline


def test_a_requests_own_chat_template_renders_off_the_event_loop() -> None:
    """body.render_work: a request's own chat template (--trust-request-chat-template) renders in a worker thread
    however small the body (a 300-byte template can loop for seconds and stall every client); the model's own
    template as tokenize_work would."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from pagedllm.entrypoints.openai.body import render_work

    class Body:
        async def body(self) -> bytes:
            return b"{}"

    def on_main_thread() -> bool:
        return threading.current_thread() is threading.main_thread()

    async def run(template):
        return await render_work(Body(), SimpleNamespace(chat_template=template), on_main_thread)

    assert asyncio.run(run(None)) is True
    assert asyncio.run(run("{% for i in range(10**5) %}{% endfor %}")) is False


# Shows which form the content came in: S(string) or L(part) per text part
PARTS_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{% if m['content'] is string %}S({{ m['content'] }})"
                  "{% else %}{% for p in m['content'] %}L({{ p['text'] }}){% endfor %}{% endif %}{% endfor %}")


def test_render_chat_content_format(smollm2_hf_dir) -> None:
    """The server's render_chat under --chat-template-content-format: "auto" gives a template that loops over a
    message's content the parts ("openai"), SmolLM2's own template (it reads a string) the string; tool history
    rewritten for a template that knows no tools reaches it in the same form as the other messages."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from pagedllm.entrypoints.openai.chat_template import detect_content_format, render_chat
    from pagedllm.entrypoints.openai.chat_tools import plan_request_tools
    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest

    tok = AutoTokenizer.from_pretrained(smollm2_hf_dir)
    req = ChatCompletionRequest(messages=[
        {"role": "user", "content": [{"type": "text", "text": "6*7?"}, {"type": "text", "text": "Quick."}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "mul", "arguments": '{"a": 6, "b": 7}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}])
    state = SimpleNamespace(tokenizer=tok, tool_call_parser="auto")

    def render(fmt, template=PARTS_TEMPLATE):
        _, prepare = plan_request_tools(req.model_copy(update={"chat_template": template}), state)
        return render_chat(tok, req.messages, False, False, template, prepare_tools=prepare, content_format=fmt)[0]

    strings = render("string")
    assert strings.startswith("<user>S(6*7?\nQuick.)<assistant>S(") and "<user>S(<tool_response>\n42\n" in strings
    assert render("auto") == render("openai") == strings.replace("S(6*7?\nQuick.)", "L(6*7?)L(Quick.)").replace(
        "S(", "L(")
    # the model's own template reads a string: "auto" hands it the parts joined, as transformers renders them
    assert detect_content_format(tok.chat_template) == "string"
    assert render_chat(tok, req.messages[:1], True, False)[0] == tok.apply_chat_template(
        [{"role": "user", "content": "6*7?\nQuick."}], tokenize=False, add_generation_prompt=True)


def test_an_adapter_unloaded_after_the_model_check_is_a_404() -> None:
    """A request checks its `model` first and looks its adapter up after awaiting its tokenization: an adapter
    unloaded in between is a 404 as for a request sent after the unload (the lookup gave None, and the request
    ran on the base model, answered under the adapter's name)."""
    import asyncio
    from types import SimpleNamespace

    from pagedllm.entrypoints.openai.errors import APIError
    from pagedllm.entrypoints.openai.lora_models import LoRAModels
    from pagedllm.entrypoints.openai.server_state import ServerState
    from pagedllm.lora.request import LoRARequest

    async def no_op(*_, **__) -> None:
        return None

    state = ServerState(SimpleNamespace(add_lora=no_op, remove_lora=no_op), ["base", "alias"])
    state.loras = LoRAModels(state.engine, state.served_model_names, enabled=True)
    state.loras.adapters["sql"] = LoRARequest(lora_name="sql", lora_int_id=1, lora_path="/x")
    model = state.check_model("sql")
    assert model == "sql" and state.lora_request(model).lora_int_id == 1
    asyncio.run(state.loras.unload("sql"))
    with pytest.raises(APIError) as e:
        state.lora_request(model)
    assert e.value.status == 404 and e.value.code == "model_not_found" and e.value.param == "model"
    for name in ("alias", None):  # the base model's names route to no adapter
        assert state.lora_request(state.check_model(name)) is None


def test_an_unload_during_an_in_place_reload_leaves_the_reload_standing() -> None:
    """load_inplace reads the new adapter, then removes the old one; an unload of the name meanwhile removed the old
    one already, and the second removal (the engine's "not loaded") made the reload a 404 although it had taken
    the name. Now the reload succeeds, serves the name, and the old adapter is removed once."""
    import asyncio
    from types import SimpleNamespace

    from pagedllm.entrypoints.async_engine import RequestRejected
    from pagedllm.entrypoints.openai.lora_models import LoRAModels

    registered: set[int] = set()
    removed: list[int] = []
    reading = asyncio.Event()

    async def add_lora(request, **_) -> None:
        if request.lora_name == "late" and registered:  # the reload: held until the unload has run
            await reading.wait()
        registered.add(request.lora_int_id)

    async def remove_lora(lora_int_id: int) -> None:
        if lora_int_id not in registered:
            raise RequestRejected(f"LoRA adapter id {lora_int_id} is not loaded.", 404)
        registered.discard(lora_int_id)
        removed.append(lora_int_id)

    async def run() -> None:
        loras = LoRAModels(SimpleNamespace(add_lora=add_lora, remove_lora=remove_lora), ["base"], enabled=True)
        old = await loras.load("late", "/tmp")
        reload = asyncio.ensure_future(loras.load("late", "/tmp", load_inplace=True))
        await asyncio.sleep(0.01)  # the reload waits in add_lora
        await loras.unload("late")
        reading.set()
        new = await reload
        assert removed == [old.lora_int_id] and registered == {new.lora_int_id}
        assert loras.get("late") is new

    asyncio.run(run())


def test_a_name_loaded_again_by_another_api_process_lists_its_new_path(tmp_path) -> None:
    """With several API processes, a name this process loaded from one path, unloaded and loaded again from another
    by a second process (LoraEvents here) is listed by /v1/models with the new path: the old one stayed in this
    process's roots, so its card's root named the adapter it no longer served."""
    import asyncio
    from types import SimpleNamespace

    from pagedllm.entrypoints import messages as m
    from pagedllm.entrypoints.openai.lora_models import LoRAModels

    async def no_op(*_, **__) -> None:
        return None

    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    loras = LoRAModels(SimpleNamespace(add_lora=no_op, remove_lora=no_op), ["base"], enabled=True)
    loras.share_ids(1, 2)
    old = asyncio.run(loras.load("x", str(first)))
    assert [c["root"] for c in loras.cards(0, 8)] == [str(first)]
    loras.apply_event(m.LoraEvent(origin=0, seq=1, added=False, lora_int_id=old.lora_int_id))
    assert loras.cards(0, 8) == []
    loras.apply_event(m.LoraEvent(origin=0, seq=2, added=True, lora_int_id=100, lora_name="x",
                                  lora_path=str(second)))
    assert [(c["id"], c["root"]) for c in loras.cards(0, 8)] == [("x", str(second))]
