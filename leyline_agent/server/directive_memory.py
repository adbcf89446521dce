"""Idempotent directive retries on ``leyline serve``: ``directives.idempotence``, per namespace.

The rule (first answer per ``(tenant, session)`` and ``request_id``, tied to the body; another
body under the same id is a 400 naming ``request_id``; an id of another namespace is a new
id here) is the shared ``RequestMemory``'s, the same one the vLLM plugin uses. This module
only binds it to the server's types: ``DirectiveMemory.run`` is called on a worker thread,
inside the job that executes the directive, and holds the id from the lookup until the
answer is remembered (concurrent retries of an id in flight wait for the first one).
"""

from __future__ import annotations

from collections.abc import Callable

from leyline_agent.directives.idempotence import (
    DEFAULT_REMEMBERED,
    RequestMemory,
    fingerprint,
)
from leyline_agent.namespaces import Namespace
from leyline_agent.wire import DirectivesRequest, DirectivesResponse

__all__ = ["DEFAULT_REMEMBERED", "DirectiveMemory"]


class DirectiveMemory:
    """``RequestMemory`` of ``DirectivesResponse`` keyed by ``Namespace.key``."""

    def __init__(self, per_namespace: int = DEFAULT_REMEMBERED) -> None:
        self.memory: RequestMemory[DirectivesResponse] = RequestMemory(per_namespace)

    def run(
        self,
        req: DirectivesRequest,
        ns: Namespace,
        execute: Callable[[], DirectivesResponse],
    ) -> DirectivesResponse:
        """The remembered answer of ``req.request_id`` in ``ns``, or ``execute()``'s."""
        return self.memory.run(ns.key, req.request_id, fingerprint(req), execute)

    def __len__(self) -> int:
        return len(self.memory)
