"""Per-API-key limits on work in flight, checked before a request's body is read.

Every request but ``/health`` counts against the key that sent it (``tenants.SCOPE_KEY``;
on a server without keys every request counts against one shared key) from the moment its
headers arrive until its answer (or its stream) ends:

- ``max_requests``: requests in flight;
- ``max_body_bytes``: bytes of request bodies in flight, each body counted at its declared
  ``Content-Length`` (a chunked body at what has arrived so far). A key with nothing in
  flight is always admitted, so one body up to the server's body limit still goes through.

A request that would pass either limit is answered at once, before a byte of its body is
read or parsed: 429 ``RateLimitError`` with ``Retry-After`` and a message naming the limit
and its ``leyline serve`` flag. So one key sending large bodies as fast as it can gets its
parse, check and render work done a few at a time, and the other keys' requests are not
queued behind it on the event loop, the worker's threads or the cores.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from leyline_agent.server.errors import error_response
from leyline_agent.server.tenants import OPEN_PATHS, SCOPE_KEY

__all__ = [
    "DEFAULT_KEY_BODY_BYTES",
    "DEFAULT_KEY_REQUESTS",
    "KeyLimit",
    "KeyLimits",
    "RETRY_AFTER_S",
]

DEFAULT_KEY_REQUESTS = 128
DEFAULT_KEY_BODY_BYTES = 1024 * 1024
RETRY_AFTER_S = 1


@dataclass(frozen=True, slots=True)
class KeyLimits:
    max_requests: int = DEFAULT_KEY_REQUESTS
    max_body_bytes: int = DEFAULT_KEY_BODY_BYTES

    def __post_init__(self) -> None:
        if self.max_requests < 1 or self.max_body_bytes < 1:
            raise ValueError(f"key limits: {self} must be >= 1 each")


@dataclass(slots=True)
class _Load:
    requests: int = 0
    body_bytes: int = 0


class KeyLimit:
    """Pure ASGI middleware: 429 for a key over its ``KeyLimits`` (module doc). It runs
    after ``BearerAuth`` (which puts the key in the scope)."""

    def __init__(self, app: ASGIApp, limits: KeyLimits) -> None:
        self.app, self.limits = app, limits
        self._load: dict[str, _Load] = {}  # only touched on the event loop: no lock

    def in_flight(self, key: str = "") -> tuple[int, int]:
        """``(requests, body bytes)`` in flight for ``key``."""
        load = self._load.get(key)
        return (load.requests, load.body_bytes) if load else (0, 0)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        key = str(scope.get(SCOPE_KEY, ""))
        declared = Headers(scope=scope).get("content-length", "").strip()
        size = int(declared) if declared.isdigit() else 0
        load = self._load.setdefault(key, _Load())
        problem = self._over(load, size)
        if problem is not None:
            if not load.requests:
                del self._load[key]
            response = error_response(
                429, "RateLimitError", problem, None,
                {"Retry-After": str(RETRY_AFTER_S)}, "rate_limit_exceeded",
            )  # fmt: skip
            await response(scope, receive, send)
            return
        load.requests += 1
        load.body_bytes += size
        charged = size

        async def counted() -> Message:  # a chunked body is charged as it arrives
            nonlocal charged
            message = await receive()
            if not declared.isdigit() and message["type"] == "http.request":
                n = len(message.get("body", b""))
                charged += n
                load.body_bytes += n
            return message

        try:
            await self.app(scope, counted, send)
        finally:
            load.requests -= 1
            load.body_bytes -= charged
            if not load.requests and self._load.get(key) is load:
                del self._load[key]

    def _over(self, load: _Load, size: int) -> str | None:
        lim = self.limits
        if load.requests >= lim.max_requests:
            return (
                f"this API key has {load.requests} requests in flight; the limit is "
                f"{lim.max_requests} per key (leyline serve --max-key-requests)"
            )
        if load.requests and load.body_bytes + size > lim.max_body_bytes:
            return (
                f"this API key has {load.body_bytes} bytes of request bodies in flight and "
                f"this body adds {size}; the limit is {lim.max_body_bytes} per key "
                "(leyline serve --max-key-body-bytes)"
            )
        return None
