"""``leyline serve``'s operations side: request ids, one access-log line per request, and
Prometheus ``/metrics``.

- ``AccessLog`` (pure ASGI middleware, outermost): a request's ``X-Request-Id`` is kept when
  it is a plain token (``REQUEST_ID``: letters, digits and ``._:-``, at most 128) and made
  otherwise; it goes back on the response and into the request's scope
  (``SCOPE_REQUEST_ID``). Once the response is done (a stream: its last byte sent, or the
  client gone), one structlog line ``request`` at info level on ``leyline_agent.access``
  says method, route (the route's template), path, status, duration, tenant, session and
  request id, and the request is counted in ``ServerMetrics``. A request refused before
  routing (a bad key, a foreign Host) is logged too, its route ``-``.
- ``ServerMetrics``: one app's live series, in a registry of its own (several apps in one
  process never share one): requests by route, method and status, their duration, a
  generation's time to first token and end to end (``generation(result)``), and the chat
  turns' splices by source (``metrics.SpliceSources``).
- ``GET /metrics``: those series, then ``metrics.stats_text`` of the engine's whole
  counters (the same numbers as ``/leyline/v1/stats``), in Prometheus' text format.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest

from leyline_agent.logs import get_logger
from leyline_agent.metrics import SpliceSources, stats_text
from leyline_agent.namespaces import DEFAULT_TENANT
from leyline_agent.server.disconnect import run_connected
from leyline_agent.server.tenants import SCOPE_SESSION, SCOPE_TENANT

__all__ = [
    "REQUEST_ID",
    "REQUEST_ID_HEADER",
    "SCOPE_REQUEST_ID",
    "AccessLog",
    "ServerMetrics",
    "router",
]

REQUEST_ID_HEADER = "X-Request-Id"
REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
SCOPE_REQUEST_ID = "leyline.request_id"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

access = get_logger("leyline_agent.access")
router = APIRouter()


class ServerMetrics:
    """One app's live series (module doc)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "leyline_http_requests", "HTTP requests by route, method and status",
            ["route", "method", "status"], registry=self.registry,
        )  # fmt: skip
        self.duration = Histogram(
            "leyline_http_request_duration_seconds", "HTTP request duration (streams: to the "
            "last byte)", ["route"], buckets=_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.ttft = Histogram(
            "leyline_time_to_first_token_seconds", "a generation's time to its first token",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.e2e = Histogram(
            "leyline_generation_seconds", "a generation's time, start to last token",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.sources = SpliceSources()

    def request(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(route, method, str(status)).inc()
        self.duration.labels(route).observe(seconds)

    def generation(self, result: Any) -> None:
        """One finished generation (``GenerationResult``): its TTFT and end-to-end time."""
        self.ttft.observe(float(result.ttft_s))
        self.e2e.observe(float(result.e2e_s))


def metrics_of(app: Any) -> ServerMetrics | None:
    """The app's ``ServerMetrics`` (``create_app`` makes them), or None."""
    st = getattr(getattr(app, "state", None), "leyline", None)
    return getattr(st, "metrics", None)


def request_id_of(headers: list[tuple[bytes, bytes]]) -> str:
    """The client's ``X-Request-Id`` when it is a plain token, else a new one."""
    for name, value in headers:
        if name.lower() == b"x-request-id":
            given = value.decode("latin-1").strip()
            if REQUEST_ID.fullmatch(given):
                return given
    return uuid.uuid4().hex


class AccessLog:
    """Pure ASGI middleware (module doc)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id_of(scope.get("headers") or [])
        scope[SCOPE_REQUEST_ID] = rid
        start = time.perf_counter()
        status = 500  # what the client gets if the app fails before answering

        async def send_with_id(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self._done(scope, rid, status, time.perf_counter() - start)

    def _done(self, scope: dict[str, Any], rid: str, status: int, seconds: float) -> None:
        route = getattr(scope.get("route"), "path", None) or "-"
        access.info(
            "request",
            method=scope.get("method"),
            route=route,
            path=scope.get("path"),
            status=status,
            duration_ms=round(seconds * 1e3, 3),
            tenant=scope.get(SCOPE_TENANT, DEFAULT_TENANT),
            session=scope.get(SCOPE_SESSION),
            request_id=rid,
        )
        metrics = metrics_of(scope.get("app"))
        if metrics is not None:
            metrics.request(route, str(scope.get("method")), status, seconds)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    st = request.app.state.leyline
    stats = await run_connected(request, st.worker, lambda e: e.stats())
    live: ServerMetrics = st.metrics
    text = generate_latest(live.registry) + stats_text(stats, live.sources.snapshot())
    return Response(text, media_type=CONTENT_TYPE_LATEST)
