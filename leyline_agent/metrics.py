"""Leyline's Prometheus series, the same on every front (``leyline serve``'s ``/metrics``, and
the vLLM plugin's series on ``vllm serve``'s).

Two parts:

- ``stats_metrics(stats, sources)``: the cumulative counters of ``/leyline/v1/stats`` (a
  ``wire.StatsResponse``, the whole server's) as metric families, read at scrape time so the
  two can never disagree: prompt / cached / prefilled / generated tokens, splices by mode and
  source, rotated and repaired rows, fallbacks, directive errors, evicted rows, pins, cache
  size, drift not spliced by reason. A splice's source is ``directive`` (the directive
  route), ``client_edit`` (an in-place edit the server found), ``body_edit`` (a chat body's
  declared ``leyline.edits``), ``context_management`` or ``drift`` (``front.chat_turn``):
  ``SpliceSources`` counts the chat turns' own from their answers, and the directive route's
  are the rest of the engine's splice counts.
- ``SpliceSources``: that per-source count (thread-safe), fed with each chat turn's
  ``leyline`` answer field.
- ``stats_text``: those families in Prometheus' text format (what a ``/metrics`` appends).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest

from leyline_agent.wire import StatsResponse

__all__ = ["SOURCES", "SpliceSources", "stats_metrics", "stats_text"]

SOURCES = ("directive", "client_edit", "body_edit", "context_management", "drift")
_TOKENS = {
    "prompt_tokens": "prompt tokens of generation requests",
    "cached_tokens": "prompt tokens served from the prefix cache",
    "prefilled_tokens": "prompt tokens prefilled (computed)",
    "generated_tokens": "tokens generated",
    "rotated_tokens": "cache rows re-rotated by splices",
    "repaired_tokens": "tail rows recomputed by repair splices",
    "evicted_tokens": "cache rows evicted",
}
_EVENTS = {
    "requests": "generation requests served by the engine",
    "fallbacks": "directives that fell back to a re-prefill",
    "directive_errors": "directives that failed (the cache unchanged)",
    "pin_evictions": "splice results evicted before their session came back",
}


class SpliceSources:
    """Splices made by chat turns, by ``(source, mode)`` (module doc)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}

    def add(self, source: str, mode: str, n: int = 1) -> None:
        if n <= 0:
            return
        with self._lock:
            self._counts[(source, mode)] = self._counts.get((source, mode), 0) + n

    def turn(self, leyline: dict[str, Any] | None, usage: dict[str, Any] | None) -> None:
        """Count one chat turn's splices from its answer (``ChatTurn.prepared``): ``leyline``
        (its ``directives`` by kind) and ``usage`` (its ``splices`` by mode, the drift's
        among them)."""
        if not leyline:
            return
        declared = bool(leyline.get("edits"))
        by_mode: dict[str, int] = {}
        for d in leyline.get("directives") or []:
            kind = d.get("kind")
            source = "context_management" if kind == "context_management" else "client_edit"
            if source == "client_edit" and declared:
                source = "body_edit"
            for mode, n in (d.get("splices") or {}).items():
                self.add(source, mode, int(n))
                by_mode[mode] = by_mode.get(mode, 0) + int(n)
        for mode, n in ((usage or {}).get("splices") or {}).items():
            self.add("drift", mode, int(n) - by_mode.get(mode, 0))

    def snapshot(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._counts)


def stats_metrics(
    stats: StatsResponse, sources: dict[tuple[str, str], int] | None = None, prefix: str = "leyline"
) -> Iterator[Metric]:
    """The metric families of ``stats`` (module doc); ``sources``: ``SpliceSources.snapshot``."""
    for key, doc in _TOKENS.items():
        c = CounterMetricFamily(f"{prefix}_{key}", doc)
        c.add_metric([], float(getattr(stats, key)))
        yield c
    for key, doc in _EVENTS.items():
        c = CounterMetricFamily(f"{prefix}_{key}", doc)
        c.add_metric([], float(getattr(stats, key)))
        yield c
    splices = CounterMetricFamily(
        f"{prefix}_splices", "splices by mode and source", labels=["mode", "source"]
    )
    by_source = sources or {}
    for mode, total in sorted(stats.splices.items()):
        turns = 0
        for source in SOURCES[1:]:
            n = by_source.get((source, mode), 0)
            turns += n
            splices.add_metric([mode, source], float(n))
        splices.add_metric([mode, "directive"], float(max(0, total - turns)))
    yield splices
    unspliced = CounterMetricFamily(
        f"{prefix}_drift_unspliced", "drifts found and not spliced, by reason", labels=["reason"]
    )
    for reason, n in sorted(stats.drift_unspliced.items()):
        unspliced.add_metric([reason], float(n))
    yield unspliced
    for key, doc in (
        ("cache_tokens", "rows in the prefix cache"),
        ("cache_capacity_tokens", "the prefix cache's capacity in rows"),
        ("pinned_tokens", "rows pinned for their session (splice results)"),
    ):
        g = GaugeMetricFamily(f"{prefix}_{key}", doc)
        g.add_metric([], float(getattr(stats, key)))
        yield g


class _Families:
    """A registry-shaped view of ready metric families (for ``generate_latest``)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def stats_text(stats: StatsResponse, sources: dict[tuple[str, str], int] | None = None) -> bytes:
    """``stats_metrics`` in Prometheus' text format."""
    return generate_latest(_Families(list(stats_metrics(stats, sources))))  # type: ignore[arg-type]
