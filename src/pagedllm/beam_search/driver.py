"""Drive BeamSearch objects with the engine: every step, one max_tokens=1 request per live beam (prompt + beam
tokens as its prompt; the prefix cache gives back the shared full blocks) asking for the top-k logprobs."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from pagedllm.beam_search.search import BeamSearch, check_logprobs_mode
from pagedllm.outputs import Logprob
from pagedllm.sampling_params import SamplingParams


def step_params(num_logprobs: int, lora: Any = None) -> SamplingParams:
    """The request of one beam step: greedy, one token, the raw top-num_logprobs (may exceed the user limit of
    20 for wide beams: set after validation)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False, logprobs=0)
    params.logprobs = num_logprobs
    return params


def candidates(logprobs: Optional[dict[int, Logprob]], k: int) -> list[tuple[int, float, Logprob]]:
    """The k best (token, logprob, Logprob) of one position's logprob dict, best first (ties: lower rank)."""
    if not logprobs:
        return []
    items = sorted(logprobs.items(), key=lambda kv: (-kv[1].logprob, kv[1].rank or 0, kv[0]))
    return [(t, lp.logprob, lp) for t, lp in items[:k]]


def run_offline(llm, prompts: list, params, use_tqdm: bool = False, lora_ids: Optional[list] = None) -> list:
    """LLM.beam_search: every prompt's search advances one token per round of engine steps; lora_ids: each
    prompt's registered adapter id (or None), which all its beams' steps run with."""
    lora_ids = lora_ids or [None] * len(prompts)
    check_logprobs_mode(llm.engine_args.logprobs_mode)
    searches, salts = [], []
    max_model_len = llm.engine.max_model_len
    for prompt in prompts:
        salts.append(llm._cache_salt(prompt))
        _, ids = llm._to_prompt(prompt)
        room = max_model_len - len(ids)
        if room <= 0:
            raise ValueError(f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                             f"has {len(ids)} tokens, which leaves no room for any output. Please shorten the prompt.")
        # (as generate(): a beam grows to the context's end at most, not past it in the middle of the search)
        searches.append(BeamSearch(ids, dataclasses.replace(params, max_tokens=min(params.max_tokens, room)),
                                   llm.engine.eos_token_ids, llm.engine.vocab_size))
        searches[-1].check_logprob_limit(llm.engine_args.max_logprobs)
    bar = None
    if use_tqdm:
        from tqdm.auto import tqdm

        bar = tqdm(total=params.max_tokens, desc="Beam search", dynamic_ncols=True)
    while True:
        items, owners, item_salts, item_loras = [], [], [], []
        for s, salt, lora_id in zip(searches, salts, lora_ids):
            for beam, seq in s.pending():
                items.append(((None, seq), step_params(s.num_logprobs)))
                owners.append((s, beam))
                item_salts.append(salt)
                item_loras.append(lora_id)
        if not items:
            break
        outs = llm._run(items, use_tqdm=False, lora_ids=item_loras, salts=item_salts)
        if any(o.outputs[0].finish_reason == "error" for o in outs):  # a beam without its step cannot be ranked
            raise RuntimeError("Beam search: the engine failed a beam's step (the warning logged says why).")
        _advance_all(searches, owners, [o.outputs[0].logprobs[0] if o.outputs[0].logprobs else None for o in outs])
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    decode = None if llm.tokenizer is None else (lambda ids: llm.tokenizer.decode(ids, skip_special_tokens=True))
    results = [s.result(decode) for s in searches]
    if llm.tokenizer is not None:
        name_logprobs(results, llm.tokenizer)
    return results


def name_logprobs(results: list, tokenizer) -> None:
    """Each returned beam's Logprobs get their token's text (decoded_token), as generate()'s logprobs and vLLM's
    beams have it; the steps themselves skip detokenizing, so only the tokens returned are decoded (once each)."""
    entries = [lp for out in results for seq in out.sequences for d in seq.logprobs for lp in d.items()]
    missing = list(dict.fromkeys(t for t, lp in entries if lp.decoded_token is None))
    texts = dict(zip(missing, tokenizer.batch_decode([[t] for t in missing]))) if missing else {}
    for t, lp in entries:
        if lp.decoded_token is None:
            lp.decoded_token = texts[t]


def _advance_all(searches, owners, logprob_dicts) -> None:
    per_search: dict[int, tuple[dict, dict]] = {}
    for (s, beam), lp in zip(owners, logprob_dicts):
        top, record = per_search.setdefault(id(s), ({}, {}))
        top[beam] = candidates(lp, s.num_logprobs)
        record[beam] = dict(lp or {})
    for s in searches:
        if id(s) in per_search:
            top, record = per_search[id(s)]
            s.advance(top, record)


class ClientDisconnected(Exception):
    """The server's client left during a beam search: the search stopped (nothing to answer)."""


async def run_async(generate: Callable, prompt_ids: list[int], params, eos_token_ids: list[int],
                    decode: Optional[Callable] = None, disconnected: Optional[Callable] = None,
                    max_logprobs: int = -1, vocab_size: Optional[int] = None):
    """The server's beam search over AsyncEngine: generate(prompt_ids, sampling_params) -> final RequestOutput
    (awaitable). Beams of one step run concurrently, in the same batches as every other request. `disconnected`
    (awaitable -> bool) is asked between steps: a client that left stops the search."""
    import asyncio

    search = BeamSearch(prompt_ids, params, eos_token_ids, vocab_size)
    search.check_logprob_limit(max_logprobs)
    while True:
        pending = search.pending()
        if not pending:
            break
        if disconnected is not None and await disconnected():
            raise ClientDisconnected("the client disconnected")
        outs = await asyncio.gather(*(generate(seq, step_params(search.num_logprobs)) for _, seq in pending))
        _advance_all([search], [(search, beam) for beam, _ in pending],
                     [o.outputs[0].logprobs[0] if o.outputs[0].logprobs else None for o in outs])
    return search.result(decode)
