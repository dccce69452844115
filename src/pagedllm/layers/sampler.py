"""Sampler: logits -> next token ids (+ logprobs), a pure tensor function vectorized over the batch.

Order of operations (vLLM's):
  1. logprobs of the *raw* logits (log_softmax before any processing), only if someone asked; the engine's
     logprobs_mode (vLLM's) may ask for the raw logits themselves, or for the values after step 5 instead
     (`processed_values`: what a row draws from), which are computed on a copy so the tokens never change with it
  2. token constraints: allowed_token_ids, bad words, logit_bias (layers/token_constraints.py);
     min_tokens: forbid EOS / stop ids for rows that have not produced min_tokens yet
  3. penalties: repetition (HF semantics, prompt + output), then frequency / presence (OpenAI, output)
  4. greedy rows take argmax of the penalized logits
  5. temperature -> min_p -> top_k -> top_p (top-k / top-p as one per-row cutoff logit found without a full
     sort: layers/top_k_top_p.py; `apply_top_k_top_p_sort` is the sort-based reference)
  6. sample with the exponential race: argmax(probs / E), E ~ Exp(1) i.i.d., which draws from
     probs exactly and is a handful of kernels. Seeded rows draw E from their own generator, seeded
     by (seed, output position), so their tokens do not depend on the rest of the batch and repeat
     after a preemption-recompute.
On CUDA, steps 4-6 are one kernel (`sample_on_device`, kernels/sampling.py): the same distribution, drawn by
Gumbel-max with top-k / top-p applied by rejection instead of masking, keyed per row by the same seeds.

A grammar's token bitmask (structured outputs), when a row has one, is applied before all of these.
Every stage is skipped when no row needs it (flags computed on the host by the builder), so an
all-greedy batch without penalties is a single argmax. The logits are modified in place.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np
import torch

from pagedllm.core.errors import NO_ALLOWED_TOKEN
from pagedllm.layers.token_constraints import TokenConstraints, apply_token_constraints, build_token_constraints
from pagedllm.layers.top_k_top_p import (apply_top_k_top_p, apply_top_k_top_p_prefix, mask_below,
                                           top_k_top_p_cutoff_sort)
from pagedllm.sampling_params import _GREEDY_EPS, SamplingParams
from pagedllm.structured_output.bitmask import apply_token_bitmask_

_MASK64 = (1 << 64) - 1
# Top-k / top-p (layers/top_k_top_p.py; measured in docs/benchmarks.md, "Sampling"): "auto" takes the per-row cutoff
# search on the CPU; on CUDA the prefix path (torch.topk of the batch's largest top-k, no sort, no host sync) where
# top-p is used, every top-p row has a top-k and the batch has PREFIX_MIN_ROWS rows or more (below, torch.topk over
# few long rows is slower than the whole sort), else the sort. "cutoff" / "sort" / "prefix" force one: the tests'
# and sampler_cost.py's A/B.
TOP_K_TOP_P_IMPL = "auto"
PREFIX_MIN_ROWS = 64
# CUDA draws random rows in one kernel (kernels/sampling.py: temperature, min_p, top-k, top-p and the draw, no sort,
# no [N, V] temporaries) unless this is False (the A/B of benchmarks/sampler_cost.py). A top-k reaches it as a
# cutoff logit from torch.topk when it is at most DEVICE_TOPK_CUTOFF_MAX or the batch has top-p (whose mass is then
# taken within each row's top-k set); a larger top-k in a batch without top-p is applied by the kernel's rejection
# test instead. A few rows with temperature alone spread each row over many programs (the kernel's split variant:
# the same draws), so every random batch takes the kernel and a seeded row's token never depends on its company.
DEVICE_SAMPLING = True
_DEVICE_SAMPLING_TYPES = ("cuda",)  # Triton's interpreter test adds "cpu"
DEVICE_TOPK_CUTOFF_MAX = 1024
# A row's temperature is held to at most SAMPLING_BOUND and its repetition penalty to [1/SAMPLING_BOUND,
# SAMPLING_BOUND]: any positive value is valid (vLLM's rules), but in float32 1e300 is inf and 1e-300 is 0, and the
# logits over them were inf or NaN (-inf / inf of a masked token): top-p's search indexed with them and stopped the
# engine core, or a NaN row's argmax broke the request's grammar and allowed tokens. Past the bound the
# distribution is already uniform (or the penalty total), so nothing else changes.
SAMPLING_BOUND = 1e8


def row_temperature(p: SamplingParams) -> float:
    """The temperature a sampled row divides its logits by (both metadata builders'), finite in float32."""
    return min(float(p.temperature), SAMPLING_BOUND)


def penalized_prompt(state: Any) -> list[int]:
    """The prompt tokens a repetition penalty counts: none for a prompt given as embeddings, whose ids are only
    placeholders (counting them penalized the placeholder's token)."""
    return [] if getattr(state, "prompt_embeds", None) is not None else state.prompt_token_ids


def _mix_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): a stable 63-bit generator seed (Python's hash() is not stable)."""
    x = (seed * 0x9E3779B97F4A7C15 + position + 0x632BE59BD9B4E019) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


def _to_device(t: torch.Tensor, device, dtype=None) -> torch.Tensor:
    """Host -> device without waiting for the device: via pinned memory on CUDA (a pageable copy would
    block until the step in flight has finished)."""
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if torch.device(device).type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def _padded_tensor(rows, needed: list[bool], pad_id: int, device) -> torch.Tensor:
    """[len(rows), max_len] int64 on device, right-padded with pad_id; rows not needed stay all padding.

    rows: lists of ids, or an already padded [N, L] numpy array / tensor (a runner's persistent buffer).
    numpy row assignment is faster than torch.tensor on nested lists (docs/benchmarks.md), which matters for long
    prompts.
    """
    if isinstance(rows, np.ndarray):
        rows = torch.from_numpy(rows)
    if isinstance(rows, torch.Tensor):
        return _to_device(rows, device, torch.int64)
    width = max(1, max((len(r) for r, keep in zip(rows, needed) if keep), default=0))
    padded = np.full((len(rows), width), pad_id, dtype=np.int64)
    for i, (row, keep) in enumerate(zip(rows, needed)):
        if keep and len(row):
            padded[i, :len(row)] = row
    return _to_device(torch.from_numpy(padded), device)


@dataclass
class SamplingMetadata:
    """Per-step sampling state of the N rows that sample this step (rows in batch order).

    Tensors a stage does not need are None (the matching no_* / all_* flag is then True), so the
    sampler never reads them. Token-id tensors are padded with vocab_size, which indexes one
    scratch column past the vocabulary.
    """

    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    temperature: Optional[torch.Tensor] = None  # [N] float32; 0 for greedy rows; None when all_greedy
    top_p: Optional[torch.Tensor] = None  # [N] float32 in (0, 1]
    top_k: Optional[torch.Tensor] = None  # [N] int64; rows without top-k hold vocab_size
    max_top_k: int = 0  # max over rows that use top-k (host int: no device sync to size torch.topk)
    top_p_within_top_k: bool = False  # every sampled row with a top-p also has a top-k (host knowledge)
    min_p: Optional[torch.Tensor] = None  # [N] float32
    no_top_p: bool = True
    no_top_k: bool = True
    no_min_p: bool = True
    presence_penalties: Optional[torch.Tensor] = None  # [N] float32
    frequency_penalties: Optional[torch.Tensor] = None  # [N] float32
    repetition_penalties: Optional[torch.Tensor] = None  # [N] float32
    no_penalties: bool = True
    no_frequency_presence: bool = True  # every row has presence == frequency == 0
    prompt_token_ids: Optional[torch.Tensor] = None  # [N, Lp] int64; only for repetition penalty
    output_token_ids: Optional[torch.Tensor] = None  # [N, Lo] int64; only for penalties
    # (row indices [M], token ids [M]): logits to set to -inf this step (min_tokens not yet reached).
    min_tokens_mask: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    # row -> generator seeded by (seed, output position) for rows with a seed; seeds: the same rows' generator seeds
    # (the device sampler's per-row keys).
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    seeds: dict[int, int] = field(default_factory=dict)
    max_num_logprobs: Optional[int] = None  # None: no row asked for logprobs
    # allowed_token_ids / bad_words / logit_bias of the rows that have them (layers/token_constraints.py)
    constraints: Optional[TokenConstraints] = None
    # What logprobs report (vLLM's logprobs_mode): raw_logprobs | raw_logits | processed_logprobs | processed_logits.
    # Set by the runner from the engine's argument.
    logprobs_mode: str = "raw_logprobs"
    # Structured outputs: int32 [N, ceil(V / 32)] allowed-token bits per row (all ones for unconstrained rows);
    # applied first, so every later stage and the logprobs see the masked distribution. Set by the runner.
    token_bitmask: Optional[torch.Tensor] = None
    # Set by process_logits where a mask applied: [N] bool, the rows whose every token the masks forbid (a grammar,
    # allowed_token_ids, min_tokens in conflict). Their sampled id becomes NO_ALLOWED_TOKEN (mark_no_token).
    no_token_rows: Optional[torch.Tensor] = None

    @property
    def argmax_only(self) -> bool:
        """The sampled tokens are exactly the argmax of the raw logits: every row greedy, and nothing edits the
        logits (penalties, min_tokens, token constraints) or reports them (logprobs)."""
        return (self.all_greedy and self.max_num_logprobs is None and self.no_penalties
                and self.min_tokens_mask is None and self.constraints is None)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: "Sequence[Sequence[int]] | np.ndarray | torch.Tensor",
        output_token_ids: Sequence[Sequence[int]],
        eos_token_ids: Sequence[Optional[int]],
        vocab_size: int,
        device: torch.device | str,
    ) -> "SamplingMetadata":
        """Build the metadata from per-row host data: one host->device copy per tensor kind.

        prompt_token_ids is only read when some row has a repetition penalty; it may also be a
        [N, Lp] array / tensor already padded with vocab_size. output_token_ids (lists) give each
        row's output position (seeds, min_tokens) and, with penalties, the penalized ids.
        eos_token_ids: per row the EOS id that min_tokens forbids (None: none; ignore_eos still forbids it).
        """
        n = len(params)
        greedy = [p.temperature < _GREEDY_EPS for p in params]
        all_greedy = all(greedy)
        all_random = not any(greedy)
        meta = cls(num_rows=n, vocab_size=vocab_size, all_greedy=all_greedy, all_random=all_random)

        # One float32 host->device copy for every per-row float we need.
        float_rows: list[list[float]] = []
        names: list[str] = []
        sampled = [p for p, g in zip(params, greedy) if not g]
        if not all_greedy:
            names.append("temperature")
            float_rows.append([0.0 if g else row_temperature(p) for p, g in zip(params, greedy)])
            if any(p.top_p < 1.0 for p in sampled):
                names.append("top_p")
                float_rows.append([float(p.top_p) for p in params])
            if any(p.min_p > 0.0 for p in sampled):
                names.append("min_p")
                float_rows.append([float(p.min_p) for p in params])
            if any(0 < p.top_k < vocab_size for p in sampled):
                meta.no_top_k = False
                ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
                meta.max_top_k = max(k for k in ks if k < vocab_size)
                meta.top_k = _to_device(torch.tensor(ks, dtype=torch.int64), device)
            meta.top_p_within_top_k = all(0 < p.top_k < vocab_size for p in sampled if p.top_p < 1.0)
        need_rep = any(p.repetition_penalty != 1.0 for p in params)
        need_freq_pres = any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params)
        if need_rep or need_freq_pres:
            meta.no_penalties = False
            meta.no_frequency_presence = not need_freq_pres
            names += ["presence_penalties", "frequency_penalties", "repetition_penalties"]
            float_rows.append([float(p.presence_penalty) for p in params])
            float_rows.append([float(p.frequency_penalty) for p in params])
            float_rows.append([min(max(float(p.repetition_penalty), 1.0 / SAMPLING_BOUND), SAMPLING_BOUND)
                               for p in params])
            # Rows without a penalty contribute only padding (their penalties are no-ops anyway).
            penalized = [p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                         for p in params]
            meta.output_token_ids = _padded_tensor(output_token_ids, penalized, vocab_size, device)
            if need_rep:
                rep_rows = [p.repetition_penalty != 1.0 for p in params]
                meta.prompt_token_ids = _padded_tensor(prompt_token_ids, rep_rows, vocab_size, device)
        if float_rows:
            packed = _to_device(torch.tensor(float_rows, dtype=torch.float32), device)
            for name, row in zip(names, packed.unbind(0)):
                setattr(meta, name, row)
        meta.no_top_p = meta.top_p is None
        meta.no_min_p = meta.min_p is None

        # min_tokens: forbid the ids that would end the request early.
        mask_rows: list[int] = []
        mask_ids: list[int] = []
        for i, (p, out, eos) in enumerate(zip(params, output_token_ids, eos_token_ids)):
            if p.min_tokens and len(out) < p.min_tokens:
                stop_ids = set(p.all_stop_token_ids) | set(p.stop_token_ids or ())
                if eos is not None:
                    stop_ids.add(eos)
                for t in sorted(stop_ids):
                    if 0 <= t < vocab_size:
                        mask_rows.append(i)
                        mask_ids.append(t)
        if mask_rows:
            both = _to_device(torch.tensor([mask_rows, mask_ids], dtype=torch.int64), device)
            meta.min_tokens_mask = (both[0], both[1])

        dev = torch.device(device)
        for i, (p, g) in enumerate(zip(params, greedy)):
            if p.seed is not None and not g:
                gen = torch.Generator(device=dev)
                meta.seeds[i] = _mix_seed(p.seed, len(output_token_ids[i]))
                gen.manual_seed(meta.seeds[i])
                meta.generators[i] = gen

        wanted = [p.logprobs for p in params if p.logprobs is not None]
        meta.max_num_logprobs = max(wanted) if wanted else None
        meta.constraints = build_token_constraints(params, output_token_ids, vocab_size, device)
        return meta


class LogprobsTensors(NamedTuple):
    """Column 0 is the sampled token, columns 1..K the top-K tokens of the reported values (the logprobs_mode's)."""

    token_ids: torch.Tensor  # [N, K+1] int64
    logprobs: torch.Tensor  # [N, K+1] float32
    ranks: torch.Tensor  # [N, K+1] int64, 1 = most likely


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64
    logprobs: Optional[LogprobsTensors] = None


class Sampler(torch.nn.Module):
    """logits [N, V] float32 + SamplingMetadata -> SamplerOutput. Modifies logits in place."""

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if _draws_as_is(logits, meta) and (sampled := sample_on_device(logits, meta)) is not None:
            # Nothing edits the logits and no logprob reads them: the kernel reads the LM head's own dtype (its
            # float32 values are exact), without the widened [N, V] copy.
            return SamplerOutput(sampled_token_ids=sampled, logprobs=None)
        logits, reported = self.process_logits(logits, meta)
        if reported is None and meta.max_num_logprobs is not None:  # processed_* modes: before sampling edits logits
            reported = processed_values(logits, meta)

        sampled = self.draw(logits, meta)
        lp = None
        if reported is not None:
            lp = gather_logprobs(reported, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=mark_no_token(sampled, meta), logprobs=lp)

    @classmethod
    def draw(cls, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """[N] the tokens of processed logits (process_logits'): argmax for greedy rows, a draw for the others
        (seeded rows from their (seed, position) key). May modify logits in place."""
        if meta.all_greedy:
            return logits.argmax(dim=-1)
        if (sampled := sample_on_device(logits, meta)) is not None:
            return sampled
        greedy_ids = None if meta.all_random else logits.argmax(dim=-1)
        sampled = cls._sample(logits, meta)
        if greedy_ids is not None:
            sampled = torch.where(meta.temperature < _GREEDY_EPS, greedy_ids, sampled)
        return sampled

    @staticmethod
    def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Everything before the greedy / random split: (float32 logits with min_tokens and penalties applied,
        the raw values logprobs report or None: the log-softmax, or with logprobs_mode raw_logits a copy of the
        logits; None in the processed_* modes too). Speculative verification (spec_decode/) shares it with
        forward()."""
        if logits.dtype != torch.float32:
            logits = logits.float()
        if meta.token_bitmask is not None:  # a grammar's allowed tokens (structured outputs), before everything
            apply_token_bitmask_(logits, meta.token_bitmask)
        raw_logprobs = None
        if meta.max_num_logprobs is not None and meta.logprobs_mode == "raw_logprobs":
            raw_logprobs = logits.log_softmax(dim=-1)
        elif meta.max_num_logprobs is not None and meta.logprobs_mode == "raw_logits":
            raw_logprobs = logits.clone()  # (the stages below edit logits in place)

        if meta.constraints is not None:
            logits = apply_token_constraints(logits, meta.constraints)
        if meta.min_tokens_mask is not None:
            rows, ids = meta.min_tokens_mask
            logits[rows, ids] = float("-inf")
        if meta.token_bitmask is not None or meta.constraints is not None or meta.min_tokens_mask is not None:
            # Masks in conflict can leave a row no token: its logits become uniform so that every sampling path
            # stays finite (no sync here), and its sampled id is replaced by NO_ALLOWED_TOKEN afterwards.
            dead = torch.isneginf(logits.amax(dim=-1))
            logits.masked_fill_(dead.unsqueeze(1), 0.0)
            meta.no_token_rows = dead
        if not meta.no_penalties:
            logits = apply_penalties(logits, meta)
        return logits, raw_logprobs

    @classmethod
    def _sample(cls, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        probs = cls.probs(logits, meta)
        if probs.device.type == "cpu":
            return inverse_cdf_sample(probs, meta.generators)
        return exponential_race(probs, meta.generators)

    @classmethod
    def probs(cls, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The distribution random rows draw from: temperature -> min_p -> top-k / top-p -> softmax (greedy rows
        get temperature 1 here; callers take their argmax instead). Modifies logits in place."""
        return cls.truncated_logits(logits, meta).softmax(dim=-1)

    @staticmethod
    def truncated_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """probs() before its softmax: the logits over temperature, -inf where min_p / top-k / top-p cut. Modifies
        logits in place."""
        temperature = meta.temperature
        if not meta.all_random:  # greedy rows (temperature 0) are overwritten later; avoid 0-division
            temperature = torch.where(temperature < _GREEDY_EPS, 1.0, temperature)
        logits.div_(temperature.unsqueeze(1))
        if not meta.no_min_p:
            logits = apply_min_p(logits, meta.min_p)
        top_k = None if meta.no_top_k else meta.top_k
        top_p = None if meta.no_top_p else meta.top_p
        impl = top_k_top_p_impl(meta, logits.shape[0], logits.is_cuda)
        if impl == "sort":  # the reference (A/B: benchmarks/sampler_cost.py)
            if top_p is not None:
                logits = apply_top_k_top_p_sort(logits, top_k, top_p)
            elif top_k is not None:
                logits = apply_top_k_only(logits, top_k, meta.max_top_k)
        elif impl == "prefix" and (top_k is not None or top_p is not None):
            logits = apply_top_k_top_p_prefix(logits, top_k, top_p, meta.max_top_k, meta.top_p_within_top_k)
        elif top_k is not None or top_p is not None:
            logits = apply_top_k_top_p(logits, top_k, top_p)
        return logits


def draws_as_is(meta: SamplingMetadata) -> bool:
    """A random-sampling step whose logits process_logits would only widen to float32: no grammar mask, logprobs,
    constraints, min_tokens or penalties (the device sampler then reads them in the LM head's dtype)."""
    return (not meta.all_greedy and meta.token_bitmask is None and meta.max_num_logprobs is None
            and meta.constraints is None and meta.min_tokens_mask is None and meta.no_penalties)


def _draws_as_is(logits: torch.Tensor, meta: SamplingMetadata) -> bool:
    return logits.dtype != torch.float32 and draws_as_is(meta)


def mark_no_token(ids: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """ids with NO_ALLOWED_TOKEN in the rows the masks left without a token."""
    if meta.no_token_rows is None:
        return ids
    return torch.where(meta.no_token_rows, torch.full_like(ids, NO_ALLOWED_TOKEN), ids)


def sample_on_device(logits: torch.Tensor, meta: SamplingMetadata) -> Optional[torch.Tensor]:
    """Tokens of a CUDA batch drawn by the one-kernel sampler (kernels/sampling.py), or None where it does not
    apply (the CPU, DEVICE_SAMPLING off, a general-path TOP_K_TOP_P_IMPL forced). Greedy rows
    get their argmax.
    The logits are not modified."""
    if not (DEVICE_SAMPLING and logits.device.type in _DEVICE_SAMPLING_TYPES and TOP_K_TOP_P_IMPL == "auto"):
        return None
    cutoff = top_k = None
    if not meta.no_top_k:
        if meta.max_top_k <= DEVICE_TOPK_CUTOFF_MAX or not meta.no_top_p:
            # The k-th largest raw logit (the temperature keeps the order): rows keep logits >= it, ties included.
            cutoff = top_k_threshold(logits, meta.top_k, meta.max_top_k).squeeze(1).float()  # (exact: bf16 in)
        else:
            top_k = meta.top_k
    from pagedllm.kernels.sampling import sample_rows

    seeds = None
    if meta.seeds:
        host = torch.full((logits.shape[0],), -1, dtype=torch.int64)
        for row, seed in meta.seeds.items():
            host[row] = seed
        seeds = _to_device(host, logits.device)
    # Rows without a seed: one key per step from torch's generator (torch.manual_seed makes runs repeat, and every
    # tensor-parallel rank, seeded alike, draws the same tokens).
    step_seed = int(torch.randint(1 << 40, 1 << 62, (1,)).item())
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    return sample_rows(logits, meta.temperature, step_seed, seeds=seeds,
                       min_p=None if meta.no_min_p else meta.min_p, top_k=top_k,
                       top_p=None if meta.no_top_p else meta.top_p, cutoff=cutoff, greedy_eps=_GREEDY_EPS)


def warm_up_device_sampling(vocab_size: int, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
    """Compile the device sampler at start-up (CUDA), so no batch meets a Triton compile in the middle of serving:
    for float32 logits and the LM head's own dtype (steps that draw from the logits as they are)."""
    if DEVICE_SAMPLING and torch.device(device).type in _DEVICE_SAMPLING_TYPES:
        from pagedllm.kernels.sampling import warm_up

        for logits_dtype in dict.fromkeys((torch.float32, dtype)):
            warm_up(vocab_size, torch.device(device), logits_dtype)


def top_k_top_p_impl(meta: SamplingMetadata, rows: int, cuda: bool) -> str:
    """How this step applies top-k / top-p: TOP_K_TOP_P_IMPL, or for "auto" the measured choice (above)."""
    if TOP_K_TOP_P_IMPL != "auto":
        return TOP_K_TOP_P_IMPL
    if not cuda:
        return "cutoff"
    # Top-k alone stays on the sort branch, whose torch.topk of the largest top-k is the prefix path's read.
    prefix = not meta.no_top_p and not meta.no_top_k and meta.top_p_within_top_k and rows >= PREFIX_MIN_ROWS
    return "prefix" if prefix else "sort"


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt + output tokens) then frequency and presence (output tokens)."""
    n, vocab = logits.shape
    out_ids = meta.output_token_ids  # [N, Lo], pad id = vocab -> scratch column, dropped below
    if meta.prompt_token_ids is not None:  # some row has repetition_penalty != 1
        seen = torch.zeros(n, vocab + 1, dtype=torch.bool, device=logits.device)
        seen.scatter_(1, meta.prompt_token_ids, True)
        seen.scatter_(1, out_ids, True)
        rep = meta.repetition_penalties.unsqueeze(1)  # [N, 1]
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen[:, :vocab], penalized, logits)
    if not meta.no_frequency_presence:
        counts = torch.zeros(n, vocab + 1, dtype=logits.dtype, device=logits.device)
        counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=logits.dtype))
        counts = counts[:, :vocab]  # [N, V]
        logits -= meta.frequency_penalties.unsqueeze(1) * counts
        logits -= meta.presence_penalties.unsqueeze(1) * (counts > 0)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep each row's top_k logits (ties with the k-th are kept) using torch.topk, not a sort."""
    return logits.masked_fill_(logits < top_k_threshold(logits, top_k, max_top_k), float("-inf"))


def top_k_threshold(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """[N, 1]: each row's k-th largest logit (torch.topk of the batch's largest top-k); -inf for rows without top-k."""
    top_vals = logits.topk(max_top_k, dim=-1).values  # [N, max_top_k], descending
    threshold = top_vals.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))
    return threshold.masked_fill_((top_k >= logits.shape[1]).unsqueeze(1), float("-inf"))


def apply_top_k_top_p_sort(logits: torch.Tensor, top_k: Optional[torch.Tensor], top_p: torch.Tensor) -> torch.Tensor:
    """The sort-based reference of top-k / top-p (`top_k_top_p_cutoff_sort`), masking in place."""
    return mask_below(logits, top_k_top_p_cutoff_sort(logits, top_k, top_p))


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """argmax(probs / E) with E ~ Exp(1): an exact draw from probs. probs is overwritten."""
    noise = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        noise.exponential_()
    for row, gen in generators.items():
        noise[row].exponential_(generator=gen)
    # E can be exactly 0 in float32; 0/0 would be NaN and win the argmax for a masked token.
    noise.clamp_(min=1e-30)
    return probs.div_(noise).argmax(dim=-1)


def inverse_cdf_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One uniform number per row against the row's cumulative distribution: an exact draw from probs.

    The CPU path: the exponential race needs a logarithm per vocabulary entry (costly on a CPU at every
    sampling step; docs/benchmarks.md, CPU section), this a cumulative sum. Seeded rows draw their number from
    their own generator, so their samples do not depend on the rest of the batch.
    """
    n = probs.shape[0]
    u = torch.rand(n, dtype=torch.float64)
    for row, gen in generators.items():
        u[row] = torch.rand(1, generator=gen, dtype=torch.float64)[0]
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    target = (u * cdf[:, -1]).unsqueeze(1)
    # First index whose cumulative mass exceeds the target: a token of zero probability never is.
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def processed_values(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """What logprobs report in vLLM's processed_* modes: for random rows the logits after temperature, min_p and
    top-k / top-p (-inf where cut), for greedy rows the logits after penalties (what their argmax reads); as
    log-softmax in processed_logprobs. Computed on a copy: the sampler draws from `logits` as in every mode."""
    out = logits.clone()
    if not meta.all_greedy:
        out = Sampler.truncated_logits(out, meta)
        if not meta.all_random:
            out = torch.where((meta.temperature < _GREEDY_EPS).unsqueeze(1), logits, out)
    return out.log_softmax(dim=-1) if meta.logprobs_mode == "processed_logprobs" else out


def gather_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor, k: int) -> LogprobsTensors:
    """Sampled token's logprob (or the logprobs_mode's value) and rank, then the top-k tokens of those values."""
    sampled = sampled.unsqueeze(1)  # [N, 1]
    sampled_lp = logprobs.gather(1, sampled)  # [N, 1]
    sampled_rank = (logprobs > sampled_lp).sum(dim=-1, keepdim=True) + 1
    if k == 0:
        return LogprobsTensors(sampled, sampled_lp, sampled_rank)
    top_lp, top_ids = logprobs.topk(k, dim=-1)
    top_ranks = torch.arange(1, k + 1, device=logprobs.device).expand(logprobs.shape[0], k)
    return LogprobsTensors(
        torch.cat([sampled, top_ids], dim=1),
        torch.cat([sampled_lp, top_lp], dim=1),
        torch.cat([sampled_rank, top_ranks], dim=1),
    )
