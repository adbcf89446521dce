"""One turn's token drift, from the diff to the directive and back (pure; every front runs it).

A session's last request left ``T`` in the cache; the turn's prompt ``N`` is rendered. Where
the chat template renders unchanged messages differently (a stripped or empty ``<think>``
block, a changed head line), or the client edited cached messages in place, ``N`` differs
from ``T`` in a few spans before the new turn. ``plan_drift`` finds them (``drift.drift_spans``:
bounded), drops the last spans while the tail they keep is shorter than ``MIN_RUN`` tokens (a
reply re-tokenized or a tool call appended after it: a prefill of those few tokens does as
well), and returns the rest as one token-form directive on ``T[:aligned]`` in the turn's
mode, with ``fallback``. The result ``T'`` is a prefix of ``N``, so the prefill that follows
hits it. ``settle`` records what the backend made of it.

Nothing silent: a drift found but not spliced says why in ``DriftOutcome.unspliced``
(``unproven``: the front would not believe the request; ``not_cached``; ``error``; or the
diff's bound, ``max_gap`` / ``max_spans``), counted by ``count`` in
``Counters.drift_unspliced``; a spliced one in ``drift_splices``. Every front runs it
through ``front.chat_turn.drift_turn``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from leyline_agent.directives.core import Directive, Mode
from leyline_agent.directives.drift import MIN_RUN, drift_spans
from leyline_agent.wire import DirectivesRequest, DirectivesResponse

__all__ = ["DriftCounts", "DriftOutcome", "plan_drift"]


class DriftCounts(Protocol):
    """Where drift outcomes are counted (``wire.Counters``, the vLLM route)."""

    drift_splices: int
    drift_unspliced: dict[str, int]


@dataclass(slots=True)
class DriftOutcome:
    """What the token diff of one turn found and did (``usage.leyline.drift``)."""

    spans: list[dict[str, Any]] = field(default_factory=list)  # start, end, replacement len
    spliced: bool = False
    unspliced: str | None = None  # why a drift found was not spliced
    stopped: str | None = None  # the diff's bound, where it stopped short of T's end
    prefilled_tokens: int = 0
    rotated_tokens: int = 0
    diff_s: float = 0.0

    def wire(self) -> dict[str, Any]:
        return {
            "spans": self.spans,
            "spliced": self.spliced,
            "unspliced": self.unspliced,
            "stopped": self.stopped,
            "prefilled_tokens": self.prefilled_tokens,
            "rotated_tokens": self.rotated_tokens,
            "diff_ms": round(self.diff_s * 1e3, 3),
        }

    def refuse(self, reason: str) -> DriftOutcome:
        """Not spliced, for ``reason`` (the prompt is prefilled exactly)."""
        self.unspliced = reason
        return self

    def settle(self, resp: DirectivesResponse) -> DriftOutcome:
        """The backend's answer to the directive of ``plan_drift``."""
        if resp.fallback:
            return self.refuse("not_cached")  # T's rows were evicted: the prefill is exact
        self.spliced = True
        self.prefilled_tokens, self.rotated_tokens = resp.prefilled_tokens, resp.rotated_tokens
        return self

    def count(self, counters: DriftCounts) -> None:
        if self.spliced:
            counters.drift_splices += 1
        elif self.unspliced is not None:
            reasons = counters.drift_unspliced
            reasons[self.unspliced] = reasons.get(self.unspliced, 0) + 1


def plan_drift(
    cached: Sequence[int], new: Sequence[int], mode: Mode
) -> tuple[DriftOutcome, DirectivesRequest | None] | None:
    """None when ``new`` continues ``cached`` as it is; else the outcome so far and the
    directive that splices the drift (None: found, but beyond the diff's bounds)."""
    if not cached:
        return None
    t0 = time.perf_counter()
    d = drift_spans(cached, new)
    spans, aligned = list(d.spans), d.aligned
    while spans and aligned - spans[-1].end < MIN_RUN:  # too short a tail to keep
        aligned = spans.pop().start
    out = DriftOutcome(stopped=d.stopped, diff_s=time.perf_counter() - t0)
    out.spans = [
        {"start": s.start, "end": s.end, "replacement_tokens": len(s.replacement), "kind": s.kind}
        for s in spans
    ]
    if not spans:
        if d.stopped in ("max_gap", "max_spans") and len(cached) - aligned > MIN_RUN:
            return out.refuse(d.stopped), None  # it differs, but beyond the diff's bounds
        return None
    req = DirectivesRequest(
        tokens=list(cached[:aligned]),
        directives=[
            Directive(start=s.start, end=s.end, replacement=list(s.replacement), mode=mode)
            for s in spans
        ],
        fallback=True,
    )
    return out, req
