"""Host time of one CUDA-graph launch, per captured decode graph: does cudaGraphLaunch cost the host more than a
few microseconds, and for which graphs? (issue 29: a 256-row decode step's profile showed the device waiting
~0.5 ms for its graph's launch to return.)

    python benchmarks/graph_launch_cost.py --model benchmarks/configs/qwen3-0.6b --load-format dummy
    PAGEDLLM_PDL=0 python benchmarks/graph_launch_cost.py ...      # the same graphs without programmatic edges

For each decode graph (batch bucket x context bucket): the host's time inside `replay()` with the device idle
(synchronized before each launch) and queued back to back, and the graph's device time; the median of --n."""
from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="benchmarks/configs/qwen3-0.6b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--n", type=int, default=20)
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128, 256])
    args = p.parse_args()
    import torch

    from pagedllm import LLM, envs

    llm = LLM(model=args.model, load_format=args.load_format, skip_tokenizer_init=True, max_num_seqs=256,
              max_model_len=2048)
    graphs = llm.engine.worker.runner.cuda_graphs.graphs
    print(f"PAGEDLLM_PDL={int(envs.PAGEDLLM_PDL)}; {len(graphs)} decode graphs")
    keys = sorted(k for k in graphs if k[0] in args.sizes)
    for key in keys:
        g = graphs[key]
        idle, queued = [], []
        for _ in range(args.n):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            g.replay()
            idle.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.n):
            g.replay()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        queued.append((t1 - t0) / args.n)
        print(f"graph {key}: launch with the device idle {1e6 * statistics.median(idle):7.1f} us (min "
              f"{1e6 * min(idle):7.1f}), queued {1e6 * queued[0]:7.1f} us, device {1e6 * (t2 - t0) / args.n:7.1f} us",
              flush=True)


if __name__ == "__main__":
    main()
