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

Refusals are paced too (``refusals_per_s``): every answer of 400-499 but 429 (a request the
server parsed, checked and refused) takes one from its key's bucket, which holds
``REFUSAL_BURST_S`` seconds' worth and refills at ``refusals_per_s``. While the bucket is
below one, the key's requests wait before their bodies are read (an ``asyncio`` wait: no
thread, no CPU), in arrival order, each until the bucket holds one refusal, which it takes
ahead (given back if it is answered otherwise): the key's requests then reach the server at
``refusals_per_s``. A waiting request is answered 429 (naming the limit and
``--max-key-refusals-per-s``) after ``PACED_WAIT_S``. A key whose requests are answered
stays unpaced; a key that keeps sending requests the server must refuse (regexes it cannot
run, schemas past the limits, bodies it cannot parse) gets that work done at
``refusals_per_s``, so its parsing and checks no longer take the GIL and the cores from
other tenants' requests. Its answered requests wait in the same line while it is paced.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from leyline_agent.server.errors import error_response
from leyline_agent.server.tenants import OPEN_PATHS, SCOPE_KEY

__all__ = [
    "DEFAULT_KEY_BODY_BYTES",
    "DEFAULT_KEY_REFUSALS_PER_S",
    "DEFAULT_KEY_REQUESTS",
    "KeyLimit",
    "KeyLimits",
    "RETRY_AFTER_S",
]

DEFAULT_KEY_REQUESTS = 128
DEFAULT_KEY_BODY_BYTES = 1024 * 1024
DEFAULT_KEY_REFUSALS_PER_S = 8.0
REFUSAL_BURST_S = 8.0  # a bucket holds this many seconds of refusals (64 at the default)
PACED_WAIT_S = 10.0  # a paced request waits at most this long for its turn, then 429
RETRY_AFTER_S = 1


@dataclass(frozen=True, slots=True)
class KeyLimits:
    max_requests: int = DEFAULT_KEY_REQUESTS
    max_body_bytes: int = DEFAULT_KEY_BODY_BYTES
    refusals_per_s: float = DEFAULT_KEY_REFUSALS_PER_S

    def __post_init__(self) -> None:
        if self.max_requests < 1 or self.max_body_bytes < 1:
            raise ValueError(f"key limits: {self} must be >= 1 each")
        if not self.refusals_per_s > 0 or math.isinf(self.refusals_per_s):
            raise ValueError(f"refusals_per_s: {self.refusals_per_s} must be > 0 and finite")

    @property
    def refusal_burst(self) -> float:
        return max(1.0, self.refusals_per_s * REFUSAL_BURST_S)


@dataclass(slots=True)
class _Load:
    requests: int = 0
    body_bytes: int = 0


@dataclass(slots=True)
class _Refusals:
    """A key's refusal bucket (module doc): ``level`` at ``at`` (monotonic seconds); its
    paced requests take ``turn`` one at a time while they wait for a refill."""

    level: float
    at: float
    turn: asyncio.Lock = field(default_factory=asyncio.Lock)
    waiting: int = 0

    def refill(self, now: float, limits: KeyLimits) -> float:
        self.level = min(limits.refusal_burst, self.level + (now - self.at) * limits.refusals_per_s)
        self.at = now
        return self.level


class KeyLimit:
    """Pure ASGI middleware: 429 for a key over its ``KeyLimits`` (module doc). It runs
    after ``BearerAuth`` (which puts the key in the scope)."""

    def __init__(self, app: ASGIApp, limits: KeyLimits) -> None:
        self.app, self.limits = app, limits
        self._load: dict[str, _Load] = {}  # only touched on the event loop: no lock
        self._refusals: dict[str, _Refusals] = {}  # keys refused lately (full ones dropped)

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
            await self._paced(key, scope, counted, send)
        finally:
            load.requests -= 1
            load.body_bytes -= charged
            if not load.requests and self._load.get(key) is load:
                del self._load[key]

    async def _paced(self, key: str, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the request, after its turn if ``key`` is paced; count a refusal it gets."""
        lim, now = self.limits, time.monotonic()
        bucket = self._refusals.get(key)
        if bucket is not None and bucket.refill(now, lim) >= lim.refusal_burst:
            if not bucket.waiting and not bucket.turn.locked():
                del self._refusals[key]  # full again: the key is as if never refused
            bucket = None
        reserved = False  # a paced request takes its refusal ahead, given back if answered
        if bucket is not None and (bucket.level < 1 or bucket.turn.locked() or bucket.waiting):
            if not await self._take_turn(bucket, now):
                response = error_response(
                    429, "RateLimitError",
                    f"this API key's requests were refused (4xx) more often than "
                    f"{lim.refusals_per_s:g} per second, and this one waited "
                    f"{PACED_WAIT_S:g} s for its turn; the limit is per key "
                    "(leyline serve --max-key-refusals-per-s)",
                    None, {"Retry-After": str(RETRY_AFTER_S)}, "rate_limit_exceeded",
                )  # fmt: skip
                await response(scope, receive, send)
                return
            reserved = True
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                started = True
                status = int(message["status"])
                refused = 400 <= status < 500 and status != 429
                if refused and not reserved:
                    self._count(key, -1)
                elif not refused and reserved:
                    self._count(key, +1)
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            if reserved and not started:
                self._count(key, +1)

    async def _take_turn(self, bucket: _Refusals, arrived: float) -> bool:
        """Wait, in arrival order, until ``bucket`` holds one refusal, and take it; False
        (nothing taken) past ``PACED_WAIT_S``."""
        deadline = arrived + PACED_WAIT_S
        bucket.waiting += 1
        try:
            try:
                await asyncio.wait_for(bucket.turn.acquire(), deadline - time.monotonic())
            except TimeoutError:
                return False
            try:
                level = bucket.refill(time.monotonic(), self.limits)
                need = (1 - level) / self.limits.refusals_per_s
                if need > 0:
                    if time.monotonic() + need > deadline:
                        return False
                    await asyncio.sleep(need)
                    bucket.refill(time.monotonic(), self.limits)
                bucket.level -= 1
                return True
            finally:
                bucket.turn.release()
        finally:
            bucket.waiting -= 1

    def _count(self, key: str, change: int) -> None:
        """Take a refusal from ``key``'s bucket (-1) or give a reserved one back (+1)."""
        lim, now = self.limits, time.monotonic()
        bucket = self._refusals.get(key)
        if bucket is None:
            bucket = self._refusals[key] = _Refusals(lim.refusal_burst, now)
        bucket.refill(now, lim)
        bucket.level = min(lim.refusal_burst, bucket.level + change)

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
