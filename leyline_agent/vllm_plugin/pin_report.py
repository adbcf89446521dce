"""``PinReport``: the ASGI middleware that tells a namespace's request its splice result was
lost (``usage.leyline.splice_evicted: true``, once), as ``leyline serve`` tells it.

It sits inside ``guard.LeylineGuard``, so it sees a request as vLLM will: the body with the
``cache_salt`` the guard (a session's) or the chat front (a conversation's) set. For a
completion or chat request of a Leyline namespace the route spliced in (``VLLMRoute.watched``:
a request without a salt is the anonymous namespace's), it asks the EngineCore once
(``VLLMRoute.arrive``) before vLLM sees the request, so the answer is about the rows that
request reads. Requests of other namespaces, and every request while no namespace is
watched, pass unread: nothing is parsed or asked for them.

A lost result is said in ``usage.leyline.splice_evicted`` of a JSON answer, or of a stream's
usage event (``stream_options.include_usage``; a stream without one carries no usage, as on
``leyline serve``). An answer with nothing to report is passed as it is: ``splice_evicted``
is absent there rather than ``false``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import structlog

from leyline_agent.http import guards as http_guards
from leyline_agent.http.asgi import (
    ASGIApp,
    Message,
    Receive,
    Scope,
    Send,
    annotate,
    annotating,
    is_stream,
)
from leyline_agent.namespaces import ANONYMOUS
from leyline_agent.vllm_plugin.namespace import is_leyline_salt, salt_for

__all__ = ["LOST", "PinReport"]

log = structlog.get_logger(__name__)
PATHS = ("/v1/chat/completions", "/v1/completions")
LOST: dict[str, Any] = {"usage": {"leyline": {"splice_evicted": True}}}
_ANONYMOUS_SALT = salt_for(ANONYMOUS)


class PinReport:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = getattr(getattr(scope.get("app"), "state", None), "leyline", None)
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if (
            scope["type"] != "http"
            or scope.get("method") != "POST"
            or path not in PATHS
            or route is None
            or not route.watched
        ):
            await self.app(scope, receive, send)
            return
        raw = await http_guards.read_body(receive, sys.maxsize)  # the guard bounded it
        receive = http_guards.replay(raw, receive)
        salt = _salt(raw)
        lost = False
        if salt is not None and salt in route.watched:
            try:
                lost = await route.arrive(salt)
            except Exception as e:  # noqa: BLE001 - the request is served; the failure logged
                log.error("leyline arrive failed: splice_evicted unknown", error=repr(e))
        await self.app(scope, receive, _reporting(send, LOST) if lost else send)


def _salt(raw: bytes) -> str | None:
    """The Leyline namespace (salt) a request body is served in; None: not Leyline's (a
    client's own salt, or not a JSON object)."""
    try:
        data = json.loads(raw) if raw.strip() else None
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    own = data.get("cache_salt")
    if own is None:
        return _ANONYMOUS_SALT
    return own if is_leyline_salt(own) else None


def _reporting(send: Send, fields: dict[str, Any]) -> Send:
    """An ASGI ``send`` that merges ``fields`` into a 200 JSON answer (``http.asgi.annotating``)
    or into a stream's event that carries ``usage``; any other answer passes unchanged."""
    json_answer = annotating(send, fields)
    mode, buf = "json", b""

    async def reporting(message: Message) -> None:
        nonlocal mode, buf
        if message["type"] == "http.response.start":
            mode = "stream" if message.get("status") == 200 and is_stream(message) else "json"
        if mode == "json":
            await json_answer(message)
            return
        if mode == "pass" or message["type"] != "http.response.body":
            await send(message)
            return
        buf += message.get("body", b"")
        more = message.get("more_body", False)
        head, sep, rest = buf.rpartition(b"\n\n")
        if more and not sep:
            return  # no whole event yet
        events, buf = (head + sep, rest) if more else (buf, b"")
        out, found = _usage_event(events, fields)
        if found:
            mode = "pass"  # said once
            out += buf
            buf = b""
        await send({**message, "body": out})

    return reporting


def _usage_event(events: bytes, fields: dict[str, Any]) -> tuple[bytes, bool]:
    """``events`` (whole server-sent events) with ``fields`` merged into the first one whose
    JSON carries a ``usage`` object; whether there was one."""
    parts = events.split(b"\n\n")
    for i, part in enumerate(parts):
        if not part.startswith(b"data: {") or b'"usage":' not in part:
            continue
        try:
            data = json.loads(part[6:])
        except ValueError:
            continue
        if isinstance(data, dict) and isinstance(data.get("usage"), dict):
            parts[i] = b"data: " + annotate(part[6:], fields, False)
            return b"\n\n".join(parts), True
    return events, False
