"""Leyline: KV-cache directives for agentic inference.

The agent-side API (directives, policies, wrappers) imports no torch.
"""

from leyline_agent.directives import Directive, MessageEdit, Mode, apply_directives, plan_batch
from leyline_agent.engine import EngineResult, PolicyEngine
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
from leyline_agent.http_runtime import AsyncHTTPRuntime, HTTPRuntime
from leyline_agent.session import ContextSession, Plan
from leyline_agent.trajectory import Trajectory
from leyline_agent.wrappers import wrap_openai

__all__ = [
    "AsyncHTTPRuntime",
    "ContextSession",
    "EngineResult",
    "HTTPRuntime",
    "Plan",
    "PolicyEngine",
    "Trajectory",
    "wrap_openai",
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
