"""A bounded shutdown: SIGTERM lets work finish for ``timeout_s``, then ends what is left.

uvicorn, on SIGTERM, stops listening and waits for every open response to end; a long
generation would hold the process for as long as it runs. ``DrainingServer`` starts a timer
when the shutdown begins. Until it fires, requests in flight run on (most end on their own).
When it fires, ``on_deadline`` runs (``leyline serve`` passes ``Engine.stop_generations``
and ``Worker.abandon``): every generation fails at its next token or before its next prefill
chunk (nothing of it is cached), and every request still waiting on the worker is answered
at once, without waiting for the step in progress (a prefill chunk can take seconds): each
stream ends with one clean ``data: {"error": ...}`` event (``GenerationStopped``) and
``data: [DONE]``, each non-streamed request with a 503 in OpenAI's error shape with
``Retry-After``, and the connections close. Then the app's lifespan ends (the worker is
already closed; its daemon threads do not hold the exit) and the process exits. New
connections are refused from the signal on (uvicorn stops listening); a request that
reaches a route after the deadline gets the same 503.

uvicorn's own ``timeout_graceful_shutdown`` is set ``GRACE_S`` later as a backstop: a
response still open then (a job that does not generate) is cancelled without an event.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import structlog
import uvicorn

log = structlog.get_logger(__name__)

__all__ = ["DEFAULT_SHUTDOWN_TIMEOUT_S", "GRACE_S", "DrainingServer"]

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
GRACE_S = 3.0  # after the deadline: time for the streams' error events to go out


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` whose shutdown calls ``on_deadline`` after ``timeout_s``."""

    def __init__(
        self, config: uvicorn.Config, *, timeout_s: float, on_deadline: Callable[[], None]
    ) -> None:
        if not timeout_s >= 0:
            raise ValueError(f"shutdown_timeout_s: {timeout_s} must be >= 0")
        config.timeout_graceful_shutdown = int(timeout_s + GRACE_S + 0.999)
        super().__init__(config)
        self.timeout_s, self.on_deadline = timeout_s, on_deadline

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.timeout_s, self._deadline)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _deadline(self) -> None:
        busy = len(self.server_state.connections)
        log.warning("shutdown timeout: ending what is still running", connections=busy)
        self.on_deadline()
