"""Randomized differential tests of the scheduler's features through the real engine core: the same requests
(shared prefixes, repeats, block-multiple and sub-block prompts, mixed max_tokens and stops, penalties, logprobs,
requests arriving while others run, aborts mid-way) give the same tokens with prefix caching, chunked prefill,
preemption (a tiny KV cache), async scheduling, max_num_seqs, priorities and n-gram speculation on or off.
Greedy and seeded rows must match token for token; afterwards every KV block is free and nothing runs."""
from __future__ import annotations

import random

import pytest

from pagedllm import SamplingParams
from pagedllm.core.engine_core import EngineCore, EngineCoreRequest

BLOCK = 8
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def workload(seed: int) -> list[dict]:
    rng = random.Random(seed)
    shared = [rng.randrange(2, 512) for _ in range(rng.choice([5, 8, 16, 24]))]
    reqs: list[dict] = []
    for i in range(rng.randint(4, 8)):
        kind = rng.random()
        if kind < 0.3:  # a shared prefix, maybe exactly a block multiple
            prompt = shared + [rng.randrange(2, 512) for _ in range(rng.choice([0, 1, 3, 8]))]
        elif kind < 0.45 and reqs:
            prompt = list(rng.choice(reqs)["prompt"])  # an exact repeat
        elif kind < 0.6:
            prompt = [rng.randrange(2, 512) for _ in range(rng.choice([1, 2, 7, 8, 16]))]
        else:
            prompt = [rng.randrange(2, 512) for _ in range(rng.randint(1, 40))]
        sp: dict = dict(temperature=0.0 if rng.random() < 0.6 else 0.9, max_tokens=rng.randint(1, 20),
                        ignore_eos=rng.random() < 0.7)
        if sp["temperature"]:
            sp["seed"] = rng.randrange(1000)
        x = rng.random()
        if x < 0.15:
            sp.update(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3)
        elif x < 0.3:
            sp.update(min_tokens=min(sp["max_tokens"], 3), ignore_eos=False)
        elif x < 0.4:
            sp["logprobs"] = 2
        if rng.random() < 0.2:
            sp["stop_token_ids"] = [rng.randrange(2, 512) for _ in range(30)]
        reqs.append(dict(id=f"r{i}", prompt=prompt, sp=sp, priority=rng.randint(-2, 2),
                         arrive=rng.choice([0, 0, 0, 1, 2, 5]),
                         abort=rng.randint(1, 6) if rng.random() < 0.15 else None))
    return reqs


def drive(model: str, reqs: list[dict], order_seed: int, **kw) -> dict:
    """Step an engine core by hand: requests arrive at their step, some are aborted at theirs. Returns
    {id: (tokens, finish_reason, rounded logprobs)} after checking that nothing is left behind."""
    core = EngineCore(model=model, dtype="float32", max_model_len=72, block_size=BLOCK, **kw)
    reqs = list(reqs)
    random.Random(order_seed).shuffle(reqs)  # arrival order within a step is part of what may not matter
    got: dict = {r["id"]: ([], None, []) for r in reqs}
    pending, step = list(reqs), 0
    try:
        while pending or core.has_unfinished_requests():
            for r in [r for r in pending if r["arrive"] <= step]:
                prio = r["priority"] if kw.get("scheduling_policy") == "priority" else 0
                core.add_request(EngineCoreRequest(r["id"], list(r["prompt"]), SamplingParams(**r["sp"]),
                                                   priority=prio))
                pending.remove(r)
            core.abort_requests([r["id"] for r in reqs if r["abort"] == step and r not in pending])
            for out in core.step():
                tokens, reason, lps = got[out.request_id]
                assert reason is None, f"{out.request_id}: output after it finished"
                tokens += out.new_token_ids
                lps += [[round(v, 3) for v in t.logprobs] for t in out.new_logprobs or ()]
                got[out.request_id] = (tokens, out.finish_reason, lps)
            step += 1
            assert step < 1000, "the engine does not finish its requests"
        kv = core.scheduler.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks, "KV blocks leaked"
        assert (core.scheduler.num_running, core.scheduler.num_waiting) == (0, 0)
    finally:
        core.shutdown()
    return got


CONFIGS = [
    dict(enable_prefix_caching=False),
    dict(enable_chunked_prefill=False, num_gpu_blocks_override=9),
    dict(max_num_batched_tokens=8, max_num_seqs=8, num_gpu_blocks_override=12),
    dict(async_scheduling=True, num_gpu_blocks_override=10, max_num_batched_tokens=9, max_num_seqs=4),
    dict(max_num_seqs=1, async_scheduling=True),
    dict(scheduling_policy="priority", num_gpu_blocks_override=9, max_num_seqs=3),
    dict(speculative_config=NGRAM),
    dict(speculative_config=NGRAM, num_gpu_blocks_override=11, async_scheduling=True, max_num_batched_tokens=12,
         max_num_seqs=8),
    dict(speculative_config=NGRAM, scheduling_policy="priority", num_gpu_blocks_override=9,
         enable_chunked_prefill=False),
]


@pytest.mark.parametrize("seed", [0, 1])
def test_scheduling_features_do_not_change_outputs(tiny_llama_dir, seed):
    reqs = workload(seed)
    ref = drive(tiny_llama_dir, reqs, 0)
    aborted = {r["id"] for r in reqs if r["abort"] is not None}
    for i, kw in enumerate(CONFIGS):
        # Seeded rows too: a verify step draws each row as a plain step would and accepts the drafts that match.
        got = drive(tiny_llama_dir, reqs, i + 1, **kw)
        for r in reqs:
            rid, (tokens, reason, lps) = r["id"], got[r["id"]]
            ref_tokens, ref_reason, ref_lps = ref[rid]
            if rid in aborted:  # stopped at another point: what it produced agrees
                n = min(len(tokens), len(ref_tokens))
                assert tokens[:n] == ref_tokens[:n], (kw, rid)
                continue
            assert (tokens, reason) == (ref_tokens, ref_reason), (kw, rid, r["sp"])
            assert len(lps) == len(ref_lps) and all(
                abs(a - b) < 2e-3 for x, y in zip(lps, ref_lps) for a, b in zip(x, y)), (kw, rid)


def test_abort_lists_an_id_twice(tiny_llama_dir):
    """An id given twice in one abort (or a running and a waiting request each twice) finishes each once: no
    KeyError, the other requests go on and every block comes back."""
    core = EngineCore(model=tiny_llama_dir, dtype="float32", max_model_len=72, block_size=BLOCK,
                      num_gpu_blocks_override=9)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        for rid, prompt in (("a", list(range(2, 30))), ("b", list(range(40, 70))), ("c", [5, 6, 7])):
            core.add_request(EngineCoreRequest(rid, prompt, sp))
        outs = core.step()
        core.abort_requests(["a", "b", "a", "b", "nope"])
        assert core.scheduler.num_aborted == 2
        while core.has_unfinished_requests():
            outs += core.step()
        assert sum(len(o.new_token_ids) for o in outs if o.request_id == "c") == 6
        kv = core.scheduler.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks
    finally:
        core.shutdown()


def _first_tokens(model: str, spec: bool, with_drafting_neighbour: bool) -> list[int]:
    """The one token of each of 8 seeded max_tokens=1 requests, added while (maybe) a greedy request whose
    repeating prompt makes the n-gram proposer draft is decoding."""
    core = EngineCore(model=model, dtype="float32", max_model_len=72, block_size=BLOCK,
                      **({"speculative_config": NGRAM} if spec else {}))
    try:
        if with_drafting_neighbour:
            # the bias makes it repeat one token: the proposer drafts at every step
            core.add_request(EngineCoreRequest("loop", [11, 12, 13, 14] * 6, SamplingParams(
                temperature=0.0, max_tokens=40, ignore_eos=True, logit_bias={170: 20.0})))
            for _ in range(3):
                core.step()
        got: dict[str, list[int]] = {}
        for i in range(8):
            core.add_request(EngineCoreRequest(f"s{i}", [100 + i, 7, 9, 300 - i],
                                               SamplingParams(temperature=1.0, seed=i, max_tokens=1)))
        while core.has_unfinished_requests():
            for out in core.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
        return [got[f"s{i}"][0] for i in range(8)]
    finally:
        core.shutdown()


def test_seeded_token_does_not_depend_on_neighbours_drafts(tiny_llama_dir):
    """A seeded request's token at a position without drafts of its own is the plain sampler's draw for that
    (seed, position), also in a step that verifies another request's drafts (it went through the rejection
    sampler there, which drew the acceptance number first and sampled with the generator's second draw)."""
    plain = _first_tokens(tiny_llama_dir, False, False)
    assert _first_tokens(tiny_llama_dir, True, False) == plain
    assert _first_tokens(tiny_llama_dir, True, True) == plain


def test_id_reused_while_its_aborted_step_is_in_flight(tiny_llama_dir):
    """Async scheduling: a request aborted while its step runs and re-added at once under the same id gets only
    its own tokens; the aborted one's token from the step in flight is not appended to it (it was, and counted
    towards its max_tokens)."""
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompt = list(range(2, 30))
    core = EngineCore(model=tiny_llama_dir, dtype="float32", max_model_len=72, block_size=BLOCK,
                      async_scheduling=True)
    try:
        core.add_request(EngineCoreRequest("ref", prompt, sp))
        ref: list[int] = []
        while core.has_unfinished_requests():
            ref += [t for o in core.step() for t in o.new_token_ids]
        core.add_request(EngineCoreRequest("c", prompt, sp))
        for _ in range(3):
            core.step()  # (its outputs are the first request's: not looked at)
        core.abort_requests(["c"])
        core.add_request(EngineCoreRequest("c", prompt, sp))
        got: list[int] = []
        while core.has_unfinished_requests():
            got += [t for o in core.step() for t in o.new_token_ids]
        assert got == ref
        kv = core.scheduler.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks
    finally:
        core.shutdown()
