"""Leyline: KV-cache directives for agentic inference.

The agent-side API (directives, policies, wrappers) imports no torch. The package is one
folder per layer, the contracts at the bottom (docs/architecture.md)::

    errors, namespaces, families, wire, protocols, trajectory, chat_input,
    http_errors, edits               contracts (edits: Directive, Mode, MessageEdit)
    directives (compile, service)    message edits -> token directives; one directive
                                     service every server mounts; torch-free
    policies                         trajectory -> message edits (PolicyPipeline)
    agent                            ContextSession, wrap_openai, HTTPRuntime
    kernels                          the delta-rotation of cached RoPE keys
    engine                           the embedded inference engine (torch)
    sglang_plugin                    the same directives inside SGLang
    vllm_plugin                      the same directives inside vLLM
    server                           ``leyline serve``: the engine over HTTP
    reference                        ground-truth oracles (tests, ``leyline check``)
    testing                          test doubles and helpers (never imported by shipped code)

``tests/test_layers.py`` checks that every import goes down this list.

Deprecated names (a ``DeprecationWarning`` says so): ``PolicyEngine`` and ``EngineResult`` are
``PolicyPipeline`` and ``PipelineResult``; ``apply_directives`` is ``splice_tokens`` (the pure
``T'``; ``Engine.apply_directives`` and ``Runtime.apply_directives`` execute a request on a
cache, which is another thing).
"""

import warnings
from typing import Any

from leyline_agent.agent.http_runtime import AsyncHTTPRuntime, HTTPRuntime
from leyline_agent.agent.session import ContextSession, Plan
from leyline_agent.agent.transport import LeylineTransport
from leyline_agent.agent.wrappers import LeylineState, LeylineWrapped, leyline_state, wrap_openai
from leyline_agent.directives import Directive, MessageEdit, Mode, plan_batch, splice_tokens
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
from leyline_agent.policies.pipeline import PipelineResult, PolicyPipeline
from leyline_agent.trajectory import Trajectory

__all__ = [
    "AsyncHTTPRuntime",
    "ContextSession",
    "HTTPRuntime",
    "LeylineTransport",
    "PipelineResult",
    "Plan",
    "PolicyPipeline",
    "LeylineState",
    "LeylineWrapped",
    "Trajectory",
    "leyline_state",
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
    "plan_batch",
    "splice_tokens",
]

_DEPRECATED = {
    "PolicyEngine": "PolicyPipeline",
    "EngineResult": "PipelineResult",
    "apply_directives": "splice_tokens",
}


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED:
        new = _DEPRECATED[name]
        warnings.warn(
            f"leyline_agent.{name} is deprecated; use leyline_agent.{new}",
            DeprecationWarning,
            stacklevel=2,
        )
        return globals()[new]
    raise AttributeError(f"module 'leyline_agent' has no attribute {name!r}")
