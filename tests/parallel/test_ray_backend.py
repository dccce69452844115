"""`--distributed-executor-backend ray`: without Ray installed, one sentence says how to get it; with Ray
(`pip install 'pagedllm[ray]'`, not in CI) a TP=2 engine on a local Ray instance gives one rank's tokens."""
from __future__ import annotations

import importlib.util

import pytest

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.timeout(240)

_KW = dict(device="cpu", enforce_eager=True, num_gpu_blocks_override=64)
_PROMPTS = [{"prompt_token_ids": [5, 9, 17, 33, 100]}, {"prompt_token_ids": [44, 55, 66, 77]}]


@pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="Ray is installed here")
def test_ray_backend_without_ray_says_how_to_install(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"needs Ray, which is not installed: pip install 'pagedllm\[ray\]'"):
        LLM(tiny_llama_dir, tensor_parallel_size=2, distributed_executor_backend="ray", **_KW)


def test_ray_backend_matches_one_rank(tiny_llama_dir):
    pytest.importorskip("ray", reason="the Ray backend needs `pip install 'pagedllm[ray]'` (a manual run)")
    params = SamplingParams(max_tokens=8, temperature=0)
    expected = [list(o.outputs[0].token_ids) for o in LLM(tiny_llama_dir, **_KW).generate(_PROMPTS, params,
                                                                                          use_tqdm=False)]
    llm = LLM(tiny_llama_dir, tensor_parallel_size=2, distributed_executor_backend="ray", **_KW)
    try:
        assert [list(o.outputs[0].token_ids) for o in llm.generate(_PROMPTS, params, use_tqdm=False)] == expected
    finally:
        llm.engine.shutdown()
