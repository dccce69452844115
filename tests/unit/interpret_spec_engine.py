"""A speculating engine on the Triton backend, in Triton's interpreter on the CPU:
`TRITON_INTERPRET=1 python interpret_spec_engine.py MODEL_DIR` (run in a subprocess by test_spec_triton_interpreted.py:
TRITON_INTERPRET must be set before any kernel is defined). Its verify rows (k + 1 query tokens per request) go
through the few-query attention kernel (one split: PAGEDLLM_DECODE_MAX_SPLITS=1 caps it too; its split launches are
tests/gpu/test_few_query_attention.py's); the tokens must equal the torch backend's plain greedy tokens. fp32 only:
the interpreter returns garbage for bf16 tl.dot; the GPU tests cover bf16."""
from __future__ import annotations

import os
import sys


def check_engine(model_dir: str) -> None:
    """Unfused qkv and one decode split: the interpreter cannot run the fused kernel's or the split decode's
    masks."""
    from pagedllm import LLM, SamplingParams

    assert os.environ.get("PAGEDLLM_FUSED_QKV") == "0" and os.environ.get("PAGEDLLM_DECODE_MAX_SPLITS") == "1"
    base = [17, 200, 31, 5, 88, 140, 9, 61, 300, 12, 77, 250]
    prompts = [{"prompt_token_ids": base * 3}, {"prompt_token_ids": base[:5] * 4}, {"prompt_token_ids": base[3:9]}]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    common = dict(kv_cache_memory_bytes=1 << 22, max_model_len=128)
    tri = LLM(model_dir, attention_backend="triton", speculative_config=spec, **common)
    got = [o.outputs[0].token_ids for o in tri.generate(prompts, params, use_tqdm=False)]
    ref = LLM(model_dir, attention_backend="torch", **common)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    assert got == want, (got, want)
    assert tri.engine.scheduler.spec_stats.num_accepted_tokens > 0
    print("engine ok")


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    check_engine(sys.argv[1])
