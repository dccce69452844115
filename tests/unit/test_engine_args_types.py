"""EngineArgs.validate: options of plain types must have values of that type, with a sentence naming the option (a
string "false" would be truthy; "512" or 512.5 failed deep inside the engine, after the load had started)."""
from __future__ import annotations

import pathlib

import numpy as np
import pytest

from pagedllm.config import EngineArgs


@pytest.mark.parametrize("kwargs, fragment", [
    ({"max_model_len": "512"}, "max_model_len must be an int or None"),
    ({"max_model_len": 512.5}, "max_model_len must be an int or None"),
    ({"max_num_seqs": True}, "max_num_seqs must be an int"),
    ({"gpu_memory_utilization": "0.5"}, "gpu_memory_utilization must be a float"),
    ({"enforce_eager": "no"}, "enforce_eager must be a bool"),
    ({"trust_remote_code": "false"}, "trust_remote_code must be a bool"),
    ({"seed": "x"}, "seed must be an int"),
    ({"model": 5}, "model must be a str or None"),
])
def test_wrong_types_are_refused(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        EngineArgs(**kwargs).validate()


def test_numpy_ints_paths_and_seed_none_are_accepted():
    args = EngineArgs(model=pathlib.Path("/tmp/model"), max_model_len=np.int64(64), gpu_memory_utilization=1,
                      seed=None)
    args.validate()
    assert args.model == "/tmp/model" and isinstance(args.seed, int)


def test_torch_dtype_is_taken_by_its_name():
    """vLLM's LLM(dtype=torch.float16) works as dtype="float16"; a torch dtype that is no choice names the choices."""
    import torch

    args = EngineArgs(dtype=torch.bfloat16)
    args.validate()
    assert args.dtype == "bfloat16"
    with pytest.raises(ValueError, match="dtype must be one of .*, got 'int8'"):
        EngineArgs(dtype=torch.int8).validate()


@pytest.mark.parametrize("kwargs, fragment", [
    ({"seed": -1}, "seed must be in [0, 2**64), got -1."),
    ({"seed": 2 ** 70}, f"seed must be in [0, 2**64), got {2 ** 70}."),  # torch: "Overflow when unpacking long long"
    ({"kv_cache_memory_bytes": -5}, "kv_cache_memory_bytes must be >= 1, got -5."),
    # nan (serve --swap-space nan) passed the `< 0` checks and reached the engine
    ({"swap_space": float("nan")}, "swap_space must be >= 0 (GiB), got nan."),
    ({"cpu_offload_gb": float("nan")}, "cpu_offload_gb must be >= 0 (0 turns offloading off), got nan."),
])
def test_out_of_range_values_are_refused(kwargs, fragment):
    import re

    with pytest.raises(ValueError, match=re.escape(fragment)):
        EngineArgs(**kwargs).validate()
