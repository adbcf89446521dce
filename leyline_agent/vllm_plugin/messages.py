"""Anthropic's Messages API on ``vllm serve`` through the Leyline front: the same transport as
``leyline serve``'s (``front.messages``), over the guard's chat path.

``LeylineGuard`` hands ``POST /v1/messages`` and ``/v1/messages/count_tokens`` here instead of
vLLM's own Anthropic routes (which know no ``context_management``):

- ``/v1/messages``: the body is checked and converted to a chat body (``front.messages``);
  the request goes on as a ``/v1/chat/completions`` request through the guard's chat handling
  (``chat_front``: conversations, ``context_management``, client edits and drift spliced,
  the answer annotated, the reply committed), and vLLM's chat answer, a JSON body or a
  stream, is converted back as it passes (``message_answer``; ``MessageEvents``), with
  Anthropic's hints listed in ``leyline.ignored`` (``ignored_fields``). An answer that is not
  a 200 passes unchanged.
- ``/v1/messages/count_tokens``: the prompt's tokens as vLLM's chat route renders them
  (``EditRunner.render_chat``); with ``context_management``, after the edits that would
  trigger on it as a fresh conversation (``front.turns.plan_turn``, pure), plus
  ``context_management.original_input_tokens``; its hints listed in ``leyline.ignored``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from leyline_agent.chat_input import canonical_messages
from leyline_agent.directives import http_guards
from leyline_agent.front.context_management import parse_context_management
from leyline_agent.front.messages import (
    CountTokensRequest,
    MessageEvents,
    MessagesRequest,
    chat_body,
    ignored_fields,
    message_answer,
    parse_request,
    with_ignored,
)
from leyline_agent.front.turns import plan_turn
from leyline_agent.vllm_plugin.chat_front import ChatFront, FrontTurnEngine

__all__ = ["COUNT_PATH", "MESSAGES_PATH", "count_tokens", "messages_request", "translating"]

MESSAGES_PATH = "/v1/messages"
COUNT_PATH = "/v1/messages/count_tokens"
CHAT_FIELDS = frozenset({"top_k"})  # what vLLM's chat route takes beyond OpenAI's


def messages_request(raw: bytes) -> tuple[MessagesRequest, bytes]:
    """The checked request and the chat body it becomes (``RequestError`` naming a field)."""
    req = parse_request(MessagesRequest, http_guards.parse_json(raw) if raw.strip() else None)
    return req, json.dumps(chat_body(req, CHAT_FIELDS)).encode()


async def count_tokens(front: ChatFront, raw: bytes) -> dict[str, Any]:
    """``/v1/messages/count_tokens``'s answer (module doc)."""
    req = parse_request(CountTokensRequest, http_guards.parse_json(raw) if raw.strip() else None)
    body = chat_body(req, CHAT_FIELDS)
    messages, tools = body["messages"], body.get("tools")
    canon = canonical_messages(messages)
    engine = FrontTurnEngine(front.runner, asyncio.get_running_loop(), messages, canon, {})

    def counted() -> dict[str, Any]:
        def n(ms: list[dict[str, Any]]) -> int:
            return len(engine.render(ms, tools))

        original = n(canon)
        specs = parse_context_management(body.get("context_management"), front.count)
        if not specs:
            return {"input_tokens": original}
        plan = plan_turn(canon, None, specs, "off", n, tools)
        return {
            "input_tokens": n(plan.served),
            "context_management": {"original_input_tokens": original},
        }

    return with_ignored(await asyncio.to_thread(counted), ignored_fields(req))


Send = Callable[[dict[str, Any]], Awaitable[None]]


def translating(send: Send, req: MessagesRequest) -> Send:
    """An ASGI ``send`` that turns a 200 chat answer into a Message, or a chat stream into
    Anthropic's events (module doc), listing ``req``'s hints in ``leyline.ignored``
    (``ignored_fields``); any other answer passes unchanged."""
    held: dict[str, Any] = {}
    model, notes = req.model, ignored_fields(req)
    events = MessageEvents(model, notes)
    buf = b""

    async def body(data: bytes, more: bool) -> None:
        await send({"type": "http.response.body", "body": data, "more_body": more})

    async def translated(message: dict[str, Any]) -> None:
        nonlocal buf
        if message["type"] == "http.response.start":
            if message.get("status") != 200:
                held["pass"] = True
                await send(message)
                return
            ctype = dict((k.lower(), v) for k, v in message.get("headers", ())).get(
                b"content-type", b""
            )
            held["start"], held["stream"] = message, ctype.startswith(b"text/event-stream")
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
            out = json.dumps(with_ignored(message_answer(json.loads(buf), model), notes)).encode()
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
        out_parts: list[str] = []
        for event in complete:
            for line in event.split(b"\n"):
                if not line.startswith(b"data: ") or line[6:].strip() == b"[DONE]":
                    continue
                payload = json.loads(line[6:])
                if "error" in payload:
                    out_parts.extend(events.failed(payload["error"]))
                    held["ended"] = True
                elif "ended" not in held:
                    out_parts.extend(events.chunk(payload))
        if not more and "ended" not in held:
            out_parts.extend(events.finish())
        await body("".join(out_parts).encode(), more)

    return translated
