"""The runner's persistent sampling arrays (worker/sampling_batch.py) give the same SamplingMetadata as the
reference builder (SamplingMetadata.build) for every mix of rows they take, and refuse rows that need it."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pagedllm.layers.sampler import Sampler, SamplingMetadata
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.sampling_batch import SamplingBatch, fast_metadata

VOCAB = 300


def _random_params(rng: random.Random) -> SamplingParams:
    kind = rng.random()
    kw = {}
    if kind < 0.3:
        kw["temperature"] = 0.0
    else:
        kw["temperature"] = rng.choice([0.6, 1.0, 1.7, 1e-6])
    if rng.random() < 0.4:
        kw["top_p"] = rng.choice([0.5, 0.9, 1.0])
    if rng.random() < 0.4:
        kw["top_k"] = rng.choice([0, -1, 1, 5, VOCAB - 1, VOCAB, VOCAB + 10])
    if rng.random() < 0.3:
        kw["min_p"] = rng.choice([0.0, 0.05, 0.2])
    if rng.random() < 0.3:
        kw["logprobs"] = rng.choice([0, 1, 3])
    return SamplingParams(max_tokens=8, **kw)


def _fields(meta: SamplingMetadata) -> dict:
    out = {}
    for name, value in vars(meta).items():
        out[name] = value.tolist() if isinstance(value, torch.Tensor) else value
    return out


@pytest.mark.parametrize("seed", range(12))
def test_fast_metadata_equals_builder(seed):
    rng = random.Random(seed)
    batch = SamplingBatch(16, VOCAB)
    params = [_random_params(rng) for _ in range(16)]
    for row, p in enumerate(params):
        batch.set_row(row, p)
    for trial in range(6):
        rows = np.array(rng.sample(range(16), rng.randint(1, 16)), dtype=np.int64)
        step = batch.gather(rows)
        assert step is not None
        floats = None if step.floats is None else torch.from_numpy(step.floats)
        top_k = None if step.top_k is None else torch.from_numpy(step.top_k)
        fast = fast_metadata(step, len(rows), VOCAB, floats, top_k)
        picked = [params[r] for r in rows]
        ref = SamplingMetadata.build(params=picked, prompt_token_ids=[[1, 2]] * len(rows),
                                     output_token_ids=[[3]] * len(rows), eos_token_ids=[0] * len(rows),
                                     vocab_size=VOCAB, device="cpu")
        assert _fields(fast) == _fields(ref)
        logits = torch.randn(len(rows), VOCAB)
        torch.manual_seed(trial)
        a = Sampler()(logits.clone(), fast)
        torch.manual_seed(trial)
        b = Sampler()(logits.clone(), ref)
        assert a.sampled_token_ids.tolist() == b.sampled_token_ids.tolist()


@pytest.mark.parametrize("general", [dict(seed=3), dict(min_tokens=2), dict(presence_penalty=0.5),
                                     dict(frequency_penalty=-0.1), dict(repetition_penalty=1.2),
                                     dict(logit_bias={5: 1.0}), dict(allowed_token_ids=[1, 2]),
                                     dict(bad_words_token_ids=[[4]])])
def test_rows_needing_the_builder_are_refused(general):
    batch = SamplingBatch(4, VOCAB)
    batch.set_row(0, SamplingParams(temperature=0.7))
    batch.set_row(1, SamplingParams(temperature=0.7, max_tokens=8, **general))
    assert batch.gather(np.array([0])) is not None
    assert batch.gather(np.array([0, 1])) is None
    batch.set_row(1, SamplingParams())  # the row is reused by a plain request
    assert batch.gather(np.array([0, 1])) is not None


def test_engine_tokens_do_not_depend_on_how_parameters_reach_the_device(tiny_qwen3_dir):
    """The runner's staged parameters (the CPU path) and the builder-style copies (the CUDA path) give the same
    tokens; so does a batch that needs the general builder."""
    from pagedllm import LLM

    prompts = [{"prompt_token_ids": [5 + i, 9, 17, 3 + i]} for i in range(6)]
    params = [SamplingParams(temperature=t, top_p=p, top_k=k, max_tokens=12, ignore_eos=True)
              for t, p, k in ((0.8, 1.0, 0), (0.6, 0.9, 0), (0.0, 1.0, 0), (1.2, 0.95, 20), (0.7, 1.0, 5),
                              (0.9, 0.8, 40))]
    results = []
    for stage in (True, False):
        llm = LLM(model=tiny_qwen3_dir, max_model_len=64, seed=0, kv_cache_memory_bytes=8 << 20)
        llm.engine.worker.runner.stage_sampling = stage
        results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.engine.shutdown()
    assert results[0] == results[1]
    assert len(set(map(tuple, results[0]))) > 1


def _full_gather(batch: SamplingBatch, rows: np.ndarray):
    """gather() without its all-greedy shortcut (the arrays read row by row)."""
    saved, batch.num_special = batch.num_special, 1 << 30
    try:
        return batch.gather(rows)
    finally:
        batch.num_special = saved


@pytest.mark.parametrize("seed", range(6))
def test_greedy_shortcut_follows_the_rows_held(seed):
    """gather()'s shortcut for a batch of plain greedy rows is taken exactly while no row held is special (sampled,
    logprobs, the general builder's), through rows set, replaced and cleared in any order, and gives what the full
    gather gives; the prompt-logprobs count follows the rows the same way."""
    rng = random.Random(seed)
    batch = SamplingBatch(8, VOCAB)
    held: dict[int, SamplingParams] = {}
    for _ in range(60):
        row = rng.randrange(8)
        if row in held and rng.random() < 0.4:
            batch.clear_row(row)
            del held[row]
        else:
            p = _random_params(rng) if rng.random() < 0.5 else SamplingParams(temperature=0.0, max_tokens=4)
            if rng.random() < 0.2:
                p = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2)
            if rng.random() < 0.1:
                p = SamplingParams(temperature=0.0, max_tokens=4, seed=3)  # a general row
            batch.set_row(row, p)
            held[row] = p
        special = sum(1 for p in held.values() if p.temperature >= 1e-5 or p.logprobs is not None or p.seed is not None)
        assert batch.num_special == special
        assert batch.num_prompt_logprobs == sum(p.prompt_logprobs is not None for p in held.values())
        if held:
            rows = np.array(sorted(held), dtype=np.int64)
            got, want = batch.gather(rows), _full_gather(batch, rows)
            assert (got is None) == (want is None)
            if got is not None:
                assert vars(got).keys() == vars(want).keys()
                for key, value in vars(want).items():
                    other = vars(got)[key]
                    assert (np.array_equal(value, other) if isinstance(value, np.ndarray) else value == other), key
