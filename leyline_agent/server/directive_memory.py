"""Idempotent directive retries on ``leyline serve``: the ``RequestMemory`` its
``directives.service.DirectiveService`` keeps, sized by ``create_app``.

The rule (first answer per ``(tenant, session)`` and ``request_id``, tied to the body; another
body under the same id is a 400 naming ``request_id``; an id of another namespace is a new
id here) is the shared ``RequestMemory``'s, the same one the vLLM plugin uses; the service
looks ids up and remembers answers inside the worker job that executes the directive, and
the route keys that job by the namespace, so a retry of an id in flight waits for the
first one's answer.
"""

from __future__ import annotations

from leyline_agent.directives.idempotence import DEFAULT_REMEMBERED, RequestMemory
from leyline_agent.wire import DirectivesResponse

__all__ = ["DEFAULT_REMEMBERED", "DirectiveMemory"]


class DirectiveMemory:
    """The server's ``RequestMemory`` of ``DirectivesResponse``, keyed by ``Namespace.key``."""

    def __init__(self, per_namespace: int = DEFAULT_REMEMBERED) -> None:
        self.memory: RequestMemory[DirectivesResponse] = RequestMemory(per_namespace)

    def __len__(self) -> int:
        return len(self.memory)
