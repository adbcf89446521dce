"""Leyline: KV-cache directives for agentic inference.

The agent-side API (directives, policies, wrappers) imports no torch.
"""

from leyline_agent.directives import Directive, MessageEdit, Mode, apply_directives, plan_batch
from leyline_agent.errors import (
    CacheMissError,
    DirectiveError,
    LeylineError,
    PolicyError,
    RopeSpecError,
    RuntimeUnavailableError,
    TrajectoryError,
    UnsupportedModeError,
)

__all__ = [
    "CacheMissError",
    "Directive",
    "DirectiveError",
    "LeylineError",
    "MessageEdit",
    "Mode",
    "PolicyError",
    "RopeSpecError",
    "RuntimeUnavailableError",
    "TrajectoryError",
    "UnsupportedModeError",
    "apply_directives",
    "plan_batch",
]
