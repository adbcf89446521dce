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

__all__ = ["DEFAULT_STEP_TOKENS", "GPU_STEP_TOKENS", "Scheduled", "schedule", "step_tokens_for"]

DEFAULT_STEP_TOKENS = 512
# On a GPU a step's fixed cost (launches, Python between them) dwarfs 512 tokens' compute:
# a long prompt runs in chunks of this many tokens (a 1B model's 16k-token chunk is tens of ms
# on an H200; the attention of a chunk after cached rows needs no [t, n] mask, attention.py).
GPU_STEP_TOKENS = 16384


def step_tokens_for(device_type: str) -> int:
    """The per-step token budget for a device type (``torch.device.type``)."""
    return GPU_STEP_TOKENS if device_type == "cuda" else DEFAULT_STEP_TOKENS


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
