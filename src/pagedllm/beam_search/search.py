"""Beam search with transformers' semantics (GenerationMixin._beam_search), one prompt at a time, on the host.

Each step takes, for every live beam, the top log-probabilities of its next token (computed by the engine: each
beam is one request whose prompt is prompt + beam tokens, so beams share the prompt's full KV blocks through the
prefix cache and run in the continuous batch next to ordinary requests) and

  1. keeps the best `keep = max(2, 1 + num_eos) * beam_width` continuations over all beams by cumulative logprob;
  2. continuations that end (EOS, or max_tokens reached) and rank among the first beam_width enter the finished
     set with score cumulative_logprob / generated_len ** length_penalty; the finished set keeps the best
     beam_width;
  3. the best beam_width continuations that did not end become the running beams;
  4. stops when no running beam can still beat the worst finished one (transformers' heuristic, which depends on
     early_stopping), when early_stopping is True and beam_width beams have finished, or when every continuation
     ended.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from pagedllm.outputs import Logprob
from pagedllm.sampling_params import BeamSearchParams

NEG = -1.0e9  # transformers' "impossible" score


def length_normalized(score: float, length: int, penalty: float) -> float:
    """score / length ** penalty. Any finite penalty is allowed (as in transformers), so for an extreme one the
    power leaves the float range: beyond it the quotient is 0, below it (the power underflows to 0) infinite."""
    try:
        return score / length ** penalty
    except OverflowError:
        return score * 0.0
    except ZeroDivisionError:
        return math.copysign(math.inf, score) if score else 0.0


@dataclass
class BeamSearchSequence:
    """vLLM's BeamSearchSequence: tokens are prompt + generated; logprobs one dict per generated token (its top
    candidates); cum_logprob the sum of the generated tokens' logprobs; score the length-penalized score the
    beams are ranked by."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: Optional[str] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int] = None
    score: float = 0.0


@dataclass
class BeamSearchOutput:
    """vLLM's BeamSearchOutput: the beams of one prompt, best first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


@dataclass
class _Beam:
    tokens: list[int]  # generated only
    score: float  # cumulative logprob (+ NEG when it cannot continue)
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0


@dataclass
class _Hyp:
    beam: Optional[_Beam]
    score: float
    finished: bool


def check_logprobs_mode(mode: str) -> None:
    """Beams are scored by summed log-probabilities: an engine whose logprobs report logits (vLLM's *_logits
    logprobs_mode) would rank them by summed logits, so it refuses. (A beam step is greedy without penalties: its
    processed logprobs are its raw ones.)"""
    if mode.endswith("_logits"):
        raise ValueError(f"Beam search needs log-probabilities, but this engine's logprobs_mode={mode!r} reports "
                         "logits; start it with logprobs_mode 'raw_logprobs' (the default) or 'processed_logprobs'.")


class BeamSearch:
    def __init__(self, prompt_token_ids: Sequence[int], params: BeamSearchParams, eos_token_ids: Sequence[int],
                 vocab_size: Optional[int] = None):
        self.prompt = list(prompt_token_ids)
        self.vocab_size = vocab_size
        self.params = params
        self.width = params.beam_width
        self.eos = set() if params.ignore_eos else set(eos_token_ids)
        self.keep = max(2, 1 + len(self.eos)) * self.width
        self.running = [_Beam([], 0.0, [])] + [_Beam([], NEG, []) for _ in range(self.width - 1)]
        self.finished = [_Hyp(None, NEG, False) for _ in range(self.width)]
        self.heuristic_unsatisfied = True
        self.num_generated = 0
        self.done = False

    def check_logprob_limit(self, max_logprobs: int) -> None:
        """Each beam step asks the engine for the top num_logprobs: refuse at once when --max-logprobs is lower."""
        if max_logprobs != -1 and self.num_logprobs > max_logprobs:
            most = max_logprobs // (self.keep // self.width)
            raise ValueError(f"beam_width={self.width} needs the top {self.num_logprobs} logprobs of every step, "
                             f"more than max_logprobs={max_logprobs}; use a beam width of at most {most} "
                             "or start the engine with a larger --max-logprobs.")

    @property
    def num_logprobs(self) -> int:
        """Top tokens needed per beam: the best `keep` continuations overall are among each beam's best `keep`
        (all of a vocabulary smaller than that: the engine refuses more logprobs than the vocabulary has)."""
        return self.keep if self.vocab_size is None else min(self.keep, self.vocab_size)

    def pending(self) -> list[tuple[int, list[int]]]:
        """(beam index, prompt + beam tokens) of the live beams whose next-token logprobs are needed."""
        if self.done:
            return []
        return [(i, self.prompt + b.tokens) for i, b in enumerate(self.running) if b.score > NEG / 2]

    def advance(self, top: dict[int, list[tuple[int, float, Optional[Logprob]]]],
                logprob_dicts: dict[int, dict[int, Logprob]]) -> None:
        """top[i]: beam i's candidates (token, logprob, Logprob) best first; logprob_dicts[i]: what to record."""
        cands = []  # (cumulative, beam index, token, logprob)
        for i, beam in enumerate(self.running):
            for token, lp, _ in top.get(i, ()):
                cands.append((beam.score + lp, i, token, lp))
        cands.sort(key=lambda c: -c[0])  # stable: ties keep beam then rank order
        cands = cands[:self.keep]
        at_limit = self.num_generated + 1 >= self.params.max_tokens
        hits = [at_limit or c[2] in self.eos for c in cands]
        new_beams = []
        for (score, i, token, lp), hit in zip(cands, hits):
            parent = self.running[i]
            new_beams.append(_Beam(parent.tokens + [token], score + (NEG if hit else 0.0),
                                   parent.logprobs + [logprob_dicts.get(i, {})], parent.cum_logprob + lp))
        self._update_finished(cands, new_beams, hits)
        order = sorted(range(len(new_beams)), key=lambda j: -new_beams[j].score)[:self.width]
        self.running = [new_beams[j] for j in order]
        while len(self.running) < self.width:
            self.running.append(_Beam([], 2 * NEG, []))
        self.num_generated += 1
        self._check_heuristic()
        all_finished = all(h.finished for h in self.finished)
        exists_open = not (all_finished and self.params.early_stopping is True)
        self.done = not (self.heuristic_unsatisfied and exists_open and not all(hits))

    def _update_finished(self, cands, new_beams, hits) -> None:
        p = self.params
        full = all(h.finished for h in self.finished) and p.early_stopping is True
        merged = list(self.finished)
        for j, (c, beam, hit) in enumerate(zip(cands, new_beams, hits)):
            just = hit and j < self.width
            score = length_normalized(c[0], self.num_generated + 1, p.length_penalty)
            if full:
                score += NEG
            if not self.heuristic_unsatisfied:
                score += NEG
            if not just:
                score += NEG
            merged.append(_Hyp(beam, score, just))
        order = sorted(range(len(merged)), key=lambda j: -merged[j].score)[:self.width]
        self.finished = [merged[j] for j in order]

    def _check_heuristic(self) -> None:
        p = self.params
        if p.early_stopping == "never" and p.length_penalty > 0.0:
            best_len = p.max_tokens
        else:
            best_len = self.num_generated
        best_possible = length_normalized(self.running[0].score, best_len, p.length_penalty)
        worst_all = min(h.score for h in self.finished)
        improvable = any(best_possible > (worst_all if h.finished else NEG) for h in self.finished)
        self.heuristic_unsatisfied = self.heuristic_unsatisfied and improvable

    def result(self, decode=None) -> BeamSearchOutput:
        hyps = [h for h in self.finished if h.finished and h.beam is not None]
        if len(hyps) < self.width:  # (only when the search was cut short) fill up with the best running beams
            extra = [_Hyp(b, length_normalized(b.score, max(1, len(b.tokens)), self.params.length_penalty), False)
                     for b in self.running if b.tokens and b.score > NEG / 2]
            hyps += extra[:self.width - len(hyps)]
        out = []
        for h in hyps:
            b = h.beam
            ends_eos = bool(b.tokens) and b.tokens[-1] in self.eos
            text = None
            if decode is not None:
                shown = b.tokens[:-1] if ends_eos and not self.params.include_stop_str_in_output else b.tokens
                text = decode(shown)
            out.append(BeamSearchSequence(
                tokens=self.prompt + b.tokens, logprobs=b.logprobs, cum_logprob=b.cum_logprob, text=text,
                finish_reason="stop" if ends_eos else "length", score=h.score,
                stop_reason=b.tokens[-1] if ends_eos else None))  # (vLLM's beams name the EOS id that ended them)
        return BeamSearchOutput(sequences=out)
