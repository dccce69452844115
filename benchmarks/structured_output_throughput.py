"""Throughput with every request under a JSON schema vs the same requests unconstrained, one engine, one process,
interleaved repeats (a shared machine's drift hits both sides alike). Reports output tok/s and the ratio.

The schema (an array of >= 128 objects) is longer than any output, so constrained requests run to max_tokens just
like the unconstrained ones (ignore_eos): both sides generate the same number of tokens per request.

    python benchmarks/structured_output_throughput.py                      # CPU: SmolLM2, 32 prompts
    # GPU, the Qwen3-0.6B protocol (random weights; a synthetic byte-level tokenizer of the model's vocab size,
    # since there is no hub; 151,936 tokens, so mask sizes and tokenizer-trie sizes are real):
    python benchmarks/structured_output_throughput.py --model benchmarks/configs/qwen3-0.6b --load-format dummy \
        --synthetic-tokenizer --num-prompts 256 --input-len 100 1024 --output-len 256 256 --dtype bfloat16
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

SCHEMA = {"type": "array", "minItems": 128, "items": {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                   "name": {"type": "string", "maxLength": 16},
                   "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}},
    "required": ["id", "name", "tags"]}}


def synthetic_tokenizer(vocab_size: int, seed: int = 0) -> str:
    """A byte-level BPE tokenizer dir of exactly vocab_size tokens (the 256 byte symbols, then random 2-8 symbol
    tokens), with <|endoftext|> as the last id. Enough for grammar compilation and masks of real size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    rng = random.Random(seed)
    common = sorted(alphabet)
    vocab = {s: i for i, s in enumerate(common)}
    letters = [c for c in common if c.isalnum()] + list('{}[]":,Ġ')
    while len(vocab) < vocab_size - 1:
        tok = "".join(rng.choice(letters) for _ in range(rng.randint(2, 8)))
        vocab.setdefault(tok, len(vocab))
    vocab["<|endoftext|>"] = vocab_size - 1
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    out = tempfile.mkdtemp(prefix="pagedllm-synth-tok-")
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>").save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--synthetic-tokenizer", action="store_true", help="build a tokenizer of the model's vocab size")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, nargs=2, default=[16, 160])
    ap.add_argument("--output-len", type=int, nargs=2, default=[96, 96])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch

    from pagedllm import LLM, SamplingParams

    torch_cuda_sync = torch.cuda.synchronize if torch.cuda.is_available() else None
    from pagedllm.structured_output import StructuredOutputsParams

    tokenizer = args.tokenizer
    if args.synthetic_tokenizer:
        with open(os.path.join(args.model, "config.json")) as f:
            tokenizer = synthetic_tokenizer(json.load(f)["vocab_size"], args.seed)
    # No prefix caching: every run prefills its prompts, whichever side runs first.
    kwargs = dict(dtype=args.dtype, load_format=args.load_format, max_num_seqs=args.max_num_seqs, seed=args.seed,
                  structured_outputs_config={"backend": args.backend}, enable_prefix_caching=False)
    if tokenizer:
        kwargs["tokenizer"] = tokenizer
    llm = LLM(args.model, **kwargs)
    vocab = llm.engine.vocab_size
    rng = random.Random(args.seed)
    prompts, lens = [], []
    for _ in range(args.num_prompts):
        prompts.append({"prompt_token_ids": [rng.randrange(min(vocab, 30000)) for _ in range(rng.randint(*args.input_len))]})
        lens.append(rng.randint(*args.output_len))
    so = StructuredOutputsParams(json=SCHEMA)
    free = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
    constrained = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, structured_outputs=so) for n in lens]
    llm.generate(prompts[:4], constrained[:4], use_tqdm=False)  # warm-up: compile the grammar, load the library
    llm.generate(prompts[:4], free[:4], use_tqdm=False)
    results: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
    cpu_results: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
    for rep in range(args.repeats):
        order = (("unconstrained", free), ("json_schema", constrained))
        for name, params in (order if rep % 2 == 0 else order[::-1]):
            t0, c0 = time.perf_counter(), time.process_time()
            outs = llm.generate(prompts, params, use_tqdm=False)
            if torch_cuda_sync is not None:
                torch_cuda_sync()
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            results[name].append(n / dt)
            cpu_results[name].append(n / cpu)
            print(f"rep {rep} {name:13s} {n} tokens in {dt:6.2f} s = {n / dt:9.1f} tok/s "
                  f"({cpu:6.2f} s of process CPU time = {n / cpu:8.1f} tok per CPU-s)", flush=True)
        if rep == 0:  # the constrained outputs are JSON prefixes of the schema's array
            text = outs[0].outputs[0].text
            assert text.lstrip().startswith("["), text[:80]
    ratios = [c / u for c, u in zip(results["json_schema"], results["unconstrained"])]
    best = max(results["json_schema"]) / max(results["unconstrained"])
    cpu_best = max(cpu_results["json_schema"]) / max(cpu_results["unconstrained"])
    print(f"json_schema / unconstrained throughput per repeat: {', '.join(f'{r:.3f}' for r in ratios)}; "
          f"best run vs best run: {best:.3f} (the least disturbed run of each side); per CPU-second (a loaded "
          f"machine's wall clock counts other processes' time): best {cpu_best:.3f}")


if __name__ == "__main__":
    main()
