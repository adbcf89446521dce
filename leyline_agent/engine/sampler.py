"""Token choice and logprobs (no model here; stop strings: ``detokenizer``).

A sampler may carry a ``constraint`` (``engine/grammar.py``): once per step the stepper masks
the logits of every constrained row in one batch (``mask_batch``), and ``choose`` then
advances the constraint past the token it picked. A sampler without one never imports
xgrammar.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from leyline_agent.engine.params import GREEDY_BELOW, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from leyline_agent.engine.grammar import Constraint

__all__ = ["Sampler", "mask_batch"]


def mask_batch(logits: torch.Tensor, samplers: Sequence[Sampler]) -> None:
    """Mask row ``i`` of ``logits`` by ``samplers[i]``'s constraint, in place, all the
    constrained rows in one batch; unconstrained rows are left as they are."""
    constraints = [s.constraint for s in samplers]
    if any(c is not None for c in constraints):
        from leyline_agent.engine.grammar import mask_logits

        mask_logits(logits, constraints)


class Sampler:
    """Greedy at temperature 0 (or below ``GREEDY_BELOW``); otherwise temperature, top-k,
    nucleus and min-p with a per-request generator. ``repetition_penalty`` and
    ``min_tokens`` (``SamplingParams``) apply to both; ``prompt_ids`` are the tokens the
    penalty counts before the answer's own, ``stop_ids`` those ``min_tokens`` holds back."""

    def __init__(
        self,
        params: SamplingParams,
        device: torch.device,
        constraint: Constraint | None = None,
        *,
        prompt_ids: Sequence[int] = (),
        stop_ids: Sequence[int] = (),
    ) -> None:
        self.params = params
        self.constraint = constraint  # the sequence's grammar state, if it has one
        self.seen: set[int] = set(prompt_ids) if params.repetition_penalty != 1.0 else set()
        self.stop_ids = sorted(stop_ids)
        self.chosen = 0  # answer tokens so far
        self.greedy = params.temperature < GREEDY_BELOW
        self.gen: torch.Generator | None = None
        if not self.greedy:
            self.gen = torch.Generator(device="cpu")
            if params.seed is not None:
                self.gen.manual_seed(params.seed)
            else:
                self.gen.seed()

    def choose(self, logits: torch.Tensor) -> int:
        """The next token from ``logits`` (already masked when there is a constraint)."""
        tok = self._pick(self._adjusted(logits))
        if self.constraint is not None:
            self.constraint.accept(tok)
        self.chosen += 1
        if self.params.repetition_penalty != 1.0:
            self.seen.add(tok)
        return tok

    def _adjusted(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` with the repetition penalty and ``min_tokens``' mask applied (a copy)."""
        p = self.params
        held = self.chosen < p.min_tokens and self.stop_ids
        if p.repetition_penalty == 1.0 and not held:
            return logits
        out = logits.float().cpu().clone()
        if self.seen and p.repetition_penalty != 1.0:
            idx = torch.tensor(sorted(self.seen), dtype=torch.long)
            sel = out[idx]
            out[idx] = torch.where(sel > 0, sel / p.repetition_penalty, sel * p.repetition_penalty)
        if held:
            out[torch.tensor(self.stop_ids, dtype=torch.long)] = float("-inf")
        return out

    def _pick(self, logits: torch.Tensor) -> int:
        p = self.params
        if self.greedy:
            return int(torch.argmax(logits))
        scores = logits.float().cpu() / p.temperature
        if 0 < p.top_k < scores.numel():
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < p.top_p
            keep[0] = True
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        return int(torch.multinomial(probs, 1, generator=self.gen))

    def logprob(self, logits: torch.Tensor, token_id: int, tokenizer) -> TokenLogprob:
        lp = torch.log_softmax(logits.float(), dim=-1)
        top: list[tuple[int, str, float]] = []
        if self.params.top_logprobs:
            vals, ids = torch.topk(lp, self.params.top_logprobs)
            top = [  # a token a grammar masked out (-inf) is never a candidate
                (int(i), tokenizer.decode([int(i)]), float(v))
                for v, i in zip(vals, ids, strict=True)
                if v > float("-inf")
            ]
        return TokenLogprob(token_id, tokenizer.decode([token_id]), float(lp[token_id]), top)
