"""Token-level drift of a chat turn on ``leyline serve``: ``directives.drift_plan``, executed.

A conversation's last answer left ``T`` (its prompt and output ids, ``Conversation.tokens``)
in the cache. ``drift_turn`` (on the worker thread, in the turn's own job) plans the drift
splice of the turn's prompt against it (``plan_drift``) and executes it in the
conversation's namespace, in the turn's mode (AMORTIZE; FORGET under ``forget`` or in a
conversation marked exact). Believed only from a request that proved it holds the reply
(``Match.echoed``), as client edits; every outcome is counted in the tenant's ``Counters``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from leyline_agent.directives import Mode
from leyline_agent.directives.drift_plan import DriftOutcome, plan_drift
from leyline_agent.logs import get_logger
from leyline_agent.namespaces import Namespace
from leyline_agent.server.conversations import Match

if TYPE_CHECKING:
    from leyline_agent.server.worker import ServedEngine

__all__ = ["DriftOutcome", "drift_turn"]

log = get_logger(__name__)


def drift_turn(
    engine: ServedEngine, match: Match, new: list[int], mode: Mode, ns: Namespace
) -> DriftOutcome | None:
    """Diff and splice (worker thread); None when the prompt continues ``T`` as it is."""
    planned = plan_drift(match.conversation.tokens or (), new, mode)
    if planned is None:
        return None
    out, req = planned
    if req is not None and not match.echoed:
        out.refuse("unproven")  # the request did not show it holds the reply
    elif req is not None:
        try:
            out.settle(engine.apply_directives(req, namespace=ns))
        except Exception as exc:  # nothing changed (the engine's guarantee): prefill exactly
            log.warning("drift.error", error=f"{type(exc).__name__}: {exc}")
            out.refuse("error")
    out.count(engine.counters(ns.tenant))
    return out
