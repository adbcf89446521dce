"""Which sequences run in the next forward, and how many tokens each (pure; no tensors).

nano-vllm's ``engine/scheduler.py`` in one function: every decoding (and flushing)
sequence gets its one token first, so a long prefill never stalls other sessions' decodes;
prefills then share what is left of the per-step token budget, oldest first, in chunks.
With no decode running, the oldest prefill gets at least one token.

A ``paced`` sequence (a splice's ``R``: rows no client reads token by token) gets at most
``paced_tokens`` of a step when the caller passes it, so that the step, which every
decoding stream and every arriving request waits for, stays close to a decode step's length.
The stepper passes it while other sessions' sequences run or ran moments ago, sized from
measured step times; without it a paced sequence takes the whole budget like any prefill.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from leyline_agent.engine.sequence import SeqStatus, Sequence

__all__ = ["DEFAULT_STEP_TOKENS", "Scheduled", "schedule"]

DEFAULT_STEP_TOKENS = 512


@dataclass(slots=True, frozen=True)
class Scheduled:
    seq: Sequence
    num_tokens: int


def schedule(
    running: Iterable[Sequence], budget: int = DEFAULT_STEP_TOKENS, paced_tokens: int | None = None
) -> list[Scheduled]:
    if budget < 1:
        raise ValueError(f"budget: {budget} must be >= 1")
    if paced_tokens is not None and paced_tokens < 1:
        raise ValueError(f"paced_tokens: {paced_tokens} must be >= 1")
    seqs = [s for s in running if s.stepping]
    out = [Scheduled(s, 1) for s in seqs if s.status is not SeqStatus.PREFILL]
    pace = paced_tokens if paced_tokens is not None else budget
    left = budget - len(out)
    for s in seqs:
        if s.status is SeqStatus.PREFILL:
            n = min(s.pending(), max(left, 1 if not out else 0))
            if s.paced:
                n = min(n, pace)
            if n <= 0:
                break
            out.append(Scheduled(s, n))
            left -= n
    return out
