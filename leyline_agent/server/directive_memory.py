"""Idempotent directive retries: the first answer of each ``request_id``, per tenant.

A client that lost the answer of a directive (a timeout, a dropped connection) retries it
with the same ``request_id``; executing it twice would splice twice (and count twice). So
the answer of every executed request with an id is remembered, and a retry gets that
answer without executing anything. A retry whose body differs (another directive under an
old id) is refused with 400 naming ``request_id``. Failed requests are not remembered: a
failed directive changed nothing, so running its retry is safe.

``DirectiveMemory.run`` is called on a worker thread, inside the job that executes the
directive, and holds the id (per tenant) from the lookup until the answer is remembered:
with several worker threads, a concurrent retry of an id in flight waits for the first
one, then gets its answer (or, if it failed, runs itself); two retries never both execute.
Other ids are not held up. Bounded: at most ``per_tenant`` ids per tenant (LRU).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

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
    """``(tenant, request_id) -> (fingerprint, answer)``; thread-safe (see the module doc)."""

    def __init__(self, per_tenant: int = DEFAULT_REMEMBERED) -> None:
        if per_tenant < 1:
            raise ValueError(f"per_tenant: {per_tenant} must be >= 1")
        self.per_tenant = per_tenant
        self._tenants: dict[str, OrderedDict[str, tuple[str, DirectivesResponse]]] = {}
        self._lock = threading.Lock()  # guards _tenants and _held
        self._held: dict[tuple[str, str], list] = {}  # id in flight -> [its lock, holders]

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
        with self._holding(ns.tenant, req.request_id):
            with self._lock:
                seen = self._tenants.setdefault(ns.tenant, OrderedDict())
                if req.request_id in seen:
                    first, answer = seen[req.request_id]
                    if first != digest:
                        raise RequestError(
                            f"{req.request_id!r} was already used for a different request; a "
                            "retry must repeat the request unchanged, a new request needs a new id",
                            "request_id",
                        )
                    seen.move_to_end(req.request_id)
                    return answer
            answer = execute()
            with self._lock:
                seen[req.request_id] = (digest, answer)
                while len(seen) > self.per_tenant:
                    seen.popitem(last=False)
            return answer

    def __len__(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._tenants.values())

    @contextmanager
    def _holding(self, tenant: str, request_id: str) -> Iterator[None]:
        """Hold ``(tenant, request_id)``: one holder at a time, the others wait."""
        key = (tenant, request_id)
        with self._lock:
            entry = self._held.setdefault(key, [threading.Lock(), 0])
            entry[1] += 1
        try:
            with entry[0]:
                yield
        finally:
            with self._lock:
                entry[1] -= 1
                if not entry[1]:
                    del self._held[key]
