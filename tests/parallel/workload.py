"""One workload every parallel layout must reproduce token for token: mixed prompt lengths decoding beside
prefill chunks (a 32-token step budget), a small KV pool that forces preemptions, a shared prefix hit by a
second round, and seeded sampling."""
from __future__ import annotations

import random

from pagedllm import LLM, SamplingParams

# Same pool for every layout (a budget in bytes would give TP / PP ranks more blocks: they hold less per block).
# max_model_len 128: one sequence fits the 12 blocks also with a sliding-window group beside the full one.
ENGINE_KWARGS = dict(device="cpu", enforce_eager=True, max_num_seqs=8, max_num_batched_tokens=32,
                     num_gpu_blocks_override=12, max_model_len=128, seed=0)


def _prompts(seed: int = 0, vocab: int = 512) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    mixed = [[rng.randrange(2, vocab) for _ in range(n)] for n in (5, 23, 40, 61, 12, 33, 47, 9)]
    prefix = [rng.randrange(2, vocab) for _ in range(40)]
    shared = [prefix + [rng.randrange(2, vocab) for _ in range(n)] for n in (3, 11)]
    return mixed, shared


def run_workload(llm: LLM, vocab: int = 512) -> dict:
    mixed, shared = _prompts(vocab=vocab)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    # Plain temperature: top-p / top-k cut at near-ties of a random model, where TP rounding may pick another side.
    seeded = [SamplingParams(temperature=0.9, max_tokens=8, seed=100 + i, ignore_eos=True)
              for i in range(4)]

    def gen(prompts, params):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    result = {
        "mixed": gen(mixed + shared, greedy),  # 10 requests in a 12-block pool: preemptions
        "prefix_round": gen(shared, greedy),  # the shared 40-token prefix: cache hits
        "seeded": gen(mixed[:4], seeded),
    }
    stats = llm.engine.get_stats()
    result["preempted"] = stats.num_preemptions > 0
    result["prefix_hits"] = stats.prefix_cache_hits > 0
    return result
