"""Raw ASGI plumbing shared by the middleware of every Leyline front (no web framework).

- ``Scope``, ``Message``, ``Receive``, ``Send``, ``ASGIApp``: the ASGI callables' types.
- ``header(headers, name)``: a request's or an answer's header (names compared lowercase).
- ``with_body(scope, body)``: the scope of a request whose body was replaced (its
  ``Content-Length`` said again).
- ``send_json(send, status, content)``: answer a request with a JSON body.
- ``appending(send, extra)``: a ``send`` that adds bytes at the end of a 200 answer.
- ``annotating(send, fields)``: a ``send`` that merges ``fields`` into a 200 JSON answer, or
  into a stream's first event (``annotate``).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

__all__ = [
    "ASGIApp",
    "Message",
    "Receive",
    "Scope",
    "Send",
    "annotate",
    "annotating",
    "appending",
    "header",
    "is_stream",
    "send_json",
    "with_body",
]

Scope = MutableMapping[str, Any]  # ASGI's own definition: a JSON-like mapping
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The first header called ``name`` (lowercase), or None."""
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


def is_stream(start: Message) -> bool:
    """An answer's ``http.response.start`` says it is an event stream."""
    ctype = header(start.get("headers", ()), b"content-type") or b""
    return ctype.startswith(b"text/event-stream")


def _sized(headers: Iterable[tuple[bytes, bytes]], size: int) -> list[tuple[bytes, bytes]]:
    kept = [(k, v) for k, v in headers if k.lower() != b"content-length"]
    return [*kept, (b"content-length", str(size).encode())]


def with_body(scope: Scope, body: bytes) -> Scope:
    """``scope`` for a request whose body is now ``body`` (``Content-Length`` replaced)."""
    return {**scope, "headers": _sized(scope.get("headers", ()), len(body))}


async def send_json(send: Send, status: int, content: object) -> None:
    raw = json.dumps(content, separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": raw})


def appending(send: Send, extra: bytes) -> Send:
    """A ``send`` that adds ``extra`` at the end of a 200 answer's body."""
    ok = False

    async def appended(message: Message) -> None:
        nonlocal ok
        if message["type"] == "http.response.start":
            ok = message.get("status") == 200
            if ok:
                headers = [
                    h for h in message.get("headers", ()) if h[0].lower() != b"content-length"
                ]
                message = {**message, "headers": headers}
        elif message["type"] == "http.response.body" and ok and not message.get("more_body"):
            message = {**message, "body": message.get("body", b"") + extra}
        await send(message)

    return appended


def annotate(chunk: bytes, fields: dict[str, Any], stream: bool) -> bytes:
    """``chunk`` (a whole JSON answer, or a stream's first event) with ``fields`` merged into
    its top level (an object into an object key by key, at every depth); unchanged if it is
    not a JSON object. A stream's first event gets no ``usage``: OpenAI's streams carry it
    in their last event only."""
    if stream:
        head, sep, tail = chunk.partition(b"\n\n")
        if not head.startswith(b"data: {"):
            return chunk
        first = {k: v for k, v in fields.items() if k != "usage"}
        return b"data: " + annotate(head[6:], first, False) + sep + tail
    try:
        data = json.loads(chunk)
    except ValueError:
        return chunk
    if not isinstance(data, dict):
        return chunk
    return json.dumps(_merged(data, fields), separators=(",", ":")).encode()


def _merged(data: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    out = dict(data)
    for k, v in fields.items():
        old = out.get(k)
        out[k] = _merged(old, v) if isinstance(old, dict) and isinstance(v, dict) else v
    return out


def annotating(send: Send, fields: dict[str, Any]) -> Send:
    """A ``send`` that adds ``fields`` to a 200 answer: to the JSON object, or to the first
    event of a stream (``annotate``); any other answer passes unchanged."""
    held: dict[str, Any] = {}
    done = False

    async def annotated(message: Message) -> None:
        nonlocal done
        if done:
            await send(message)
            return
        if message["type"] == "http.response.start":
            if message.get("status") != 200:
                done = True
                await send(message)
                return
            held["start"], held["buf"] = message, b""
            return
        if message["type"] != "http.response.body" or "start" not in held:
            await send(message)
            return
        start = held["start"]
        stream = is_stream(start)
        held["buf"] += message.get("body", b"")
        more = message.get("more_body", False)
        if more and (not stream or b"\n\n" not in held["buf"]):
            return  # the whole answer, or a stream's whole first event
        body = annotate(held["buf"], fields, stream)
        headers = start.get("headers", ())
        if stream:
            headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
        else:
            headers = _sized(headers, len(body))
        done = True
        await send({**start, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": more})

    return annotated
