"""Sampling parameters, token choice, logprobs and stop-string handling (no model here)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from leyline_agent.errors import LeylineError

__all__ = ["GenerationResult", "SamplingParams", "Sampler", "TokenLogprob", "StopMatcher"]


class InvalidRequestError(LeylineError, ValueError):
    """A generation request's field is out of range (names the field)."""


GREEDY_BELOW = 1e-5  # a smaller positive temperature is greedy (logits / t would overflow)
SEED_MAX = 2**63 - 1


@dataclass(slots=True)
class SamplingParams:
    """``temperature`` 0, or below ``GREEDY_BELOW``, is greedy; ``seed`` in [0, 2**63 - 1]."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0

    def validate(self) -> None:
        if self.max_tokens < 0:
            raise InvalidRequestError(f"max_tokens: {self.max_tokens} must be >= 0")
        if not 0 <= self.temperature < float("inf"):
            raise InvalidRequestError(f"temperature: {self.temperature} must be >= 0 and finite")
        if self.seed is not None and not 0 <= self.seed <= SEED_MAX:
            raise InvalidRequestError(f"seed: {self.seed} must be in [0, 2**63 - 1]")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p: {self.top_p} must be in (0, 1]")
        if not 0 <= self.top_logprobs <= 20:
            raise InvalidRequestError(f"top_logprobs: {self.top_logprobs} must be in [0, 20]")
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(f"stop[{i}]: must be a non-empty string")


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    text: str
    logprob: float
    top: list[tuple[int, str, float]] = field(default_factory=list)


@dataclass(slots=True)
class GenerationResult:
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    cached_tokens: int
    prefilled_tokens: int
    logprobs: list[TokenLogprob] | None
    ttft_s: float
    e2e_s: float
    splice_evicted: bool = False  # the session's last splice result was evicted before this


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


class StopMatcher:
    """Incremental detokenisation with stop strings.

    ``push(text_so_far)`` returns the new text that is safe to emit (held back while it
    could still be the start of a stop string or ends in a partial UTF-8 character) and
    whether a stop string completed; ``text`` is the output truncated before the stop.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.emitted = 0
        self.text = ""
        self.stopped = False

    def push(self, full: str) -> str:
        cut = len(full)
        for s in self.stops:
            k = full.find(s)
            if k != -1:
                cut = min(cut, k)
                self.stopped = True
        if self.stopped:
            full = full[:cut]
            safe = len(full)
        else:
            safe = len(full)
            if full.endswith("\ufffd"):
                safe -= 1
            for s in self.stops:
                for n in range(min(len(s) - 1, len(full)), 0, -1):
                    if full.endswith(s[:n]):
                        safe = min(safe, len(full) - n)
                        break
        self.text = full
        delta = full[self.emitted : safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return delta

    def flush(self) -> str:
        delta = self.text[self.emitted :]
        self.emitted = len(self.text)
        return delta
