"""The block pool's hot operations (allocate / touch / free / cache_block), timed alone: CPU time per block and
operation, for this checkout's `core/block_pool.py` and, with `--against REV` (repeatable), the same file at git
revisions (e.g. the commit before a change), run alternately in one process so all see the same machine.

    python benchmarks/block_pool_ops.py [--against REV ...] [--blocks 100000] [--repeats 7]

The workload is the KV manager's own pattern, one "request" at a time: touch a cached 4-block prefix (prefix-cache
hits), allocate 28 fresh blocks (which evicts cached ones once the pool has turned over), cache the full ones, then
free all 32 tail-first. Best of `--repeats` runs of 2,000 requests each (the minimum: the run least disturbed by other
processes): each operation by time.perf_counter around it (less the cost of reading the clock twice, measured first),
the whole run also in thread CPU time. The garbage collector is off while timing (its pauses would land on whichever
operation happened to allocate). A second table times whole calls of a few sizes (0, 1, 4 and 32 blocks: a decode
step's allocate(1), a request without prefix hits' touch([]), ...), where a call's fixed cost shows.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX, FRESH, REQUESTS = 4, 28, 2000


def load_pool_module(rev: str | None) -> types.ModuleType:
    path = os.path.join(ROOT, "src", "pagedllm", "core", "block_pool.py")
    if rev is not None:
        text = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:src/pagedllm/core/block_pool.py"], check=True,
                              capture_output=True, text=True).stdout
        fd, path = tempfile.mkstemp(suffix=".py", prefix="block_pool_")
        with os.fdopen(fd, "w") as f:
            f.write(text)
    spec = importlib.util.spec_from_file_location(f"block_pool_{rev or 'here'}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def clock_pair_s() -> float:
    """What reading time.perf_counter twice costs (subtracted from each operation's time)."""
    clock, best = time.perf_counter, float("inf")
    for _ in range(5):
        t = time.thread_time()
        for _ in range(100_000):
            clock()
            clock()
        best = min(best, (time.thread_time() - t) / 100_000)
    return best


def run(module: types.ModuleType, num_blocks: int, overhead_s: float) -> dict[str, float]:
    """Seconds per operation for REQUESTS requests, and the whole run's thread CPU time ("run")."""
    pool = module.BlockPool(num_blocks)
    prefix = pool.allocate(PREFIX)
    for i, b in enumerate(prefix):
        pool.cache_block(b, ("prefix", i))
    pool.free(reversed(prefix))
    spent = {"touch": 0.0, "allocate": 0.0, "cache_block": 0.0, "free": 0.0}
    clock = time.perf_counter
    start = time.thread_time()
    for r in range(REQUESTS):
        hits = [pool.get_cached_block(("prefix", i)) for i in range(PREFIX)]
        t0 = clock()
        pool.touch(hits)
        t1 = clock()
        fresh = pool.allocate(FRESH)
        t2 = clock()
        for i, b in enumerate(fresh[:-1]):  # the last block is partly filled: not cached
            pool.cache_block(b, (r, i))
        t3 = clock()
        pool.free(reversed(hits + fresh))
        t4 = clock()
        spent["touch"] += t1 - t0
        spent["allocate"] += t2 - t1
        spent["cache_block"] += t3 - t2
        spent["free"] += t4 - t3
    spent = {k: v - REQUESTS * overhead_s for k, v in spent.items()}
    spent["run"] = time.thread_time() - start
    return spent


def per_call(module: types.ModuleType, n: int) -> dict[str, float]:
    """Seconds per call pair: allocate(n) + free(those), and touch(n cached free blocks) + free(them)."""
    import timeit

    pool = module.BlockPool(10_000)
    out = {}
    out["allocate + free"] = min(timeit.repeat(lambda: pool.free(pool.allocate(n)), number=5000, repeat=3)) / 5000
    blocks = pool.allocate(n)
    for i, b in enumerate(blocks):
        pool.cache_block(b, ("call", i))
    pool.free(blocks)

    def touch_free() -> None:
        pool.touch(blocks)
        pool.free(blocks)

    out["touch + free"] = min(timeit.repeat(touch_free, number=5000, repeat=3)) / 5000
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", action="append", default=[], help="a git revision whose core/block_pool.py is timed "
                   "too (repeatable)")
    p.add_argument("--blocks", type=int, default=100_000)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    sides = {"this checkout": load_pool_module(None)}
    for rev in args.against:
        sides[rev] = load_pool_module(rev)
    overhead_s = clock_pair_s()
    best: dict[str, dict[str, float]] = {}
    for _ in range(args.repeats):
        for name, module in sides.items():  # alternately: load on the machine falls on both alike
            gc.collect()
            gc.disable()
            try:
                got = run(module, args.blocks, overhead_s)
            finally:
                gc.enable()
            mine = best.setdefault(name, got)
            for k, v in got.items():
                mine[k] = min(mine[k], v)
    per_block = {"touch": PREFIX, "allocate": FRESH, "cache_block": FRESH - 1, "free": PREFIX + FRESH}
    print(f"ns per block, best of {args.repeats} x {REQUESTS} requests ({PREFIX} hits + {FRESH} fresh blocks each), "
          f"pool of {args.blocks:,} blocks, Python {sys.version.split()[0]}")
    print(f"  {'':16s}" + "".join(f"{k:>13s}" for k in per_block) + f"{'whole run':>13s}")
    for name, spent in best.items():
        cells = [1e9 * spent[k] / (REQUESTS * n) for k, n in per_block.items()]
        total = 1e9 * spent["run"] / (REQUESTS * (PREFIX + FRESH))
        print(f"  {name:16s}" + "".join(f"{c:13.1f}" for c in cells) + f"{total:13.1f}")
    print("  (whole run: thread CPU time per block of a request, the clock reads and cached-block lookups included)")
    sizes = (0, 1, 4, 32)
    calls: dict[tuple[str, int], dict[str, float]] = {}
    gc.disable()
    try:
        for _ in range(args.repeats):
            for name, module in sides.items():
                for n in sizes:
                    got = per_call(module, n)
                    mine = calls.setdefault((name, n), got)
                    for k, v in got.items():
                        mine[k] = min(mine[k], v)
    finally:
        gc.enable()
    print(f"ns per call pair, best of {args.repeats}, by blocks per call")
    print(f"  {'':16s}" + "".join(f"{f'alloc+free {n}':>15s}" for n in sizes)
          + "".join(f"{f'touch+free {n}':>15s}" for n in sizes))
    for name in sides:
        print(f"  {name:16s}" + "".join(f"{1e9 * calls[(name, n)]['allocate + free']:15.0f}" for n in sizes)
              + "".join(f"{1e9 * calls[(name, n)]['touch + free']:15.0f}" for n in sizes))


if __name__ == "__main__":
    main()
