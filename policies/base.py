"""The ``Policy`` base class: read a trajectory, return message edits.

A policy never mutates the trajectory; it returns ``MessageEdit``s and the ``PolicyPipeline``
applies them. Policies compose in order: each one sees the trajectory with the edits of
the policies before it applied (so a later policy sees earlier stubs). A policy must be
idempotent on its own output: run on a trajectory it already edited, it returns edits that
change nothing (the pipeline drops no-op edits).

A stub is final. A tool result whose content is a stub of any policy in the pipeline
(``is_stub``) is *elided*: no policy stubs it again, and none reads it as evidence (a
stubbed result is neither a success nor a failure, and its size is not the output's).
``elided(trajectory)`` gives those indices; the ``PolicyPipeline`` computes them for the
whole pipeline (a ``PipelineView``) and drops content edits of elided results. Without
that rule two policies that are each idempotent are not idempotent together: ``stale-tool``
with ``min_tokens`` leaves a small failed output alone, ``failed-call`` replaces it by a
longer stub, and on a second run ``stale-tool`` found the stub big enough to stub.

Knobs live in a frozen pydantic ``Config``; ``Policy.from_knobs`` validates them and turns a
bad knob into a ``PolicyError`` naming ``<policy>.<knob>``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from leyline_agent.directives import MessageEdit, Mode
from leyline_agent.directives.core import ImplementedMode
from leyline_agent.errors import PolicyError
from leyline_agent.trajectory import Trajectory

from .view import PipelineView

__all__ = ["Policy", "PolicyConfig", "SpliceKnobs", "validate_knobs"]


class PolicyConfig(BaseModel):
    """Base of policy knob models: frozen, unknown knobs rejected."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)


class SpliceKnobs(PolicyConfig):
    """The ``mode`` and ``budget`` knobs of a policy whose edits choose their splice:
    ``amortize``, ``repair`` (``budget``: the fraction of the tail recomputed; none: the
    server's default) or ``forget``; none: the session's or server's mode. Every edit the
    policy makes carries them (``MessageEdit.mode`` / ``budget``)."""

    mode: ImplementedMode | None = None
    budget: float | None = Field(default=None, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _budget_with_repair(self) -> SpliceKnobs:
        if self.budget is not None and self.mode is not Mode.REPAIR:
            raise ValueError("budget applies to mode 'repair' only")
        return self

    def splice(self) -> dict[str, Any]:
        """``mode`` / ``budget`` as ``MessageEdit`` fields (the ones set)."""
        return {k: v for k, v in (("mode", self.mode), ("budget", self.budget)) if v is not None}


class Policy(ABC):
    """Subclass, set ``name``, implement ``edits``."""

    name: ClassVar[str]
    config_class: ClassVar[type[PolicyConfig] | None] = None  # the knobs, for `policies list`

    @abstractmethod
    def edits(self, trajectory: Trajectory) -> list[MessageEdit]:
        """The edits this policy wants on ``trajectory`` (which it must not modify)."""

    def is_stub(self, text: str, tool: str) -> bool:
        """True if ``text`` is a stub this policy writes in place of a result of ``tool``.

        Override it in a policy that stubs tool results, so that the other policies of a
        pipeline leave its stubs alone. The default recognises nothing."""
        return False

    def view(self, trajectory: Trajectory) -> Trajectory:
        """``trajectory`` as this policy reads it: with user-role observations as tool
        results when its ``observation_prefix`` knob is set (``policies/observations``)."""
        from .observations import observation_view

        prefix = getattr(getattr(self, "config", None), "observation_prefix", None)
        return observation_view(trajectory, prefix, (self,))

    def elided(self, trajectory: Trajectory) -> frozenset[int]:
        """Indices of the tool results that are stubs: of any policy of the pipeline when
        ``trajectory`` is the pipeline's ``PipelineView``, of this policy's own otherwise."""
        if isinstance(trajectory, PipelineView):
            return trajectory.elided
        return PipelineView.of(trajectory, (self,)).elided

    def serialize(self) -> dict[str, Any]:
        """``{"name": ..., **knobs}``: enough for ``load_policy`` to rebuild the policy."""
        config = getattr(self, "config", None)
        knobs = (
            config.model_dump(mode="json", exclude={"count_tokens"})
            if isinstance(config, BaseModel)
            else {}
        )
        return {"name": self.name, **knobs}

    @classmethod
    def from_knobs(cls, **knobs: Any) -> Self:
        return cls(**knobs)

    def __repr__(self) -> str:
        knobs = ", ".join(f"{k}={v!r}" for k, v in self.serialize().items() if k != "name")
        return f"{type(self).__name__}({knobs})"


def validate_knobs[C: PolicyConfig](config_cls: type[C], policy: str, knobs: dict[str, Any]) -> C:
    """Build ``config_cls`` from ``knobs``; a bad knob raises PolicyError naming it."""
    try:
        return config_cls(**knobs)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err.get("loc", ()))
        raise PolicyError(f"{policy}.{loc}: {err.get('msg', e)} (got {err.get('input')!r})") from e
