"""Token-level drift of a chat turn: diff the rendered prompt against the cached tokens, splice.

A conversation's last answer left ``T`` (its prompt and output ids, ``Conversation.tokens``)
in the cache. The turn's prompt ``N`` is rendered; where the template renders unchanged
messages differently (a stripped or empty ``<think>`` block, a changed head line), ``N``
differs from ``T`` in a few spans before the new turn. ``drift_turn`` (on the worker thread,
in the turn's own job) finds them (``directives.drift``: bounded, pure), drops the last
spans while the tail they keep is shorter than ``MIN_RUN`` tokens (a reply re-tokenized or a
tool call appended after it: a prefill of those few tokens does as well), and executes the rest
as one token-form directive on ``T[:aligned]`` in the conversation's namespace, in the turn's
mode (AMORTIZE; FORGET under ``forget`` or in a conversation marked exact), with
``fallback``. The result ``T'`` is a prefix of ``N``, so the prefill that follows hits it.

Believed only from a request that proved it holds the reply (``Match.echoed``), as client
edits. Nothing silent: a drift found but not spliced is counted by its reason in the
tenant's ``Counters.drift_unspliced`` (``unproven``, ``not_cached``, ``error``, or the
diff's bound: ``max_gap`` / ``max_spans``); a spliced one in ``drift_splices``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from leyline_agent.directives import Directive, Mode
from leyline_agent.directives.drift import MIN_RUN, drift_spans
from leyline_agent.logs import get_logger
from leyline_agent.namespaces import Namespace
from leyline_agent.server.conversations import Match
from leyline_agent.wire import Counters, DirectivesRequest

if TYPE_CHECKING:
    from leyline_agent.server.worker import ServedEngine

__all__ = ["DriftOutcome", "drift_turn"]

log = get_logger(__name__)


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


def drift_turn(
    engine: ServedEngine, match: Match, new: list[int], mode: Mode, ns: Namespace
) -> DriftOutcome | None:
    """Diff and splice (worker thread); None when the prompt continues ``T`` as it is."""
    cached = match.conversation.tokens
    if not cached:
        return None
    t0 = time.perf_counter()
    d = drift_spans(cached, new)
    spans, aligned = list(d.spans), d.aligned
    while spans and aligned - spans[-1].end < MIN_RUN:  # too short a tail to keep: a reply
        aligned = spans.pop().start  # re-tokenized, a call appended; a prefill does as well
    out = DriftOutcome(stopped=d.stopped, diff_s=time.perf_counter() - t0)
    out.spans = [
        {"start": s.start, "end": s.end, "replacement_tokens": len(s.replacement), "kind": s.kind}
        for s in spans
    ]
    counters = engine.counters(ns.tenant)
    if not spans:
        if d.stopped in ("max_gap", "max_spans") and len(cached) - aligned > MIN_RUN:
            out.unspliced = d.stopped  # it differs, but beyond the diff's bounds
            _count(counters, out.unspliced)
            return out
        return None
    if not match.echoed:
        out.unspliced = "unproven"  # the request did not show it holds the reply
        _count(counters, out.unspliced)
        return out
    req = DirectivesRequest(
        tokens=list(cached[:aligned]),
        directives=[
            Directive(start=s.start, end=s.end, replacement=list(s.replacement), mode=mode)
            for s in spans
        ],
        fallback=True,
    )
    try:
        resp = engine.apply_directives(req, namespace=ns)
    except Exception as exc:  # nothing changed (the engine's guarantee): prefill exactly
        log.warning("drift.error", error=f"{type(exc).__name__}: {exc}")
        out.unspliced = "error"
        _count(counters, out.unspliced)
        return out
    if resp.fallback:
        out.unspliced = "not_cached"  # T's rows were evicted: the prefill is exact
        _count(counters, out.unspliced)
        return out
    out.spliced = True
    out.prefilled_tokens, out.rotated_tokens = resp.prefilled_tokens, resp.rotated_tokens
    counters.drift_splices += 1
    return out


def _count(counters: Counters, reason: str) -> None:
    counters.drift_unspliced[reason] = counters.drift_unspliced.get(reason, 0) + 1
