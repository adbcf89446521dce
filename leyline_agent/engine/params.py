"""What a generation request asks for and what it gets back (torch-free).

``SamplingParams`` are checked by ``validate`` (``InvalidRequestError`` naming the field);
the server builds them from an OpenAI request and imports this module without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from leyline_agent.engine.grammar_spec import GrammarSpec
from leyline_agent.errors import InvalidRequestError

__all__ = [
    "GREEDY_BELOW",
    "SEED_MAX",
    "GenerationResult",
    "SamplingParams",
    "TokenLogprob",
]


# A temperature this small is greedy decoding: logits / 5e-324 overflow to inf and the
# softmax to NaN, and below 1e-5 sampling already picks the argmax for any real logits.
GREEDY_BELOW = 1e-5
SEED_MAX = 2**63 - 1  # seeds are in [0, SEED_MAX]


@dataclass(slots=True)
class SamplingParams:
    """``temperature`` 0, or below ``GREEDY_BELOW``, is greedy; ``seed`` in [0, 2**63 - 1];
    ``grammar``: what the answer must match (``grammar_spec``), None for a free answer.

    vLLM's extra sampling options, as transformers' logits processors define them:
    ``repetition_penalty`` divides the positive logits (multiplies the negative ones) of
    every token of the prompt and the answer so far, greedy too; then ``top_k`` (0: all),
    ``top_p`` and ``min_p`` (a token below ``min_p`` x the top probability is out) cut the
    distribution. ``min_tokens``: no stop token before that many answer tokens;
    ``ignore_eos``: the model's own stop tokens do not end the answer (``stop_token_ids``
    and stop strings still do)."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    grammar: GrammarSpec | None = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False

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
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k: {self.top_k} must be >= 0 (0: no cut)")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p: {self.min_p} must be in [0, 1]")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise InvalidRequestError(
                f"repetition_penalty: {self.repetition_penalty} must be > 0 and finite"
            )
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(f"min_tokens: {self.min_tokens} must be in [0, max_tokens]")
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
