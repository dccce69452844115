"""What a small model's step costs the host on CUDA, piece by piece (issue 28: SmolLM2's steps are host-bound).

    python benchmarks/launch_costs.py --model benchmarks/configs/smollm2-135m --load-format dummy --dtype bfloat16

For the decode graph of batch 1 and the mixed graph of a k+1-token verify step (the few-query tile where it is
captured): host time per replay (replays queued back to back, no sync) and device time per replay
(synced); then the host time per launch of the small eager kernels a step runs outside the graphs (the Triton
argmax, the one-row LM head GEMV, a torch copy), each with its Triton kernels launched three ways in alternating
rounds (Triton's launch, the direct launch through the compiled kernel's runner, the direct launch calling its
launcher: kernels/triton_launch.py). PAGEDLLM_GRAPH_GREEDY=0: without the greedy tail graphs."""
from __future__ import annotations

import argparse
import statistics
import time


def per_call(fn, n: int) -> tuple[float, float]:
    """(host us per call with calls queued back to back, wall us per call synced at the end)."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return 1e6 * (t1 - t0) / n, 1e6 * (t2 - t0) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="benchmarks/configs/smollm2-135m")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--n", type=int, default=50, help="calls per measurement")
    p.add_argument("--rounds", type=int, default=5, help="rounds of the eager pieces' three launch modes")
    p.add_argument("--profile", type=int, default=0, metavar="CALLS",
                   help="also cProfile CALLS calls of each eager piece: its top functions by own time")
    args = p.parse_args()

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("launch_costs.py measures CUDA graph replays and kernel launches: no CUDA device here")
    from pagedllm import LLM

    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    llm = LLM(model=args.model, load_format=args.load_format, dtype=args.dtype, max_model_len=2048,
              skip_tokenizer_init=args.load_format == "dummy", gpu_memory_utilization=0.3, speculative_config=spec)
    runner = llm.engine.worker.runner
    decode = runner.cuda_graphs
    mixed = runner.mixed_graphs
    rows = []
    for key, graph in sorted(decode.graphs.items()):
        if key[0] == 1:
            rows.append((f"decode graph {key}", graph))
            if key in decode.tails.graphs:
                rows.append((f"its greedy tail (LM head + argmax) {key}", decode.tails.graphs[key]))
            break
    mixed_graphs = mixed.graphs if mixed is not None else {}
    verify_graphs = [(key, graph) for key, graph in sorted(mixed_graphs.items(), key=lambda kv: str(kv[0]))
                     if key[0] == args.k + 1]
    if not verify_graphs:
        print(f"[launch] no mixed graph of {args.k + 1} tokens was captured (mixed graphs off?): decode graph only")
    rows += [(f"mixed graph {key}", graph) for key, graph in verify_graphs]
    for label, graph in rows:
        graph.replay()
        host, wall = per_call(graph.replay, args.n)
        print(f"[launch] {label}: host {host:.1f} us per replay, wall {wall:.1f} us per replay (synced after "
              f"{args.n})", flush=True)
    from pagedllm.kernels.argmax import argmax_rows

    logits = torch.randn(1, runner.vocab_size, device=runner.device, dtype=torch.float32)
    hidden = torch.randn(1, runner.model.config.hidden_size, device=runner.device, dtype=runner.dtype)
    verify_hidden = torch.randn(args.k + 1, runner.model.config.hidden_size, device=runner.device,
                                dtype=runner.dtype)
    src = torch.zeros(1024, device=runner.device, dtype=torch.int64)
    dst = torch.zeros(1024, device=runner.device, dtype=torch.int64)
    pieces = [("Triton argmax_rows, 1 x vocab", lambda: argmax_rows(logits)),
              ("greedy_token_ids (LM head + argmax), 1 row", lambda: runner.model.greedy_token_ids(hidden)),
              (f"greedy_token_ids, {args.k + 1} rows", lambda: runner.model.greedy_token_ids(verify_hidden)),
              ("spec_step_outputs, 1 plain row (the device n-gram after a step)", spec_outputs_call(runner)),
              ("torch copy_ (1024 int64)", lambda: dst.copy_(src)),
              ("torch.empty pinned (1 int64)", lambda: torch.empty(1, dtype=torch.int64, pin_memory=True))]
    import triton

    from pagedllm.kernels import triton_launch

    print(f"[launch] Triton {triton.__version__}: its compiled-kernel runner "
          f"{'has' if triton_launch._runner_shape_known() else 'does NOT have'} the shape the fast runner knows",
          flush=True)
    # The eager Triton launches three ways, alternating in rounds (medians): Triton's own launch, the direct launch
    # through the compiled kernel's runner, and the direct launch calling its `run` (kernels/triton_launch.py).
    modes = {"triton": (False, True), "direct-runner": (True, False), "direct-fast": (True, True)}
    for label, fn in pieces:
        hosts = {mode: [] for mode in modes}
        walls = {mode: [] for mode in modes}
        for _ in range(args.rounds):
            for mode, (direct, fast) in modes.items():
                triton_launch.set_enabled(direct)
                triton_launch.set_fast(fast)
                for _ in range(3):
                    fn()
                host, wall = per_call(fn, args.n)
                hosts[mode].append(host)
                walls[mode].append(wall)
        triton_launch.set_enabled(None)
        triton_launch.set_fast(True)
        print(f"[launch] {label}: host us per call (median of {args.rounds} rounds) " + ", ".join(
            f"{mode} {statistics.median(hosts[mode]):.1f}" for mode in modes)
              + f"; wall {statistics.median(walls['direct-fast']):.1f} us (direct-fast)", flush=True)
        if args.profile:
            profile_calls(fn, label, args.profile)


def spec_outputs_call(runner):
    """A batch-1 plain step's call of the device n-gram's after-step kernel, on the engine's own n-gram state
    (row 0's history grows by one token per call, within max_model_len over this script's calls: scratch here)."""
    import torch

    from pagedllm.kernels.spec_decode import spec_step_outputs

    ngram = runner.spec.device_ngram
    z = torch.zeros(1, dtype=torch.int64, device=runner.device)
    one = torch.ones(1, dtype=torch.int64, device=runner.device)

    def call():
        spec_step_outputs(z, z, one, z, ngram.hist, ngram.lens, ngram.drafts, ngram.num_drafts, ngram.min_n,
                          ngram.max_n, True)
    return call


def profile_calls(fn, label: str, calls: int, top: int = 14) -> None:
    """Where a piece's host time goes: cProfile of `calls` calls, the top functions by own time (us per call)."""
    import cProfile
    import pstats

    import torch

    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats
    total = sum(tottime for (_, _, tottime, _, _) in stats.values())
    print(f"[launch profile] {label}: {1e6 * total / calls:.1f} us per call under cProfile; own time per call:")
    for (file, line, func), (_, ncalls, tottime, cumtime, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]:
        short = "/".join(file.split("/")[-2:])
        print(f"    {1e6 * tottime / calls:7.1f} {1e6 * cumtime / calls:7.1f} {ncalls / calls:5.1f}  "
              f"{short}:{line}({func})", flush=True)


if __name__ == "__main__":
    main()
