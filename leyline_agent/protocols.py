"""Structural protocols between the layers.

Policies read a ``Trajectory`` and return ``MessageEdit``s; a ``Runtime`` (embedded engine,
HTTP to a Leyline server, or an SGLang server with the plugin) executes them. The agent
side only ever sees these protocols, never torch.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from leyline_agent.wire import DirectivesRequest, DirectivesResponse, StatsResponse


@runtime_checkable
class Runtime(Protocol):
    """The serving side as the agent-side wrappers see it (synchronous)."""

    def apply_directives(self, request: DirectivesRequest) -> DirectivesResponse: ...

    def stats(self) -> StatsResponse: ...


@runtime_checkable
class AsyncRuntime(Protocol):
    async def apply_directives(self, request: DirectivesRequest) -> DirectivesResponse: ...

    async def stats(self) -> StatsResponse: ...
