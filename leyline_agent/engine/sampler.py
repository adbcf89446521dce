"""Token choice and logprobs (no model here; stop strings: ``detokenizer``)."""

from __future__ import annotations

import torch

from leyline_agent.engine.params import GREEDY_BELOW, SamplingParams, TokenLogprob

__all__ = ["Sampler"]


class Sampler:
    """Greedy at temperature 0 (or below ``GREEDY_BELOW``); otherwise temperature + nucleus
    with a per-request generator."""

    def __init__(self, params: SamplingParams, device: torch.device) -> None:
        self.params = params
        self.greedy = params.temperature < GREEDY_BELOW
        self.gen: torch.Generator | None = None
        if not self.greedy:
            self.gen = torch.Generator(device="cpu")
            if params.seed is not None:
                self.gen.manual_seed(params.seed)
            else:
                self.gen.seed()

    def choose(self, logits: torch.Tensor) -> int:
        p = self.params
        if self.greedy:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float().cpu() / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < p.top_p
            keep[0] = True
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
        return int(torch.multinomial(probs, 1, generator=self.gen))

    def logprob(self, logits: torch.Tensor, token_id: int, tokenizer) -> TokenLogprob:
        lp = torch.log_softmax(logits.float(), dim=-1)
        top: list[tuple[int, str, float]] = []
        if self.params.top_logprobs:
            vals, ids = torch.topk(lp, self.params.top_logprobs)
            top = [
                (int(i), tokenizer.decode([int(i)]), float(v))
                for v, i in zip(vals, ids, strict=True)
            ]
        return TokenLogprob(token_id, tokenizer.decode([token_id]), float(lp[token_id]), top)
