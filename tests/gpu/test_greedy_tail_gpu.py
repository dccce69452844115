"""Greedy tails on CUDA (worker/greedy_tail.py): the LM head + argmax of all-greedy decode steps and batch-1 verify
steps replayed as graphs give the tokens of the eager LM head (PAGEDLLM_GRAPH_GREEDY=0), token for token, while
batches shrink (padding rows), beside sampled and grammar-masked requests (the eager paths), and with async
scheduling reading each step's ids from the shared buffer before the next replay rewrites it."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.engine.test_correctness import random_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
COMMON = dict(device="cuda", num_gpu_blocks_override=256, max_num_seqs=8)


def _engines(model_dir, monkeypatch, **kwargs):
    """(an engine with greedy tails, one without)."""
    monkeypatch.setenv("PAGEDLLM_GRAPH_GREEDY", "1")
    on = LLM(model_dir, **COMMON, **kwargs)
    monkeypatch.setenv("PAGEDLLM_GRAPH_GREEDY", "0")
    off = LLM(model_dir, **COMMON, **kwargs)
    return on, off


def _tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_tails_equal_the_eager_lm_head(tiny_llama_dir, monkeypatch, dtype):
    on, off = _engines(tiny_llama_dir, monkeypatch, dtype=dtype)
    graphs = on.engine.worker.runner.cuda_graphs
    assert graphs.tails.graphs and not off.engine.worker.runner.cuda_graphs.tails.graphs
    assert {key[0] for key in graphs.tails.graphs} == {s for s in graphs.sizes if s <= graphs.tails.max_rows}
    prompts = [{"prompt_token_ids": p} for p in random_prompts([3, 30, 11, 50, 7, 1, 19, 2, 44], seed=21)]
    # Different lengths: the batch shrinks through 8, 7, ... 1 rows (tails of padded sizes).
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 5 * i, ignore_eos=True) for i in range(len(prompts))]
    before = graphs.tails.num_replays
    assert _tokens(on, prompts, params) == _tokens(off, prompts, params)
    assert graphs.tails.num_replays - before >= 40  # the longest request (46 tokens): a decode step per token, a few mixed
    one = prompts[:1], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    assert _tokens(on, *one) == _tokens(off, *one)


def test_tails_beside_sampled_and_masked_requests(tiny_llama_dir, monkeypatch):
    """A step with a sampled row takes the sampler; a grammar mask takes the eager masked argmax: greedy rows of
    those steps, and the steps of greedy rows alone once the others finish, give the same tokens either way."""
    from pagedllm.structured_output import StructuredOutputsParams

    on, off = _engines(tiny_llama_dir, monkeypatch, dtype="bfloat16")
    prompts = ["a", "b", "c", "d"]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, max_tokens=10, seed=5, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputsParams(
                  choice=["alpha", "beta"])),
              SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)]
    tails = on.engine.worker.runner.cuda_graphs.tails
    before = tails.num_replays
    assert _tokens(on, prompts, params) == _tokens(off, prompts, params)
    assert tails.num_replays > before


def test_verify_tails_with_ngram_equal_plain(tiny_llama_dir, monkeypatch):
    """Batch-1 verify steps (all their tokens sampled) replay the mixed graph's tail; fp32 n-gram output equals the
    plain engine's without tails, token for token."""
    on, off = _engines(tiny_llama_dir, monkeypatch, dtype="float32", speculative_config=NGRAM)
    base = random_prompts([24], seed=3)[0]
    prompts = [{"prompt_token_ids": p} for p in (base * 3, base[:10] * 4, random_prompts([40], seed=4)[0])]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    mixed = on.engine.worker.runner.mixed_graphs
    assert mixed.tails.graphs and all(key[0] in mixed.tail_sizes for key in mixed.tails.graphs)
    want = _tokens(off, prompts, params)
    for p, w in zip(prompts, want):  # one at a time: every verify step's rows are all its tokens
        before = mixed.tails.num_replays
        assert _tokens(on, [p], params) == [w]
        assert mixed.tails.num_replays > before or p is prompts[2]  # (the random prompt may draft nothing)
    assert on.engine.scheduler.spec_stats.num_accepted_tokens > 0
