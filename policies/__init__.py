"""Context policies: read a trajectory, emit message edits.

from leyline_agent.policies import Policy, StaleToolTruncation, FailedCallDetector
from leyline_agent.policies import load_policy, load_policies, PolicyPipeline

A custom policy subclasses ``Policy`` (``name`` + ``edits(trajectory) -> list[MessageEdit]``)
and loads by ``module:Class``; ``Trajectory`` and ``MessageEdit`` are re-exported for it. One
that stubs tool results also overrides ``is_stub(text, tool)``: in a pipeline a stub is final
(no policy stubs it again or reads it as evidence; see ``policies/base``).
"""

from leyline_agent.directives import MessageEdit
from leyline_agent.trajectory import Trajectory

from .base import Policy, PolicyConfig
from .failed_call import FailedCallDetector
from .pipeline import PipelineResult, PolicyPipeline
from .registry import BUILTIN_POLICIES, load_policies, load_policy
from .stale_tool import StaleToolTruncation

__all__ = [
    "BUILTIN_POLICIES",
    "FailedCallDetector",
    "MessageEdit",
    "PipelineResult",
    "Policy",
    "PolicyPipeline",
    "PolicyConfig",
    "StaleToolTruncation",
    "Trajectory",
    "load_policies",
    "load_policy",
]
