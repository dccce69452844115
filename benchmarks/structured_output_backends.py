"""Grammar libraries head to head: compile time of a 50-field JSON schema and bitmask time per token at batch 1
and 256 (the per-step host cost structured outputs add), for xgrammar and llguidance, on one tokenizer.

    python benchmarks/structured_output_backends.py [--tokenizer DIR_OR_GGUF] [--fields 50] [--batch 1 256]

Each backend walks the token ids of one valid instance of the schema; at every position it fills the bitmask of
all `batch` matchers (each its own matcher, as in serving), then advances them. Reported: compile ms (cold, no
cache), first-mask ms, mean mask ms per step for the whole batch and per request. Both backends run in the same
process, interleaved per repeat (the machine is shared).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))


def schema_of(num_fields: int) -> dict:
    kinds = [{"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"},
             {"type": "array", "items": {"type": "string"}}, {"enum": ["red", "green", "blue"]}]
    props = {f"field_{i}": kinds[i % len(kinds)] for i in range(num_fields)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def instance_of(num_fields: int) -> dict:
    values = ["some text", 42, 3.5, True, ["a", "b"], "green"]
    return {f"field_{i}": values[i % len(values)] for i in range(num_fields)}


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.vocab_size = vocab_size

    def compile(self, schema: dict):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    def matchers(self, compiled, n: int):
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def bitmask(self, n: int):
        return self.xgr.allocate_token_bitmask(n, self.vocab_size)

    def fill(self, matchers, bitmask) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            self.batch = getattr(self, "batch", None) or self.xgr.BatchGrammarMatcher(max_threads=2)
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    @staticmethod
    def accept(matchers, token: int) -> None:
        for m in matchers:
            assert m.accept_token(token)


class Guidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.llg = llguidance
        self.np = llguidance.numpy
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size
        self.executor = llguidance.LLExecutor(2)

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                              defaults={"whitespace_flexible": False})
        m = self.llg.LLMatcher(self.tok, grammar)  # lazy: the real work happens on the first masks
        assert not m.is_error(), m.get_error()
        return grammar

    def matchers(self, compiled, n: int):
        return [self.llg.LLMatcher(self.tok, compiled) for _ in range(n)]

    def bitmask(self, n: int):
        return self.np.allocate_token_bitmask(n, self.vocab_size)

    def fill(self, matchers, bitmask) -> None:
        if len(matchers) == 1:
            self.np.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            self.np.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    @staticmethod
    def accept(matchers, token: int) -> None:
        for m in matchers:
            assert m.consume_token(token), m.get_error()


def run(backend, schema: dict, token_ids: list[int], batch: int) -> dict:
    t0 = time.perf_counter()
    compiled = backend.compile(schema)
    compile_ms = (time.perf_counter() - t0) * 1e3
    matchers = backend.matchers(compiled, batch)
    bitmask = backend.bitmask(batch)
    times = []
    for token in token_ids:
        t0 = time.perf_counter()
        backend.fill(matchers, bitmask)
        times.append(time.perf_counter() - t0)
        backend.accept(matchers, token)
    steady = sorted(times[1:])[: max(1, len(times) - 1)]
    mean_ms = sum(steady) / len(steady) * 1e3
    return {"compile_ms": compile_ms, "first_mask_ms": times[0] * 1e3, "mask_ms_per_step": mean_ms,
            "mask_us_per_request_token": mean_ms * 1e3 / batch, "steps": len(token_ids)}


def main() -> None:
    from pagedllm.models.loader import default_model_path
    from pagedllm.tokenizer import get_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default=None, help="tokenizer dir or .gguf (default: SmolLM2's)")
    ap.add_argument("--vocab-size", type=int, default=None, help="model vocab (default: the tokenizer's)")
    ap.add_argument("--fields", type=int, default=50)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--backends", nargs="+", default=["xgrammar", "llguidance"])
    args = ap.parse_args()
    tokenizer = get_tokenizer(args.tokenizer or default_model_path())
    vocab_size = args.vocab_size or len(tokenizer)
    schema = schema_of(args.fields)
    text = json.dumps(instance_of(args.fields), separators=(",", ":"))
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    eos = tokenizer.eos_token_id
    token_ids = token_ids + ([eos] if eos is not None else [])
    classes = {"xgrammar": XGrammar, "llguidance": Guidance}
    backends = [classes[name](tokenizer, vocab_size) for name in args.backends]
    print(f"tokenizer vocab {vocab_size}, schema {args.fields} fields, instance {len(token_ids)} tokens")
    for batch in args.batch:
        for rep in range(args.repeats):
            for b in backends:
                r = run(b, schema, token_ids, batch)
                print(f"batch {batch:4d} rep {rep} {b.name:10s} compile {r['compile_ms']:8.1f} ms  first mask "
                      f"{r['first_mask_ms']:7.2f} ms  mask/step {r['mask_ms_per_step']:7.3f} ms  "
                      f"= {r['mask_us_per_request_token']:7.1f} us per request-token", flush=True)


if __name__ == "__main__":
    main()
