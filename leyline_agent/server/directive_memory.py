"""Idempotent directive retries: the first answer of each ``request_id``, per tenant.

A client that lost the answer of a directive (a timeout, a dropped connection) retries it
with the same ``request_id``; executing it twice would splice twice (and count twice). So
the answer of every executed request with an id is remembered, and a retry gets that
answer without executing anything. A retry whose body differs (another directive under an
old id) is refused with 400 naming ``request_id``. Failed requests are not remembered: a
failed directive changed nothing, so running its retry is safe.

``DirectiveMemory.run`` is called on the worker thread, inside the job that executes
the directive, so looking up, executing and remembering are one step: two concurrent
retries cannot both execute. Bounded: at most ``per_tenant`` ids per tenant (LRU).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable

from leyline_agent.namespaces import Namespace
from leyline_agent.server.errors import RequestError
from leyline_agent.wire import DirectivesRequest, DirectivesResponse

__all__ = ["DEFAULT_REMEMBERED", "DirectiveMemory", "check_request_id", "fingerprint"]

DEFAULT_REMEMBERED = 4096
_MAX_ID = 256


def check_request_id(value: str | None) -> None:
    if value is not None and not (0 < len(value) <= _MAX_ID and value.isprintable()):
        raise RequestError(f"must be 1 to {_MAX_ID} printable characters", "request_id")


def fingerprint(req: DirectivesRequest, ns: Namespace) -> str:
    """A digest of everything that decides what ``req`` does, except its ``request_id``."""
    body = req.model_dump(mode="json", exclude={"request_id", "session"})
    body["session"] = ns.session
    raw = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(raw.encode("ascii")).hexdigest()


class DirectiveMemory:
    """``(tenant, request_id) -> (fingerprint, answer)``; used on the worker thread only."""

    def __init__(self, per_tenant: int = DEFAULT_REMEMBERED) -> None:
        if per_tenant < 1:
            raise ValueError(f"per_tenant: {per_tenant} must be >= 1")
        self.per_tenant = per_tenant
        self._tenants: dict[str, OrderedDict[str, tuple[str, DirectivesResponse]]] = {}

    def run(
        self,
        req: DirectivesRequest,
        ns: Namespace,
        execute: Callable[[], DirectivesResponse],
    ) -> DirectivesResponse:
        """The remembered answer of ``req.request_id``, or ``execute()``'s (remembered)."""
        if req.request_id is None:
            return execute()
        digest = fingerprint(req, ns)
        seen = self._tenants.setdefault(ns.tenant, OrderedDict())
        if req.request_id in seen:
            first, answer = seen[req.request_id]
            if first != digest:
                raise RequestError(
                    f"{req.request_id!r} was already used for a different request; "
                    "a retry must repeat the request unchanged, a new request needs a new id",
                    "request_id",
                )
            seen.move_to_end(req.request_id)
            return answer
        answer = execute()
        seen[req.request_id] = (digest, answer)
        while len(seen) > self.per_tenant:
            seen.popitem(last=False)
        return answer

    def __len__(self) -> int:
        return sum(len(v) for v in self._tenants.values())
