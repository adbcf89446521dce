"""``request_id`` idempotence: the first answer of each id, per namespace, tied to the body.

A client that lost the answer of a directive (a timeout, a dropped connection) retries it
with the same ``request_id``; executing it twice would splice twice (and count twice). So
every server that runs directives (``leyline serve``, the vLLM plugin) remembers, for each
executed request that has an id, a fingerprint of its body and its answer:

- the same id with the same body in the same namespace gets the first answer, and nothing
  runs again;
- the same id with another body in the same namespace is refused (400 naming
  ``request_id``): a retry must repeat the request unchanged;
- an id is looked up only in the caller's own namespace (tenant and session,
  ``Namespace.key``). An id another namespace used is simply a new id here: the answer is
  never "already used", which would tell the caller that the id exists elsewhere, and never
  the other namespace's answer (its token sequence).

Failed requests are not remembered: a failed directive changed nothing, so running its
retry is safe. Bounded: at most ``per_namespace`` ids in each namespace and ``total`` in
all (least recently used first out).

``RequestMemory.run`` is the blocking form for worker threads: it holds the id from the
lookup until the answer is remembered, so concurrent retries of an id in flight wait for
the first one and then get its answer (or, if it failed, run themselves); other ids are
not held up. An asyncio caller that already runs a namespace's directives one at a time
uses ``lookup`` and ``remember`` around its own execution. No torch, no web framework.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from leyline_agent.errors import RequestError
from leyline_agent.wire import DirectivesRequest

__all__ = [
    "DEFAULT_REMEMBERED",
    "MAX_REQUEST_ID",
    "RequestMemory",
    "check_request_id",
    "fingerprint",
]

DEFAULT_REMEMBERED = 4096
MAX_REQUEST_ID = 256


def check_request_id(value: object) -> None:
    """``RequestError`` (400) naming ``request_id`` unless it is None or 1 to 256
    printable characters."""
    if value is None:
        return
    if not (isinstance(value, str) and 0 < len(value) <= MAX_REQUEST_ID and value.isprintable()):
        raise RequestError(f"must be 1 to {MAX_REQUEST_ID} printable characters", "request_id")


def fingerprint(req: DirectivesRequest) -> str:
    """A digest of everything that decides what ``req`` does, except ``request_id`` and
    ``session`` (the namespace the memory is keyed by already holds the session)."""
    body = req.model_dump(mode="json", exclude={"request_id", "session"})
    raw = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(raw.encode("ascii")).hexdigest()


class RequestMemory[A]:
    """``(namespace key, request_id) -> (fingerprint, answer)``; thread-safe."""

    def __init__(self, per_namespace: int = DEFAULT_REMEMBERED, total: int | None = None) -> None:
        if per_namespace < 1:
            raise ValueError(f"per_namespace: {per_namespace} must be >= 1")
        self.per_namespace = per_namespace
        self.total = total if total is not None else 4 * per_namespace
        if self.total < per_namespace:
            raise ValueError(f"total: {self.total} must be >= per_namespace ({per_namespace})")
        self._spaces: dict[str, OrderedDict[str, tuple[str, A]]] = {}  # LRU per namespace
        self._order: OrderedDict[tuple[str, str], None] = OrderedDict()  # LRU over all
        self._lock = threading.Lock()  # guards _spaces, _order and _held
        self._held: dict[tuple[str, str], list] = {}  # id in flight -> [its lock, holders]

    # -- the public API ------------------------------------------------------------------
    def lookup(self, namespace: str, request_id: str | None, digest: str) -> A | None:
        """The remembered answer of ``request_id`` in ``namespace`` (None: run it).
        ``RequestError`` naming ``request_id`` if the namespace used it for
        another body."""
        if request_id is None:
            return None
        with self._lock:
            space = self._spaces.get(namespace)
            seen = space.get(request_id) if space is not None else None
            if seen is None:
                return None
            first, answer = seen
            if first != digest:
                raise RequestError(
                    f"{request_id!r} was already used for a different request; a retry must "
                    "repeat the request unchanged, a new request needs a new id",
                    "request_id",
                )
            space.move_to_end(request_id)
            self._order.move_to_end((namespace, request_id))
            return answer

    def remember(self, namespace: str, request_id: str | None, digest: str, answer: A) -> None:
        if request_id is None:
            return
        with self._lock:
            space = self._spaces.setdefault(namespace, OrderedDict())
            space[request_id] = (digest, answer)
            space.move_to_end(request_id)
            self._order[(namespace, request_id)] = None
            self._order.move_to_end((namespace, request_id))
            if len(space) > self.per_namespace:
                self._drop((namespace, next(iter(space))))
            while len(self._order) > self.total:
                self._drop(next(iter(self._order)))

    def run(
        self, namespace: str, request_id: str | None, digest: str, execute: Callable[[], A]
    ) -> A:
        """The remembered answer, or ``execute()``'s (remembered); blocking (threads)."""
        if request_id is None:
            return execute()
        with self._holding(namespace, request_id):
            answer = self.lookup(namespace, request_id, digest)
            if answer is not None:
                return answer
            answer = execute()
            self.remember(namespace, request_id, digest, answer)
            return answer

    def __len__(self) -> int:
        with self._lock:
            return len(self._order)

    # -- helpers -------------------------------------------------------------------------
    def _drop(self, key: tuple[str, str]) -> None:
        namespace, request_id = key
        del self._order[key]
        space = self._spaces[namespace]
        del space[request_id]
        if not space:
            del self._spaces[namespace]

    @contextmanager
    def _holding(self, namespace: str, request_id: str) -> Iterator[None]:
        """Hold ``(namespace, request_id)``: one holder at a time, the others wait."""
        key = (namespace, request_id)
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
