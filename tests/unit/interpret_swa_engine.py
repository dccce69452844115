"""Sliding-window models on the Triton backend, in Triton's interpreter on the CPU:
`TRITON_INTERPRET=1 python interpret_swa_engine.py MODEL_DIR...` (run in a subprocess by
test_sliding_window_triton_interpreted.py: TRITON_INTERPRET must be set before any kernel is defined). The windowed
prefill kernel (prompts, chunks, prefix hits) and decode kernel (one split: see interpret_spec_engine.py) must give
the torch backend's greedy tokens, which equal transformers' (tests/engine/test_sliding_window.py). fp32 only."""
from __future__ import annotations

import os
import sys


def check_engine(model_dir: str) -> None:
    from pagedllm import LLM, SamplingParams

    assert os.environ.get("PAGEDLLM_FUSED_QKV") == "0" and os.environ.get("PAGEDLLM_DECODE_MAX_SPLITS") == "1"
    base = [17, 200, 31, 5, 88, 140, 9, 61, 300, 12, 77, 250, 3, 44, 101, 7]
    prompts = [{"prompt_token_ids": base * 5}, {"prompt_token_ids": base[:9]},
               {"prompt_token_ids": base * 5 + [8, 9]}]  # the last one hits the first one's blocks
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    common = dict(dtype="float32", block_size=8, num_gpu_blocks_override=64, max_num_batched_tokens=48,
                  max_num_seqs=4, max_model_len=128)  # one sequence in every KV-cache group fits the 64 blocks
    tri = LLM(model_dir, attention_backend="triton", **common)
    got = [o.outputs[0].token_ids for o in tri.generate(prompts[:2], params, use_tqdm=False)]
    got += [o.outputs[0].token_ids for o in tri.generate(prompts[2:], params, use_tqdm=False)]
    assert tri.engine.get_stats().prefix_cache_hits > 0
    ref = LLM(model_dir, attention_backend="torch", **common)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    assert got == want, (got, want)
    print("engine ok", model_dir)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    for path in sys.argv[1:]:
        check_engine(path)
