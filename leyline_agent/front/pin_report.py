"""``PinReport``: the pure ASGI middleware that tells a namespace's request its splice result
was lost (``usage.leyline.splice_evicted: true``, once), as ``leyline serve`` tells it, on an
engine that keeps its own routes (the vLLM plugin).

It sits inside ``front.door.FrontDoor``, so it sees a request as the engine will: the body
with the salt the door (a session's) or the chat front (a conversation's) set. For a
completion or chat request of a Leyline namespace the directive route spliced in
(``PinWatch.watched``: a request without a salt is the anonymous namespace's), it asks the
engine once (``PinWatch.arrive``) before the engine sees the request, so the answer is about
the rows that request reads. Requests of other namespaces, and every request while no
namespace is watched, pass unread: nothing is parsed or asked for them.

A lost result is said in ``usage.leyline.splice_evicted`` of a JSON answer, or of a stream's
usage event (``front.replies.reporting``; a stream without one carries no usage, as on
``leyline serve``). An answer with nothing to report is passed as it is: ``splice_evicted``
is absent there rather than ``false``.
"""

from __future__ import annotations

import sys
from typing import Any

import structlog

from leyline_agent.front.door import EngineAttachment, PinWatch
from leyline_agent.front.replies import reporting
from leyline_agent.http import guards
from leyline_agent.http.asgi import ASGIApp, Receive, Scope, Send
from leyline_agent.namespaces import ANONYMOUS

__all__ = ["LOST", "PinReport", "PinWatch"]

log = structlog.get_logger(__name__)
PATHS = ("/v1/chat/completions", "/v1/completions")
LOST: dict[str, Any] = {"usage": {"leyline": {"splice_evicted": True}}}


class PinReport:
    def __init__(self, app: ASGIApp, attachment: EngineAttachment) -> None:
        self.app, self.engine = app, attachment

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pins = self.engine.pins(scope)
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if (
            scope["type"] != "http"
            or scope.get("method") != "POST"
            or path not in PATHS
            or pins is None
            or not pins.watched
        ):
            await self.app(scope, receive, send)
            return
        raw = await guards.read_body(receive, sys.maxsize)  # the door bounded it
        receive = guards.replay(raw, receive)
        salt = self._salt(raw)
        lost = False
        if salt is not None and salt in pins.watched:
            try:
                lost = await pins.arrive(salt)
            except Exception as e:  # noqa: BLE001 - the request is served; the failure logged
                log.error("leyline arrive failed: splice_evicted unknown", error=repr(e))
        await self.app(scope, receive, reporting(send, LOST) if lost else send)

    def _salt(self, raw: bytes) -> str | None:
        """The Leyline namespace (salt) a request body is served in; None: not Leyline's (a
        client's own salt, or not a JSON object)."""
        data = guards.json_object(raw)
        if data is None:
            return None
        own = data.get(self.engine.salt_field)
        if own is None:
            return self.engine.salt_for(ANONYMOUS)
        return own if isinstance(own, str) and self.engine.is_leyline_salt(own) else None
