"""vLLM engine arguments its users pass to `LLM(...)` and `pagedllm serve`: each honoured where pagedllm has the
feature, else a non-default value refused with a sentence naming the argument (never silently ignored)."""
from __future__ import annotations

import argparse
import types

import pytest

from pagedllm import LLM, SamplingParams
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
