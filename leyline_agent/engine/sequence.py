"""A generation request inside the engine (nano-vllm's ``engine/sequence.py``).

Status, slots, cached count and sampling state live here; tensors do not. ``slots`` are the
pool rows of ``token_ids[:num_computed]``: first the matched prefix (``match.slots``, held
in the tree), then rows this sequence computed (``fresh``, owned by it until committed).
Decode rows come from ``reserved``, a block allocated ahead (``stepper.py``), so that the
rows of sequences decoding side by side do not interleave slot by slot. A ``paced`` sequence
is rows nobody waits on token by token (a splice's ``R``): while other sequences decode, the
scheduler gives it a smaller share of a step (``scheduler.py``).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from leyline_agent.engine.cache.radix import Match
from leyline_agent.engine.detokenizer import Detokenizer
from leyline_agent.engine.params import SamplingParams, TokenLogprob
from leyline_agent.engine.sampler import Sampler
from leyline_agent.namespaces import Namespace

__all__ = ["SeqStatus", "Sequence"]

_ids = itertools.count()


class SeqStatus(Enum):
    PREFILL = "prefill"  # prompt rows still to compute
    DECODE = "decode"  # one new token per step
    FLUSH = "flush"  # finished; its last token's row is still to be written
    FINISHED = "finished"  # done stepping; waits for its owner to commit or abort


@dataclass(slots=True, eq=False)
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    namespace: Namespace
    match: Match
    sampler: Sampler
    detok: Detokenizer  # its text so far, stop strings applied
    stop_ids: frozenset[int]
    t0: float
    splice_lost: bool = False
    paced: bool = False  # background rows (a splice's R): paced while others decode
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: SeqStatus = SeqStatus.PREFILL
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    fresh: list[int] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)  # decode rows allocated ahead, unwritten
    finish_reason: str = "length"
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    events: deque[tuple[int, str]] = field(default_factory=deque)  # (token, text delta)
    on_token: Callable[[int, str], None] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    error: BaseException | None = None  # the step failed: the owner raises it

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def slots(self) -> list[int]:
        return self.match.slots + self.fresh

    @property
    def num_computed(self) -> int:
        """Rows of ``token_ids`` already in the pool."""
        return self.match.length + len(self.fresh)

    @property
    def num_cached_tokens(self) -> int:
        return self.match.length

    @property
    def stepping(self) -> bool:
        return self.status is not SeqStatus.FINISHED

    def pending(self) -> int:
        """Tokens the next forward of this sequence would process."""
        if self.status is SeqStatus.PREFILL:
            return len(self.prompt_ids) - self.num_computed
        if self.status in (SeqStatus.DECODE, SeqStatus.FLUSH):
            return 1
        return 0
