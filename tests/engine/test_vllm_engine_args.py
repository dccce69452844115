"""vLLM engine arguments its users pass to `LLM(...)` and `pagedllm serve`: each honoured where pagedllm has the
feature, else a non-default value refused with a sentence naming the argument (never silently ignored)."""
from __future__ import annotations

import argparse

import pytest

from pagedllm import LLM
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
