"""The ``Policy`` base class: read a trajectory, return message edits.

A policy never mutates the trajectory; it returns ``MessageEdit``s and the ``PolicyEngine``
applies them. Policies compose in order: each one sees the trajectory with the edits of
the policies before it applied (so a later policy sees earlier stubs). A policy must be
idempotent on its own output: run on a trajectory it already edited, it returns edits that
change nothing (the engine drops no-op edits). That is what makes the engine idempotent.

Knobs live in a frozen pydantic ``Config``; ``Policy.from_knobs`` validates them and turns a
bad knob into a ``PolicyError`` naming ``<policy>.<knob>``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, ValidationError

from leyline_agent.directives import MessageEdit
from leyline_agent.errors import PolicyError
from leyline_agent.trajectory import Trajectory

__all__ = ["Policy", "PolicyConfig", "validate_knobs"]


class PolicyConfig(BaseModel):
    """Base of policy knob models: frozen, unknown knobs rejected."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)


class Policy(ABC):
    """Subclass, set ``name``, implement ``edits``."""

    name: ClassVar[str]
    config_class: ClassVar[type[PolicyConfig] | None] = None  # the knobs, for `policies list`

    @abstractmethod
    def edits(self, trajectory: Trajectory) -> list[MessageEdit]:
        """The edits this policy wants on ``trajectory`` (which it must not modify)."""

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
