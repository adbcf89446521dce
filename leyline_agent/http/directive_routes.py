"""The Leyline routes a plugin adds to its engine's FastAPI app, one copy for vLLM and SGLang:
``POST /leyline/v1/directives``, ``GET /leyline/v1/stats``, ``POST /leyline/v1/flush``.

Each route reads its body once, checked as every Leyline front checks it: the body a guard
in front already parsed (under ``body_key`` in the ASGI scope: vLLM's guard), or else
``guards.read_json`` (size cap, JSON, text). A refused body is answered with the guard's
error and never reaches the server, so it changes no counter. The body then goes to the
server's ``DirectiveMount`` (its ``directives.service.DirectiveService`` and backend), and
its ``(status, JSON body)`` is the answer. Whatever the mount raises is answered through
``errors`` (the plugins pass ``directives.answers.error_content``, the body every Leyline
route answers); a 5xx is logged. ``/flush`` takes no fields: no body, or ``{}``.

``leyline serve`` mounts the same service on its own routes (``server/leyline_routes.py``),
because it serves per tenant and runs a directive on its engine's worker thread.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from leyline_agent.http import guards
from leyline_agent.namespaces import SESSION_HEADER

__all__ = ["DirectiveMount", "ErrorAnswer", "add_directive_routes"]

log = structlog.get_logger(__name__)

Answer = tuple[int, dict[str, Any]]
ErrorAnswer = Callable[[BaseException], Answer]


class DirectiveMount(Protocol):
    """What a plugin's server answers the three routes with."""

    async def directives(self, body: object, session_header: str | None) -> Answer:
        """``POST /leyline/v1/directives``: ``(status, JSON body)`` for a checked body."""
        ...

    async def stats(self) -> dict[str, Any]:
        """``GET /leyline/v1/stats``: the ``wire.StatsResponse`` as JSON."""
        ...

    async def flush_all(self) -> dict[str, Any]:
        """``POST /leyline/v1/flush``: the ``directives.flush.FlushResponse`` as JSON."""
        ...


def add_directive_routes(
    app: FastAPI,
    mount_of: Callable[[Request], DirectiveMount],
    errors: ErrorAnswer,
    *,
    body_key: str | None = None,
) -> None:
    """The three routes on ``app``; ``mount_of(request)`` finds the server (it may raise,
    answered as any error), ``errors`` maps an exception to its answer, ``body_key`` names
    the scope entry where a guard in front leaves the parsed body."""
    limit = guards.max_body_bytes()

    async def body_of(request: Request) -> object:
        if body_key is not None and body_key in request.scope:
            return request.scope[body_key]
        return await guards.read_json(request.headers.raw, request.receive, limit)

    async def answer(request: Request, work: Callable[[], Awaitable[Answer]]) -> Response:
        try:
            status, content = await work()
        except guards.GuardError as e:  # the body's checks: the guard's own answer
            status, headers, raw = guards.error_message(e)
            return Response(raw, status, headers, media_type="application/json")
        except Exception as e:  # noqa: BLE001 - every failure is an answer
            status, content = errors(e)
            if status >= 500:
                log.error("leyline route failed", path=request.url.path, error=repr(e))
        return JSONResponse(content, status_code=status)

    async def directives(request: Request) -> Response:
        async def work() -> Answer:
            body = await body_of(request)  # a refused body reaches no server
            mount = mount_of(request)
            return await mount.directives(body, request.headers.get(SESSION_HEADER))

        return await answer(request, work)

    async def stats(request: Request) -> Response:
        async def work() -> Answer:
            return 200, await mount_of(request).stats()

        return await answer(request, work)

    async def flush(request: Request) -> Response:
        async def work() -> Answer:
            body = await body_of(request)
            if body not in (None, {}):
                raise guards.GuardError("this route takes no fields; send no body or {}", "body")
            return 200, await mount_of(request).flush_all()

        return await answer(request, work)

    app.add_api_route("/leyline/v1/directives", directives, methods=["POST"])
    app.add_api_route("/leyline/v1/stats", stats, methods=["GET"])
    app.add_api_route("/leyline/v1/flush", flush, methods=["POST"])
