"""KV blocks a long sequence holds with sliding-window layers vs full attention, through the real KV manager
(core/kv_cache_manager.py, core/kv_cache_groups.py), and the manager's CPU time per decode step.

    python benchmarks/kv_sliding_window.py [--context 8192] [--block-size 16] [--chunk 2048]

For each layout one request is prefilled in chunks and decoded to --context tokens, as the scheduler drives the
manager. "layer-blocks" = block ids held x layers per block id (one block id is S layers' memory with several KV
groups, every layer's without), the KV memory in units of one layer's block; the peak is over the whole run, the
decode figure at the last step. Then 20,000 decode steps of 64 such requests are timed (allocate_slots only, thread
CPU time, best of 5) to show what the groups cost the scheduler.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from pagedllm.core.kv_cache_groups import kv_cache_groups  # noqa: E402
from pagedllm.core.kv_cache_manager import KVCacheManager  # noqa: E402
from pagedllm.core.request import Request  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402

# name -> per-layer windows (None: full attention)
LAYOUTS = {
    "full attention, 26 layers": [None] * 26,
    "Gemma 3 1B (26 layers, 22 x 512 local + 4 global)": [None if i % 6 == 5 else 512 for i in range(26)],
    "Gemma 3 4B (34 layers, 29 x 1024 local + 5 global)": [None if i % 6 == 5 else 1024 for i in range(34)],
    "Mistral 7B v0.1 (32 layers, all 4096 local)": [4096] * 32,
}


def drive(windows, context, bs, chunk, max_model_len):
    groups = kv_cache_groups(windows, max_model_len)
    m = KVCacheManager(block_size=bs, num_blocks=1 << 20, enable_caching=False, group_windows=groups.windows)
    r = Request("r", list(range(chunk)), SamplingParams(max_tokens=context))
    peak = 0
    done = 0
    while done < min(chunk, context):
        n = min(chunk, r.num_tokens - done)
        assert m.allocate_slots(r, n) is not None
        done += n
        r.num_computed_tokens = done
        peak = max(peak, m.block_pool.num_used_blocks)
    while r.num_computed_tokens < context:
        r.append_output_token_ids([1])
        assert m.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
        peak = max(peak, m.block_pool.num_used_blocks)
    return groups, peak * groups.num_slots, m.block_pool.num_used_blocks * groups.num_slots


def time_decode(windows, bs, max_model_len, reqs=64, steps=20000, start=4000):
    groups = kv_cache_groups(windows, max_model_len)
    best = None
    for _ in range(5):
        m = KVCacheManager(block_size=bs, num_blocks=1 << 20, enable_caching=True, group_windows=groups.windows)
        rs = [Request(f"r{i}", list(range(i, i + start)), SamplingParams(max_tokens=10 ** 6)) for i in range(reqs)]
        for r in rs:
            m.allocate_slots(r, r.num_tokens)
            r.num_computed_tokens = r.num_tokens
        t0 = time.thread_time()
        for s in range(steps // reqs):
            for r in rs:
                r.append_output_token_ids([s])
                m.allocate_slots(r, 1)
                r.num_computed_tokens += 1
        elapsed = (time.thread_time() - t0) / (steps // reqs * reqs)
        best = elapsed if best is None else min(best, elapsed)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=32768)
    args = ap.parse_args()
    print(f"context {args.context}, block size {args.block_size}, prefill chunks of {args.chunk}")
    print(f"{'layout':52s} {'groups':>6s} {'S':>3s} {'peak layer-blocks':>18s} {'at the end':>11s} {'vs full':>8s}"
          f" {'us/decode step':>15s}")
    for name, windows in LAYOUTS.items():
        groups, peak, end = drive(windows, args.context, args.block_size, args.chunk, args.max_model_len)
        full = len(windows) * -(-args.context // args.block_size)
        us = time_decode(windows, args.block_size, args.max_model_len) * 1e6
        print(f"{name:52s} {groups.num_groups:6d} {groups.num_slots:3d} {peak:18d} {end:11d} {full / end:7.2f}x"
              f" {us:15.2f}")


if __name__ == "__main__":
    main()
