"""Anthropic's Messages API in front of an engine's own chat route (the vLLM plugin's front):
the same transport as ``leyline serve``'s (``front.messages``), over a chat proxy
(``front.chat_proxy``).

- ``messages_request``: the body checked and converted to a chat body (``front.messages``);
  the request goes on as a ``/v1/chat/completions`` request through the proxy's chat
  handling, and the engine's chat answer, a JSON body or a stream, is converted back as it
  passes (``translating``: ``message_answer``, ``MessageEvents``), with Anthropic's hints
  listed in ``leyline.ignored`` (``ignored_fields``). An answer that is not a 200 passes
  unchanged.
- ``count_tokens``: ``/v1/messages/count_tokens``'s answer, the prompt's tokens as the
  engine's chat route renders them (``EditRunner.render_chat``), counted as ``leyline
  serve`` counts them (``front.messages.count_input_tokens``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from leyline_agent.chat_input import canonical_messages
from leyline_agent.front import messages as anthropic
from leyline_agent.front.chat_proxy import ChatFront, FrontTurnEngine
from leyline_agent.http.asgi import Message, Send, is_stream
from leyline_agent.http.guards import parse_json

__all__ = [
    "COUNT_PATH",
    "MESSAGES_PATH",
    "count_tokens",
    "messages_request",
    "translating",
]

MESSAGES_PATH = "/v1/messages"
COUNT_PATH = "/v1/messages/count_tokens"
CHAT_FIELDS = frozenset({"top_k"})  # what the engine's chat route takes beyond OpenAI's


def messages_request(raw: bytes) -> tuple[anthropic.MessagesRequest, bytes]:
    """The checked request and the chat body it becomes (``RequestError`` naming a field)."""
    req = anthropic.parse_request(
        anthropic.MessagesRequest, parse_json(raw) if raw.strip() else None
    )
    return req, json.dumps(anthropic.chat_body(req, CHAT_FIELDS)).encode()


async def count_tokens(front: ChatFront, raw: bytes) -> dict[str, Any]:
    """``/v1/messages/count_tokens``'s answer (module doc)."""
    req = anthropic.parse_request(
        anthropic.CountTokensRequest, parse_json(raw) if raw.strip() else None
    )
    body = anthropic.chat_body(req, CHAT_FIELDS)
    messages, tools = body["messages"], body.get("tools")
    canon = canonical_messages(messages)
    engine = FrontTurnEngine(front.runner, asyncio.get_running_loop(), messages, canon, {})

    def counted() -> dict[str, Any]:
        def n(ms: list[dict[str, Any]]) -> int:
            return len(engine.render(ms, tools))

        cm = body.get("context_management")
        return anthropic.count_input_tokens(canon, canon, cm, tools, n, front.count)

    return anthropic.with_ignored(await asyncio.to_thread(counted), anthropic.ignored_fields(req))


def translating(send: Send, req: anthropic.MessagesRequest) -> Send:
    """An ASGI ``send`` that turns a 200 chat answer into a Message, or a chat stream into
    Anthropic's events (module doc), listing ``req``'s hints in ``leyline.ignored``
    (``front.messages.ignored_fields``); any other answer passes unchanged."""
    held: dict[str, Any] = {}
    model, notes = req.model, anthropic.ignored_fields(req)
    events = anthropic.MessageEvents(model, notes)
    buf = b""

    async def body(data: bytes, more: bool) -> None:
        await send({"type": "http.response.body", "body": data, "more_body": more})

    async def translated(message: Message) -> None:
        nonlocal buf
        if message["type"] == "http.response.start":
            if message.get("status") != 200:
                held["pass"] = True
                await send(message)
                return
            held["start"], held["stream"] = message, is_stream(message)
            return
        if held.get("pass") or message["type"] != "http.response.body":
            await send(message)
            return
        start, stream = held["start"], held["stream"]
        buf += message.get("body", b"")
        more = bool(message.get("more_body", False))
        others = [(k, v) for k, v in start.get("headers", ())
                  if k.lower() not in (b"content-length", b"content-type")]  # fmt: skip
        if not stream:
            if more:
                return
            out = json.dumps(
                anthropic.with_ignored(anthropic.message_answer(json.loads(buf), model), notes)
            ).encode()
            headers = [*others, (b"content-type", b"application/json"),
                       (b"content-length", str(len(out)).encode())]  # fmt: skip
            await send({**start, "headers": headers})
            await body(out, False)
            return
        if "started" not in held:
            held["started"] = True
            await send({**start, "headers": [*others, (b"content-type", b"text/event-stream")]})
            await body("".join(events.start()).encode(), True)
        *complete, buf = buf.split(b"\n\n")
        parts: list[str] = []
        for chunk in complete:
            for line in chunk.decode().split("\n"):
                parts.extend(events.line(line))
        if not more and not events.ended:
            parts.extend(events.finish())
        await body("".join(parts).encode(), more)

    return translated
