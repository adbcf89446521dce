"""Context policies: read a trajectory, emit message edits.

from leyline_agent.policies import Policy, StaleToolTruncation, FailedCallDetector
from leyline_agent.policies import load_policy, load_policies
"""

from .base import Policy, PolicyConfig
from .failed_call import FailedCallDetector
from .registry import BUILTIN_POLICIES, load_policies, load_policy
from .stale_tool import StaleToolTruncation

__all__ = [
    "BUILTIN_POLICIES",
    "FailedCallDetector",
    "Policy",
    "PolicyConfig",
    "StaleToolTruncation",
    "load_policies",
    "load_policy",
]
