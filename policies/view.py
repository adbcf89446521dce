"""``PipelineView``: a trajectory as one policy of a pipeline sees it.

Besides the trajectory it names ``elided``: the tool results whose content is a stub of
some policy of the pipeline (a stub is final, see ``policies/base``). Its own module so that
``base`` (``Policy.elided``) and ``observations`` (``ObservationView``) both build on it
without importing each other.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Protocol

from leyline_agent.trajectory import Trajectory

__all__ = ["PipelineView", "StubRecognizer"]


class StubRecognizer(Protocol):
    """What a view needs of a policy (``Policy`` is one)."""

    def is_stub(self, text: str, tool: str) -> bool: ...


@dataclass(frozen=True, slots=True)
class PipelineView(Trajectory):
    """A trajectory as one policy of a pipeline sees it, with ``elided``: the tool results
    whose content is a stub of some policy of the pipeline (``Policy.is_stub``)."""

    elided: frozenset[int] = frozenset()
    policies: tuple[StubRecognizer, ...] = ()  # the pipeline's (observation_view recomputes elided)

    @classmethod
    def of(cls, trajectory: Trajectory, policies: Iterable[StubRecognizer]) -> PipelineView:
        policies = tuple(policies)
        elided = frozenset(
            index
            for index, call in trajectory.result_of.items()
            if any(p.is_stub(trajectory.text(index), call.name) for p in policies)
        )
        base = {f.name: getattr(trajectory, f.name) for f in fields(Trajectory)}
        return cls(**base, elided=elided, policies=policies)
