"""vLLM engine arguments its users pass to `LLM(...)` and `pagedllm serve`: each honoured where pagedllm has the
feature, else a non-default value refused with a sentence naming the argument (never silently ignored)."""
from __future__ import annotations

import argparse
import types

import pytest
import torch

from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.compilation_config import GraphSettings, parse_compilation_config
from pagedllm.config import EngineArgs
from pagedllm.entrypoints.openai.cli_args import add_serve_args, parse_serve_args, to_engine_args


def _serve_args(argv: list[str]) -> EngineArgs:
    return to_engine_args(parse_serve_args(add_serve_args(argparse.ArgumentParser(), positional_model=True), argv))


def test_swap_space_is_accepted_and_changes_nothing(tiny_llama_dir):
    """vLLM's V1 engine allocates no CPU swap blocks; pagedllm preempts by recompute too: any value >= 0 is taken."""
    assert EngineArgs().swap_space == 4 and _serve_args(["m"]).swap_space == 4  # vLLM's default
    assert _serve_args(["m", "--swap-space", "16"]).swap_space == 16
    for value in (0, 4, 2.5):
        EngineArgs(swap_space=value).validate()
    with pytest.raises(ValueError, match=r"swap_space must be >= 0 \(GiB\), got -1"):
        EngineArgs(swap_space=-1).validate()
    with pytest.raises(ValueError, match="swap_space must be a float"):
        EngineArgs(swap_space="4").validate()
    llm = LLM(model=tiny_llama_dir, swap_space=8, num_gpu_blocks_override=16, max_model_len=256)
    assert llm.engine_args.swap_space == 8


def test_vllm_flags_of_what_pagedllm_always_does_are_accepted(tiny_llama_dir):
    """disable_custom_all_reduce / disable_cascade_attn / max_parallel_loading_workers (vLLM's) were 'Unknown engine
    argument(s)' offline and unrecognized by serve; pagedllm has no custom all-reduce or cascade attention and loads
    its files one at a time, so they are taken as the engine it already is (greedy tokens unchanged)."""
    args = _serve_args(["m", "--disable-custom-all-reduce", "--disable-cascade-attn",
                        "--max-parallel-loading-workers", "2"])
    assert args.disable_custom_all_reduce and args.disable_cascade_attn and args.max_parallel_loading_workers == 2
    with pytest.raises(ValueError, match="max_parallel_loading_workers must be >= 1, got 0"):
        EngineArgs(max_parallel_loading_workers=0).validate()
    with pytest.raises(ValueError, match="disable_custom_all_reduce must be a bool"):
        EngineArgs(disable_custom_all_reduce="yes").validate()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    plain = LLM(model=tiny_llama_dir, num_gpu_blocks_override=16, max_model_len=256)
    want = plain.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    plain.shutdown()
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks_override=16, max_model_len=256, disable_custom_all_reduce=True,
              disable_cascade_attn=True, max_parallel_loading_workers=4)
    assert llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids == want


@pytest.mark.parametrize("mode, message", [
    ("mistral", "tokenizer_mode='mistral' (mistral_common's tokenizer) is not supported by pagedllm"),
    ("custom", "tokenizer_mode='custom' (a tokenizer registered with vLLM's TokenizerRegistry) is not supported"),
    ("fast", "tokenizer_mode must be auto, hf or slow, got 'fast'"),
])
def test_tokenizer_modes_pagedllm_does_not_build_are_refused(mode, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineArgs(tokenizer_mode=mode).validate()
    if mode != "fast":  # (argparse refuses the unknown one itself)
        with pytest.raises(ValueError, match=f"tokenizer_mode='{mode}'"):
            _serve_args(["m", "--tokenizer-mode", mode]).validate()


def test_tokenizer_mode_hf_is_auto(tiny_llama_dir):
    assert _serve_args(["m", "--tokenizer-mode", "hf"]).tokenizer_mode == "hf"
    llm = LLM(model=tiny_llama_dir, tokenizer_mode="hf", num_gpu_blocks_override=16, max_model_len=256)
    assert llm.get_tokenizer().is_fast
    out = llm.generate("hello", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].text == llm.get_tokenizer().decode(out[0].outputs[0].token_ids)


def test_tokenizer_mode_slow_asks_transformers_for_its_python_tokenizer(monkeypatch, tiny_llama_dir):
    """transformers 5 has no slow tokenizers (it drops use_fast=False): "slow" is refused there, naming the version;
    with transformers 4 the loader asks for use_fast=False and takes a slow tokenizer it would otherwise refuse."""
    import transformers

    from pagedllm import tokenizer as tok

    monkeypatch.setattr(tok, "_transformers_version", lambda: "5.1.0")
    with pytest.raises(ValueError, match=r"tokenizer_mode='slow' needs transformers < 5: transformers 5\.1\.0"):
        EngineArgs(tokenizer_mode="slow").validate()
    monkeypatch.setattr(tok, "_transformers_version", lambda: "4.57.1")
    EngineArgs(tokenizer_mode="slow").validate()
    calls = []
    slow = types.SimpleNamespace(is_fast=False)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda source, **kwargs: calls.append(kwargs) or slow)
    assert tok.get_tokenizer(tiny_llama_dir, tokenizer_mode="slow") is slow
    with pytest.raises(ValueError, match="is not a fast tokenizer.*or start with tokenizer_mode='slow'"):
        tok.get_tokenizer(tiny_llama_dir, tokenizer_mode="auto")
    assert [c["use_fast"] for c in calls] == [False, True]
    args = EngineArgs(tokenizer_mode="slow", trust_remote_code=True)
    assert tok.engine_tokenizer_options(args) == dict(trust_remote_code=True, tokenizer_mode="slow")


def test_hf_token_reaches_the_hub_calls(monkeypatch, tiny_llama_dir):
    """hf_token goes to the repo id's resolution and to transformers' tokenizer load; it never shows in a repr.
    (tests/models/test_model_resolution.py checks what the Hub sees.)"""
    import transformers

    from pagedllm.models import model_resolution
    from pagedllm.tokenizer import engine_tokenizer_options

    assert _serve_args(["m"]).hf_token is None
    assert _serve_args(["m", "--hf-token"]).hf_token is True  # the flag alone: the stored token, as in vLLM
    assert _serve_args(["m", "--hf-token", "hf_abc"]).hf_token == "hf_abc"
    assert "hf_abc" not in repr(EngineArgs(hf_token="hf_abc"))
    for bad in ("", " ", 5):
        with pytest.raises(ValueError, match="hf_token must be a Hugging Face token, True"):
            EngineArgs(hf_token=bad).validate()
    assert "token" not in engine_tokenizer_options(EngineArgs())
    resolved, loads = [], []
    monkeypatch.setattr(model_resolution, "resolve_repo_id",
                        lambda model, revision, download_dir, token: resolved.append((model, token)) or tiny_llama_dir)
    real = transformers.AutoTokenizer.from_pretrained.__func__
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        classmethod(lambda cls, source, **kw: loads.append(kw.get("token")) or real(cls, source, **kw)))
    LLM(model="acme/tiny", hf_token="hf_abc", num_gpu_blocks_override=16, max_model_len=256)
    assert resolved == [("acme/tiny", "hf_abc")] and loads == ["hf_abc"]


def _steps(out) -> list[dict[int, float]]:
    return [{t: lp.logprob for t, lp in step.items()} for step in out.logprobs]


def test_logprobs_modes(tiny_llama_dir):
    """Over the whole vocabulary (512 tokens): raw_logits are the logits whose log-softmax raw_logprobs reports;
    processed_* are those values after temperature and top-k (-inf where cut) for a sampled row, the raw ones for a
    greedy row of the same batch. The mode changes what is reported, never the tokens."""
    prompts = [{"prompt_token_ids": [5, 9, 33, 7]}, {"prompt_token_ids": [8, 2, 40]}]
    params = [SamplingParams(temperature=0.7, top_k=20, seed=1, max_tokens=3, logprobs=512, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=3, logprobs=512, ignore_eos=True)]
    outs = {}
    for mode in ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"):
        llm = LLM(model=tiny_llama_dir, logprobs_mode=mode, max_logprobs=-1, num_gpu_blocks_override=16,
                  max_model_len=256)
        outs[mode] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    assert len({tuple(tuple(o.token_ids) for o in v) for v in outs.values()}) == 1
    sampled, greedy = 0, 1
    for i in (sampled, greedy):
        for step, (raw_lp, raw_logits, proc_lp, proc_logits) in enumerate(zip(*(_steps(v[i]) for v in outs.values()))):
            ids = sorted(raw_lp)
            assert len(ids) == 512
            logits = torch.tensor([raw_logits[t] for t in ids])
            assert torch.allclose(logits.log_softmax(0), torch.tensor([raw_lp[t] for t in ids]), atol=1e-4)
            token = outs["raw_logprobs"][i].token_ids[step]
            if i == greedy:
                assert proc_logits == pytest.approx(raw_logits, abs=1e-5)
                assert proc_lp == pytest.approx(raw_lp, abs=1e-5)
                continue
            kept = set(logits.topk(20).indices.tolist())
            assert {t for t in ids if proc_logits[t] != float("-inf")} == kept and token in kept
            assert all(proc_lp[t] == float("-inf") for t in ids if t not in kept)
            scaled = torch.tensor([raw_logits[t] / 0.7 for t in sorted(kept)])
            assert [proc_logits[t] for t in sorted(kept)] == pytest.approx(scaled.tolist(), abs=1e-4)
            assert [proc_lp[t] for t in sorted(kept)] == pytest.approx(scaled.log_softmax(0).tolist(), abs=1e-4)
            assert outs["processed_logprobs"][i].cumulative_logprob is not None


def test_logprobs_mode_flag_and_refusals(tiny_llama_dir):
    assert _serve_args(["m"]).logprobs_mode == "raw_logprobs"
    assert _serve_args(["m", "--logprobs-mode", "processed_logits"]).logprobs_mode == "processed_logits"
    with pytest.raises(ValueError, match="logprobs_mode must be one of raw_logprobs, raw_logits, processed_logprobs"):
        EngineArgs(logprobs_mode="logits").validate()
    llm = LLM(model=tiny_llama_dir, logprobs_mode="raw_logits", num_gpu_blocks_override=16, max_model_len=256)
    with pytest.raises(ValueError, match="Beam search needs log-probabilities, but this engine's "
                                         "logprobs_mode='raw_logits' reports logits"):
        llm.beam_search([{"prompt_token_ids": [5, 9]}], BeamSearchParams(beam_width=2, max_tokens=2))


def test_logprobs_modes_through_speculative_verification(tiny_llama_dir):
    """Verify steps report the mode's values too: raw logits as a plain run does; processed logprobs of a sampled
    row are its top-k distribution (the draft tokens it accepts among them)."""
    prompt = {"prompt_token_ids": list(range(40, 64)) * 3}  # repeats: the n-gram proposer finds drafts
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    kw = dict(model=tiny_llama_dir, kv_cache_memory_bytes=1 << 24, max_model_len=256)
    greedy = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    plain = LLM(logprobs_mode="raw_logits", **kw).generate(prompt, greedy, use_tqdm=False)[0].outputs[0]
    spec_llm = LLM(logprobs_mode="raw_logits", speculative_config=ngram, **kw)
    spec = spec_llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0]
    assert spec.token_ids == plain.token_ids and spec_llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
    for a, b in zip(_steps(plain), _steps(spec)):
        assert a.keys() == b.keys() and list(b.values()) == pytest.approx(list(a.values()), abs=1e-4)
        assert max(b.values()) > 0  # logits, not logprobs
    proc_llm = LLM(logprobs_mode="processed_logprobs", speculative_config=ngram, **kw)
    # (a low temperature follows the greedy path, whose tokens the n-gram proposer predicts; top-k still cuts)
    sampled = SamplingParams(temperature=0.05, top_k=10, seed=3, max_tokens=12, logprobs=10, ignore_eos=True)
    out = proc_llm.generate(prompt, sampled, use_tqdm=False)[0].outputs[0]
    assert proc_llm.engine.scheduler.spec_stats.num_accepted_tokens > 0
    for token, step in zip(out.token_ids, _steps(out)):
        kept = {t: v for t, v in step.items() if v != float("-inf")}
        assert len(kept) == 10 and token in kept
        assert sum(torch.tensor(list(kept.values())).exp()).item() == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("value, want", [
    (None, GraphSettings()),
    (3, GraphSettings()),
    ("2", GraphSettings()),
    (0, GraphSettings(decode_graphs=False, mixed_graphs=False)),  # vLLM's -O0: no compilation, no CUDA graphs
    ({"mode": "VLLM_COMPILE", "cudagraph_mode": "FULL_AND_PIECEWISE"}, GraphSettings()),
    ({"level": 0, "cudagraph_mode": "full_decode_only"}, GraphSettings(mixed_graphs=False)),  # the mode wins
    ('{"cudagraph_mode": "NONE"}', GraphSettings(decode_graphs=False, mixed_graphs=False)),
    ({"use_cudagraph": False, "full_cuda_graph": True}, GraphSettings(decode_graphs=False, mixed_graphs=False)),
    ({"cudagraph_capture_sizes": [4, 1, 2], "max_cudagraph_capture_size": 4}, GraphSettings(capture_sizes=(4, 1, 2),
                                                                                            max_capture_size=4)),
    ({"max_capture_size": 64}, GraphSettings(max_capture_size=64)),
])
def test_compilation_config_forms(value, want):
    assert parse_compilation_config(value) == want


@pytest.mark.parametrize("value, message", [
    ({"backend": "inductor", "level": 3}, r"compilation_config key\(s\) 'backend' are not supported by pagedllm: it "
                                         "runs no torch.compile, and its CUDA graphs take only level, mode,"),
    ({"cudagraph_mode": "PIECEWISE"}, "cudagraph_mode 'PIECEWISE' is not supported by pagedllm: it captures "
                                      "whole-forward CUDA graphs only"),
    ({"cudagraph_mode": "SOME"}, "cudagraph_mode must be one of NONE, FULL_DECODE_ONLY, FULL, FULL_AND_PIECEWISE"),
    (4, "compilation_config level must be 0-3"),
    ({"mode": True}, "compilation_config mode must be 0-3"),
    ({"cudagraph_capture_sizes": [1, 0]}, "cudagraph_capture_sizes must be a list of positive integers"),
    ({"cudagraph_capture_sizes": [1, 8], "max_cudagraph_capture_size": 4}, r"max_cudagraph_capture_size \(4\) must be "
                                                                          r"the largest of cudagraph_capture_sizes"),
    ({"use_cudagraph": "no"}, "use_cudagraph must be true or false"),
    ("O3", "compilation_config must be an optimization level"),
    ([3], "compilation_config must be an optimization level"),
])
def test_compilation_config_refusals(value, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(compilation_config=value).validate()


def test_compilation_config_flags(tmp_path):
    """--compilation-config / -O as vLLM's: a level, JSON, -O.KEY=VALUE; several add up, the later key winning (over
    a --config file's too, where hf-token: true is the stored token)."""
    (tmp_path / "serve.yaml").write_text('compilation-config: {"cudagraph_mode": "NONE"}\nhf-token: true\n')
    from_file = _serve_args(["m", "--config", str(tmp_path / "serve.yaml"), "-O.cudagraph_capture_sizes=[1,2]"])
    assert from_file.compilation_config == {"cudagraph_mode": "NONE", "cudagraph_capture_sizes": [1, 2]}
    assert from_file.hf_token is True
    assert _serve_args(["m"]).compilation_config is None
    assert _serve_args(["m", "-O3"]).compilation_config == 3
    assert _serve_args(["m", "-O", "0"]).graph_settings() == GraphSettings(decode_graphs=False, mixed_graphs=False)
    assert _serve_args(["m", "--compilation-config", '{"cudagraph_capture_sizes": [1, 2]}']).compilation_config == {
        "cudagraph_capture_sizes": [1, 2]}
    assert _serve_args(["m", "-O3", "-O.cudagraph_mode=FULL_DECODE_ONLY", "-O.cudagraph_capture_sizes=[1,2,4]",
                        "-O.cudagraph_mode=NONE"]).compilation_config == {
        "level": 3, "cudagraph_mode": "NONE", "cudagraph_capture_sizes": [1, 2, 4]}
    with pytest.raises(ValueError, match="compilation_config key\\(s\\) 'custom_ops' are not supported"):
        _serve_args(["m", "-O.custom_ops=[\"none\"]"]).validate()


def _fake_runner(compilation_config, max_num_seqs=48, max_num_batched_tokens=512):
    """What the graph runners read of a ModelRunner at construction (their sizes; nothing is captured)."""
    layer = types.SimpleNamespace(num_heads=4, num_kv_heads=2, head_size=16)
    backend = types.SimpleNamespace(wants_decode_order=False, mixed_graph_tiles=lambda *a: [16],
                                    few_query_tile=lambda *a: None)
    return types.SimpleNamespace(
        device=torch.device("cpu"), graph_settings=parse_compilation_config(compilation_config),
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=256, scratch_block=0,
        block_size=16, attn_backend=backend, num_kv_groups=1, max_blocks_per_req=16, dtype=torch.float32,
        model=types.SimpleNamespace(attn_layers=[layer]))


def test_compilation_config_picks_the_graph_sizes():
    """Capture sizes are decode batch sizes up to max_num_seqs and mixed-step token counts from 2 (vLLM captures
    token counts); a max capture size cuts pagedllm's own sizes."""
    from pagedllm.worker.cuda_graph import CudaGraphRunner
    from pagedllm.worker.mixed_graph import MixedGraphRunner

    plain = _fake_runner(None)
    assert CudaGraphRunner(plain).sizes == [1, 2, 4, 8, 16, 32, 48]
    assert MixedGraphRunner(plain).sizes[0] == 16 and MixedGraphRunner(plain).sizes[-1] == 512
    chosen = _fake_runner({"cudagraph_capture_sizes": [100, 1, 2, 4, 32]})
    assert CudaGraphRunner(chosen).sizes == [1, 2, 4, 32]
    assert MixedGraphRunner(chosen).sizes == [2, 4, 32, 100]
    assert MixedGraphRunner(chosen, extra_sizes=(5, 600)).sizes == [2, 4, 5, 32, 100]  # (verify steps' exact sizes)
    capped = _fake_runner({"max_cudagraph_capture_size": 20})
    assert CudaGraphRunner(capped).sizes == [1, 2, 4, 8, 16, 20]
    assert MixedGraphRunner(capped).sizes == [16, 20]


def test_compilation_config_on_the_engine(tiny_llama_dir):
    """On the CPU there are no CUDA graphs: any valid config is the same engine; an unknown key fails the start."""
    llm = LLM(model=tiny_llama_dir, compilation_config={"level": 3, "cudagraph_capture_sizes": [1, 2]},
              num_gpu_blocks_override=16, max_model_len=256)
    assert llm.engine.worker.runner.graph_settings.capture_sizes == (1, 2)
    with pytest.raises(ValueError, match="compilation_config key\\(s\\) 'pass_config' are not supported"):
        LLM(model=tiny_llama_dir, compilation_config={"pass_config": {}})


@pytest.fixture(scope="module")
def llama_llm(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, num_gpu_blocks_override=16, max_model_len=256)
    yield llm
    llm.shutdown()


def test_per_request_logits_processors_are_vllm_v1s_value_error(llama_llm):
    """vLLM's SamplingParams takes logits_processors; its V1 engine refuses non-empty ones when the request is added,
    with a ValueError (pagedllm's SamplingParams raised a TypeError for the unknown keyword)."""
    params = SamplingParams(max_tokens=2, logits_processors=[lambda ids, logits: logits])
    with pytest.raises(ValueError, match=r"^vLLM V1 does not support per request user provided logits processors\.$"):
        llama_llm.generate([[5, 6, 7]], params, use_tqdm=False)
    late = SamplingParams(max_tokens=2)
    late.logits_processors = [lambda ids, logits: logits]  # set after construction: still refused
    with pytest.raises(ValueError, match="per request user provided logits processors"):
        llama_llm.generate([[5, 6, 7]], [late], use_tqdm=False)
    out = llama_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, logits_processors=[]), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2  # none given: an ordinary request


def test_max_seq_len_to_capture_is_refused_as_vllm_removed_it():
    """vLLM removed max_seq_len_to_capture in 0.11 (#25543); vLLM 0.24 has no such argument, so it stays unknown, with
    the argument that replaced it named."""
    with pytest.raises(TypeError, match="max_seq_len_to_capture.*max_cudagraph_capture_size"):
        EngineArgs.from_kwargs(max_seq_len_to_capture=8192)
    with pytest.raises(SystemExit):
        _serve_args(["m", "--max-seq-len-to-capture", "8192"])


def test_tokenizer_revision_reaches_the_hub_tokenizer_load(monkeypatch, tiny_llama_dir, tmp_path):
    """vLLM's tokenizer_revision (default: revision): a hub model id whose tokenizer_revision differs loads its
    tokenizer from the hub at that revision (its files at revision serve the model); a hub --tokenizer id gets it
    too; a local path is used as it is. Only the hub calls are replaced: the engine is real."""
    import transformers

    from pagedllm.models import model_resolution

    args = _serve_args(["m", "--tokenizer-revision", "tok-v2", "--revision", "v1", "--code-revision", "v1"])
    assert (args.tokenizer_revision, args.revision, args.code_revision) == ("tok-v2", "v1", "v1")
    (tmp_path / "serve.yaml").write_text("tokenizer-revision: tok-v3\n")
    assert _serve_args(["m", "--config", str(tmp_path / "serve.yaml")]).tokenizer_revision == "tok-v3"
    resolved, loads = [], []
    monkeypatch.setattr(model_resolution, "resolve_repo_id",
                        lambda model, revision, download_dir, token: resolved.append(revision) or tiny_llama_dir)
    real = transformers.AutoTokenizer.from_pretrained.__func__

    def load(cls, source, **kw):  # a hub id is served from the tiny model's files
        loads.append((source, kw.get("revision")))
        return real(cls, tiny_llama_dir if source.startswith("acme/") else source, **kw)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", classmethod(load))
    for kwargs, want in [
        (dict(revision="v1", tokenizer_revision="tok-v2"), ("acme/tiny", "tok-v2")),  # from the hub, its revision
        (dict(revision="v1"), (tiny_llama_dir, "v1")),  # the model's files, already at v1
        (dict(tokenizer="acme/tok", tokenizer_revision="tok-v2"), ("acme/tok", "tok-v2")),
        (dict(tokenizer="acme/tok", revision="v1"), ("acme/tok", "v1")),  # tokenizer_revision defaults to revision
    ]:
        resolved.clear(), loads.clear()
        llm = LLM(model="acme/tiny", num_gpu_blocks_override=16, max_model_len=256, **kwargs)
        assert resolved == [kwargs.get("revision")] and loads == [want], kwargs
        assert llm.get_tokenizer().encode("hello world")
        llm.shutdown()
    loads.clear()  # a local model: accepted, its files used as they are
    LLM(model=tiny_llama_dir, tokenizer_revision="tok-v2", num_gpu_blocks_override=16, max_model_len=256).shutdown()
    assert loads == [(tiny_llama_dir, "tok-v2")]


def test_code_revision_other_than_revision_is_refused_for_hub_models(tiny_llama_dir):
    """pagedllm reads a model's code (trust_remote_code) from its files at revision: vLLM's code_revision is taken
    where it is that revision, or for a local path (which has no revisions); another one is refused in a sentence."""
    EngineArgs(model="acme/tiny", revision="v1", code_revision="v1").validate()
    EngineArgs(model=tiny_llama_dir, code_revision="v9").validate()
    with pytest.raises(ValueError, match=r"code_revision='v9' is not supported by pagedllm.*--revision v9"):
        EngineArgs(model="acme/tiny", revision="v1", code_revision="v9").validate()
    with pytest.raises(ValueError, match="code_revision='v9'"):
        LLM(model="acme/tiny", code_revision="v9")


def test_vllm_lora_dtype_and_fully_sharded_loras(tiny_llama_dir):
    """vLLM's lora_dtype / fully_sharded_loras were 'Unknown engine argument(s)' offline and unknown to serve:
    lora_dtype='auto' (vLLM's default: the model's dtype, what pagedllm does) and fully_sharded_loras (how TP ranks
    split the adapter math, not its result) are taken; another lora_dtype is refused naming it."""
    args = _serve_args(["m", "--enable-lora", "--lora-dtype", "auto", "--fully-sharded-loras"])
    assert args.lora_dtype == "auto" and args.fully_sharded_loras is True
    assert _serve_args(["m"]).lora_dtype == "auto" and _serve_args(["m"]).fully_sharded_loras is False
    llm = LLM(model=tiny_llama_dir, dtype="float32", enable_lora=True, lora_dtype="auto", fully_sharded_loras=True,
              num_gpu_blocks_override=16, max_model_len=256)
    assert llm.engine_args.fully_sharded_loras is True
    with pytest.raises(ValueError, match="lora_dtype='float16' is not supported"):
        EngineArgs(enable_lora=True, lora_dtype="float16").validate()


def _config_dir(tmp_path, source_dir: str, **changes) -> str:
    """A directory holding only source_dir's config.json with `changes` written over it (an --hf-config-path)."""
    import json
    import os

    with open(os.path.join(source_dir, "config.json")) as f:
        config = json.load(f)
    config.update(changes)
    folder = tmp_path / "hf-config"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_hf_config_path_config_replaces_the_models(tiny_llama_dir, tmp_path):
    """vLLM's hf_config_path: its config.json describes the model, not the model directory's (here one layer, a
    smaller vocabulary and context where the model's own say 2, 512, 512); dummy weights fit either."""
    from pagedllm.executor.multiproc import prepare_model

    folder = _config_dir(tmp_path, tiny_llama_dir, num_hidden_layers=1, vocab_size=384, max_position_embeddings=128,
                         is_matryoshka=True)
    llm = LLM(model=tiny_llama_dir, load_format="dummy", hf_config_path=folder, num_gpu_blocks_override=16)
    worker = llm.engine.worker
    assert worker.hf_config.num_hidden_layers == 1 and len(worker.model.model.layers) == 1
    assert (llm.engine.vocab_size, llm.engine.max_model_len) == (384, 128)
    assert llm.engine.pooling_defaults.matryoshka == ()  # (read from the config file too)
    # the multi-process executor's head reads the same config as its ranks (each a Worker as above)
    assert prepare_model(llm.engine_args)[1].num_hidden_layers == 1
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3 and all(t < 384 for t in out[0].outputs[0].token_ids)
    llm.shutdown()
    plain = LLM(model=tiny_llama_dir, load_format="dummy", num_gpu_blocks_override=32)
    assert (plain.engine.worker.hf_config.num_hidden_layers, plain.engine.vocab_size) == (2, 512)
    assert plain.engine.pooling_defaults.matryoshka is None and prepare_model(plain.engine_args)[1].vocab_size == 512


def test_hf_config_path_over_a_gguf_models_metadata(smollm2_gguf_path, smollm2_hf_dir, smollm2_cache_dir, tmp_path,
                                                    monkeypatch):
    """A GGUF's config comes from its metadata; hf_config_path's config.json is used instead, as vLLM does (here
    the same model with a shorter context), and the GGUF's weights load into it."""
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", smollm2_cache_dir)
    folder = _config_dir(tmp_path, smollm2_hf_dir, max_position_embeddings=1000)
    llm = LLM(model=smollm2_gguf_path, hf_config_path=folder, num_gpu_blocks_override=64)
    assert llm.engine.max_model_len == 1000 and llm.engine.worker.hf_config.max_position_embeddings == 1000
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got = llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0].text
    llm.shutdown()
    plain = LLM(model=smollm2_gguf_path, num_gpu_blocks_override=64, max_model_len=1000)
    assert plain.engine.max_model_len == 1000
    assert plain.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0].text == got


def test_hf_config_path_flag_and_bad_paths(tiny_llama_dir, tmp_path, capsys):
    from pagedllm.entrypoints.cli import serve

    folder = _config_dir(tmp_path, tiny_llama_dir)
    args = _serve_args(["m", "--hf-config-path", folder])
    assert args.hf_config_path == folder and EngineArgs().hf_config_path is None
    args.validate()
    assert args.hf_config_dir() == folder
    missing = str(tmp_path / "no-such-dir")
    with pytest.raises(ValueError, match=f"hf_config_path '{missing}' does not exist"):
        EngineArgs(hf_config_path=missing).validate()
    with pytest.raises(ValueError, match=f"hf_config_path '{tmp_path}' has no config.json"):
        EngineArgs(hf_config_path=str(tmp_path)).validate()
    with pytest.raises(ValueError, match="is a file; give the directory"):
        EngineArgs(hf_config_path=str(tmp_path / "hf-config" / "config.json")).validate()
    with pytest.raises(ValueError, match=f"hf_config_path '{missing}' does not exist"):
        LLM(model=tiny_llama_dir, hf_config_path=missing)
    # the server: a one-line error and exit status 2, before any engine starts
    assert serve.main([tiny_llama_dir, "--hf-config-path", missing]) == 2
    err = capsys.readouterr().err
    assert f"error: hf_config_path '{missing}' does not exist" in err and "Traceback" not in err


def test_hf_config_path_reaches_the_worker_ranks(tiny_llama_dir, tmp_path):
    """Tensor-parallel worker processes each read hf_config_path's config, as the head does: one layer and a vocabulary
    of 384 on both ranks (a rank building the model directory's 2 layers / 512 would not match its peer)."""
    folder = _config_dir(tmp_path, tiny_llama_dir, num_hidden_layers=1, vocab_size=384, max_position_embeddings=128)
    with LLM(tiny_llama_dir, device="cpu", enforce_eager=True, tensor_parallel_size=2, load_format="dummy",
             hf_config_path=folder, num_gpu_blocks_override=16) as llm:
        assert (llm.engine.vocab_size, llm.engine.max_model_len) == (384, 128)
        assert llm.engine.worker.hf_config.num_hidden_layers == 1
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3 and all(t < 384 for t in out[0].outputs[0].token_ids)


def test_hf_config_path_as_a_hub_repo_id_fetches_its_configs_only(monkeypatch, tiny_llama_dir, tmp_path):
    """A repo id is resolved once (model's revision, download_dir, hf_token), asking for config and code files only
    (never the repo's weights); a repo the hub does not have is an error naming hf_config_path."""
    from pagedllm.models import model_resolution

    folder = _config_dir(tmp_path, tiny_llama_dir, num_hidden_layers=1)
    asked = []

    def resolve(repo, revision, download_dir, token, allow_patterns=None):
        asked.append((repo, revision, token, allow_patterns))
        if repo == "acme/missing":
            raise ValueError("Model 'acme/missing' was not found on the Hugging Face Hub.")
        return folder

    monkeypatch.setattr(model_resolution, "resolve_repo_id", resolve)
    model_resolution.resolve_config_dir.cache_clear()
    args = EngineArgs(model=tiny_llama_dir, hf_config_path="acme/base", revision="v1", hf_token="hf_abc")
    args.validate()  # (nothing fetched yet)
    assert asked == []
    llm = LLM(model=tiny_llama_dir, hf_config_path="acme/base", revision="v1", hf_token="hf_abc",
              load_format="dummy", num_gpu_blocks_override=32)
    assert llm.engine.worker.hf_config.num_hidden_layers == 1 and llm.engine.pooling_defaults.matryoshka is None
    assert asked == [("acme/base", "v1", "hf_abc", ["*.json", "*.py"])]
    llm.shutdown()
    with pytest.raises(ValueError, match="hf_config_path 'acme/missing': Model 'acme/missing' was not found"):
        LLM(model=tiny_llama_dir, hf_config_path="acme/missing", num_gpu_blocks_override=32)
    model_resolution.resolve_config_dir.cache_clear()
