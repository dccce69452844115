"""Mixture-of-experts on the GPU: the fused MoE layer, batch-1 decode, and offline throughput (bf16, dummy weights).

    python benchmarks/moe.py kernel --shape qwen3-30b-a3b            # the layer alone, CUDA-graph replays, per
    python benchmarks/moe.py kernel --shape mixtral-8x7b --sweep     #   token count; --sweep tries grouped tiles
    python benchmarks/moe.py kernel --shape qwen3-30b-a3b --peer vllm  # vLLM's fused_experts beside ours
    python benchmarks/moe.py decode --model benchmarks/configs/qwen3-30b-a3b            # batch-1 decode ms/step
    python benchmarks/moe.py decode --model benchmarks/configs/qwen3-30b-a3b --engine vllm   # the same on vLLM
    python benchmarks/moe.py throughput --model benchmarks/configs/mixtral-8x7b [--engine vllm]  # 512 x 512/256
    python benchmarks/moe.py rows --model benchmarks/configs/mixtral-8x7b [--engine vllm]  # decode + throughput,
                                                                    # one engine start for both

kernel: one MoE layer (router logits -> routing kernel -> experts) captured in a CUDA graph per token count and
  replayed; reports microseconds per layer and the memory-bound time of the bytes it must read (the distinct
  experts the step routes to, 3 * H * I weights each, plus activations) at HBM_BYTES_PER_S.
decode: one request of --input-len prompt tokens; ms/step = (time for 32 + N output tokens - time for 32) / N,
  the same for both engines (prefill and start-up cancel), against the active-weight bound: every non-expert
  weight, k experts per MoE layer, one embedding row and the average KV context read once per step.
throughput: offline_throughput.py's protocol with --num-prompts 512 --input-len 512 512 --output-len 256 256.
rows: the decode row and then 512 x 512 in / 256 out at --temperature (0.6, the nano-vllm protocol's) from one
  engine (max_num_seqs 512), so that each engine pays its start-up (vLLM: torch.compile, graphs) once.
vLLM runs in its own process (`--engine vllm` / `--peer vllm`: the wheel ../shared/device/vllm-peer.sh brings).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
HBM_BYTES_PER_S = 4.3e12  # measured H200 copy bandwidth (the other benchmarks' constant)
SHAPES = {  # experts, top-k, hidden, intermediate (per expert)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)


# ------------------------------------------------------------------------------------------------ kernel

def _graph_time_us(fn, iters: int) -> float:
    """Mean microseconds per call of fn replayed from a CUDA graph (captured after a warm-up on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def _vllm_fused_experts():
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts
    except Exception as e:  # not installed, or an API this script does not know
        print(f"vLLM's fused_experts is not importable here ({type(e).__name__}: {e}); skipping the peer.")
        return None
    return fused_experts


def run_kernel(args) -> list[dict]:
    from pagedllm.kernels.fused_moe import fused_moe_routed, grouped_config, moe_route

    experts, top_k, hidden, inter = SHAPES[args.shape]
    dtype = torch.bfloat16
    torch.manual_seed(0)
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda") * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device="cuda") * inter ** -0.5).to(dtype)
    peer = _vllm_fused_experts() if args.peer == "vllm" else None
    rows = []
    print(f"{args.shape}: E={experts} top-{top_k} H={hidden} I={inter}, {dtype}; us per layer (graph replays)")
    for tokens in args.tokens:
        x = torch.randn(tokens, hidden, device="cuda").to(dtype)
        logits = torch.randn(tokens, experts, device="cuda").to(dtype)
        _, ids = moe_route(logits, top_k, True)
        active = int(torch.unique(ids).numel())
        bytes_read = active * 3 * hidden * inter * w13.element_size() + 2 * x.numel() * x.element_size()
        bound_us = bytes_read / HBM_BYTES_PER_S * 1e6
        row = {"tokens": tokens, "active_experts": active, "bound_us": bound_us}
        m = tokens * top_k
        paths = (["gemv"] if m <= 64 else []) + ["grouped"] + (["torch"] if args.torch_grouped else [])
        for path in paths:
            configs = [None]
            if args.sweep and path == "gemv":
                # the two kernels' tiles one at a time (the other at its default): gate_up rows x K step, then
                # down rows x K step; K steps up to the whole row (one unrolled load of it)
                gate_k = [bk for bk in (512, 1024, 2048, 4096) if bk <= 2 * hidden]
                down_k = [bk for bk in (512, 1024, 2048) if bk <= 2 * inter]
                configs = [None] + [dict(GATE_BLOCK_N=gbn, GATE_BLOCK_K=bk, GATE_num_warps=w)
                                    for gbn in (2, 4, 8, 16) for bk in gate_k for w in (4, 8)
                                    if gbn * bk <= 16384] + \
                                   [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w)
                                    for bn in (2, 4, 8, 16) for bk in down_k for w in (4, 8) if bn * bk <= 16384]
            if args.sweep and path == "grouped":
                base = grouped_config(m, experts, dtype, inter)
                if args.sweep == "wide":  # the large tiles of prefill-sized token counts
                    configs = [None] + [dict(base, BLOCK_M=bm, BLOCK_N=bn, GATE_BLOCK_N=gbn, BLOCK_K=64,
                                             num_warps=w, num_stages=st)
                                        for bm in (64, 128) for bn, gbn in ((128, 64), (128, 128), (256, 128))
                                        for w in (4, 8) for st in (3, 4)]
                else:
                    configs = [None] + [dict(base, BLOCK_M=bm, BLOCK_N=bn, GATE_BLOCK_N=gbn, BLOCK_K=bk,
                                             num_warps=w)
                                        for bm in (16, 32, 64) for bn, gbn in ((64, 32), (64, 64), (128, 64))
                                        for bk in (64, 128) for w in (4, 8)]
            best = None
            for cfg in configs:
                def layer(cfg=cfg, path=path):
                    return fused_moe_routed(x, logits, w13, w2, top_k, True, path=path, config=cfg)
                try:
                    us = _graph_time_us(layer, args.iters)
                except Exception as e:  # a tile config that does not fit (shared memory): skip it
                    print(f"  T={tokens} {path} {cfg}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                if args.sweep:
                    print(f"    T={tokens} {path} {us:8.1f} us {cfg or 'default'}", flush=True)
                if best is None or us < best[0]:
                    best = (us, cfg)
            row[f"{path}_us"] = best[0]
            if args.sweep:
                row[f"best_{path}_config"] = best[1]
        if peer is not None:
            def vllm_layer():
                weights, topk_ids = moe_route(logits, top_k, True)
                return peer(x, w13, w2, weights, topk_ids)
            try:
                row["vllm_us"] = _graph_time_us(vllm_layer, args.iters)
            except Exception as e:
                print(f"  vLLM fused_experts failed at T={tokens}: {type(e).__name__}: {str(e)[:160]}")
        ours = min(v for k, v in row.items() if k in ("gemv_us", "grouped_us", "torch_us"))
        flops = 2 * m * 3 * hidden * inter
        extra = f", vLLM {row['vllm_us']:8.1f} us" if "vllm_us" in row else ""
        per_path = ", ".join("%s %.1f" % (p, row[p + "_us"]) for p in paths)
        print(f"  T={tokens:6d}  experts hit {active:4d}  ours {ours:8.1f} us ({per_path})  bound {bound_us:7.1f} us "
              f"-> {ours / bound_us:5.2f}x bound, {flops / ours / 1e6:7.1f} TFLOP/s{extra}"
              + "".join(f"  best {p} {row[f'best_{p}_config']}" for p in paths if row.get(f"best_{p}_config")),
              flush=True)
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------ decode

def active_weight_bytes(cfg, dtype_bytes: int = 2) -> tuple[int, int]:
    """(bytes one batch-1 decode step must read: non-expert weights, k of E experts per MoE layer, one embedding row;
    all weight bytes) from the config alone (the same number for both engines)."""
    from pagedllm.models.llama import get_head_dim
    from pagedllm.models.qwen3_moe import is_sparse_layer, num_experts

    h = cfg.hidden_size
    hd = get_head_dim(cfg)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    attn = h * hd * (2 * heads + 2 * kv_heads) + 2 * h
    mixtral = cfg.architectures[0] == "MixtralForCausalLM"
    active = total = 0
    for i in range(cfg.num_hidden_layers):
        active += attn
        total += attn
        sparse = mixtral or is_sparse_layer(cfg, i)
        if not sparse:
            active += 3 * h * cfg.intermediate_size
            total += 3 * h * cfg.intermediate_size
            continue
        e = cfg.num_local_experts if mixtral else num_experts(cfg)
        inter = cfg.intermediate_size if mixtral else cfg.moe_intermediate_size
        shared = 3 * h * (getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
        active += e * h + cfg.num_experts_per_tok * 3 * h * inter + shared
        total += e * h + e * 3 * h * inter + shared
    head = cfg.vocab_size * h
    active += head + h + h
    total += head * (1 if cfg.tie_word_embeddings else 2) + h
    return active * dtype_bytes, total * dtype_bytes


def _engine(args, max_num_seqs: int, max_len: int):
    """(generate(prompts, [(max_tokens, temperature)]) -> output token count, version, shutdown) for --engine."""
    if args.engine == "vllm":
        import vllm
        llm = vllm.LLM(model=args.model, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
                       max_model_len=max_len, max_num_seqs=max_num_seqs, seed=0)

        def generate(prompts, wants) -> int:
            params = [vllm.SamplingParams(temperature=t, max_tokens=n, ignore_eos=True, detokenize=False)
                      for n, t in wants]
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outs)
        return generate, f"vllm {vllm.__version__}", llm.reset_prefix_cache, lambda: None
    from pagedllm import LLM, SamplingParams
    llm = LLM(model=args.model, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
              max_model_len=max_len, max_num_seqs=max_num_seqs, seed=0, enforce_eager=args.enforce_eager)

    def generate(prompts, wants) -> int:
        params = [SamplingParams(temperature=t, max_tokens=n, ignore_eos=True) for n, t in wants]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return sum(len(o.outputs[0].token_ids) for o in outs)
    return generate, "pagedllm", llm.engine.reset_prefix_cache, llm.shutdown


def _decode_row(args, cfg, generate, version) -> dict:
    rng = random.Random(0)
    prompt = [rng.randrange(10, min(cfg.vocab_size, 32000)) for _ in range(args.input_len)]
    short, long = 32, 32 + args.output_len

    def timed(n: int) -> float:
        t = time.perf_counter()
        generate([prompt], [(n, 0.0)])
        return time.perf_counter() - t
    timed(short)  # warm-up (compiles, graphs, the prompt in the prefix cache for every timed run alike)
    t_short = min(timed(short) for _ in range(args.iters))
    t_long = min(timed(long) for _ in range(args.iters))
    ms_per_step = (t_long - t_short) / args.output_len * 1e3
    active, total = active_weight_bytes(cfg)
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (
        getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads) * 2
    kv = kv_per_token * (args.input_len + 32 + args.output_len / 2)
    bound_ms = (active + kv) / HBM_BYTES_PER_S * 1e3
    print(f"{version}: batch-1 decode {ms_per_step:.3f} ms/step; active-weight memory-bound {bound_ms:.3f} ms "
          f"({active / 1e9:.2f} GB of {total / 1e9:.1f} GB weights + {kv / 1e9:.3f} GB KV at "
          f"{HBM_BYTES_PER_S / 1e12:.1f} TB/s) -> {ms_per_step / bound_ms:.2f}x the bound", flush=True)
    return {"engine": version, "model": args.model, "decode_ms_per_step": ms_per_step, "bound_ms": bound_ms,
            "ratio_to_bound": ms_per_step / bound_ms, "active_weight_gb": active / 1e9,
            "all_weight_gb": total / 1e9}


def run_decode(args) -> dict:
    from pagedllm.models.loader import load_hf_config

    cfg = load_hf_config(args.model)
    generate, version, _, shutdown = _engine(args, 8, args.input_len + 32 + args.output_len + 16)
    result = _decode_row(args, cfg, generate, version)
    shutdown()
    return result


def run_rows(args) -> dict:
    """The decode row, then 512 x 512/256 (offline_throughput.py's requests) from the same engine."""
    sys.path.insert(0, HERE)
    from offline_throughput import make_requests
    from pagedllm.models.loader import load_hf_config

    cfg = load_hf_config(args.model)
    max_len = max(512 + 256, args.input_len + 32 + args.output_len) + 16
    t0 = time.perf_counter()
    generate, version, reset_prefix_cache, shutdown = _engine(args, args.max_num_seqs, max_len)
    startup = time.perf_counter() - t0
    result = _decode_row(args, cfg, generate, version)
    special = [t for t in (cfg.bos_token_id, cfg.eos_token_id) if isinstance(t, int)]
    reqs = make_requests(args.num_prompts, (512, 512), (256, 256), min(cfg.vocab_size, 32000), 0, special)
    generate([ids for ids, _ in reqs[:2]], [(4, args.temperature)] * 2)  # warm the sampling path
    reset_prefix_cache()  # no prefix hits from the decode row or the warm-up
    t = time.perf_counter()
    n_out = generate([ids for ids, _ in reqs], [(n, args.temperature) for _, n in reqs])
    elapsed = time.perf_counter() - t
    assert n_out == sum(n for _, n in reqs), f"{version} produced {n_out} tokens, not the {sum(n for _, n in reqs)} asked"
    result.update(throughput_tok_s=n_out / elapsed, throughput_elapsed_s=elapsed, output_tokens=n_out,
                  startup_s=startup, temperature=args.temperature, num_prompts=args.num_prompts)
    print(f"{version}: {args.num_prompts} x 512 in / 256 out at temperature {args.temperature}: {n_out} tokens in "
          f"{elapsed:.2f} s = {n_out / elapsed:.1f} tok/s (start-up {startup:.1f} s)", flush=True)
    shutdown()
    return result


def run_throughput(args) -> None:
    sys.path.insert(0, HERE)
    import offline_throughput

    argv = ["--model", args.model, "--load-format", "dummy", "--dtype", "bfloat16", "--num-prompts", "512",
            "--input-len", "512", "512", "--output-len", "256", "256", "--max-num-seqs", str(args.max_num_seqs),
            "--hf", "none", "--no-tqdm", "--engine", args.engine]
    if args.json:
        argv += ["--json", args.json]
    offline_throughput.main(argv)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("kernel")
    k.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    k.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    k.add_argument("--iters", type=int, default=50)
    k.add_argument("--sweep", nargs="?", const="small", choices=["small", "wide"], default=None,
                   help="also try grouped tile configs (slow: one capture each); wide: the large prefill tiles")
    k.add_argument("--peer", choices=["none", "vllm"], default="none")
    k.add_argument("--torch-grouped", action="store_true",
                   help="also time the experts through torch._grouped_mm (path 'torch')")
    d, t, r = sub.add_parser("decode"), sub.add_parser("throughput"), sub.add_parser("rows")
    for sp in (d, t, r):
        sp.add_argument("--model", default=os.path.join(HERE, "configs", "qwen3-30b-a3b"))
        sp.add_argument("--engine", choices=["pagedllm", "vllm"], default="pagedllm")
    for sp in (d, r):
        sp.add_argument("--input-len", type=int, default=128)
        sp.add_argument("--output-len", type=int, default=256)
        sp.add_argument("--iters", type=int, default=3)
        sp.add_argument("--enforce-eager", action="store_true")
    for sp in (t, r):
        sp.add_argument("--max-num-seqs", type=int, default=512)
    r.add_argument("--num-prompts", type=int, default=512)
    r.add_argument("--temperature", type=float, default=0.6)
    for sp in (k, d, t, r):
        sp.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.cmd == "throughput":
        run_throughput(args)
        return
    result = {"kernel": run_kernel, "decode": run_decode, "rows": run_rows}[args.cmd](args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "args": vars(args), "result": result}, f, indent=2)


if __name__ == "__main__":
    main()
