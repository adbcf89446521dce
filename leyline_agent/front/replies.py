"""The assistant message of a chat answer, read as an engine's chat route sends it (a JSON
body or a stream), for a chat proxy (``front.chat_proxy``).

The chat front records a conversation's reply once its answer is complete
(``front.chat_turn``'s ``commit``): the reply's call ids or text are what a later request
echoes to prove it continues this conversation. ``ReplyReader`` is fed the answer's body
chunks as they pass the middleware and returns the first choice's message once the answer
has finished (a ``finish_reason``), or None for an answer that failed or was cut short;
``reading(send, commit)`` is the ASGI ``send`` that feeds it and commits the reply.
``reporting(send, fields)`` is the ``send`` that merges ``fields`` (``usage.leyline``) into a
JSON answer, or into the one event of a stream that carries ``usage``.
A stream's deltas are joined: ``content``, ``reasoning_content`` (or vLLM's ``reasoning``),
and ``tool_calls`` by their ``index`` (id, name, arguments concatenated).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from leyline_agent.http.asgi import Message, Send, annotate, annotating, is_stream

__all__ = ["ReplyReader", "reading", "reporting"]


class ReplyReader:
    def __init__(self, stream: bool) -> None:
        self.stream = stream
        self._buf = b""
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}
        self._message: dict[str, Any] | None = None
        self._finished = False

    def feed(self, chunk: bytes) -> None:
        self._buf += chunk
        if not self.stream:
            return
        *events, self._buf = self._buf.split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data: ") and line[6:].strip() != b"[DONE]":
                    self._delta(_json(line[6:]))

    def reply(self) -> dict[str, Any] | None:
        """The finished answer's assistant message, or None."""
        if not self.stream:
            choice = _first_choice(_json(self._buf))
            message = choice.get("message") if choice.get("finish_reason") else None
            return message if isinstance(message, dict) else None
        if not self._finished:
            return None
        out: dict[str, Any] = {"role": "assistant", "content": "".join(self._content)}
        if self._reasoning:
            out["reasoning_content"] = "".join(self._reasoning)
        if self._calls:
            out["tool_calls"] = [self._calls[i] for i in sorted(self._calls)]
        return out

    def _delta(self, event: Any) -> None:
        choice = _first_choice(event)
        delta = choice.get("delta")
        if isinstance(delta, dict):
            if isinstance(delta.get("content"), str):
                self._content.append(delta["content"])
            for key in ("reasoning_content", "reasoning"):
                if isinstance(delta.get(key), str):
                    self._reasoning.append(delta[key])
                    break
            for call in delta.get("tool_calls") or []:
                if isinstance(call, dict):
                    self._call(call)
        if choice.get("finish_reason"):
            self._finished = True

    def _call(self, part: dict[str, Any]) -> None:
        index = part.get("index", len(self._calls))
        call = self._calls.setdefault(
            index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
        )
        if isinstance(part.get("id"), str):
            call["id"] = part["id"]
        fn = part.get("function") or {}
        for key in ("name", "arguments"):
            if isinstance(fn.get(key), str):
                call["function"][key] += fn[key]


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _first_choice(answer: Any) -> dict[str, Any]:
    """Choice 0 of an answer or stream event (``{}`` if it has none)."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    for choice in choices or []:
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            return choice
    return {}


def reading(send: Send, commit: Callable[[dict[str, Any]], None]) -> Send:
    """A ``send`` that reads a 200 chat answer's reply as it passes (``replies``) and calls
    ``commit(reply)`` once it is complete; an answer that failed commits nothing."""
    reader: ReplyReader | None = None

    async def reading(message: Message) -> None:
        nonlocal reader
        if message["type"] == "http.response.start" and message.get("status") == 200:
            reader = ReplyReader(is_stream(message))
        elif message["type"] == "http.response.body" and reader is not None:
            reader.feed(message.get("body", b""))
            if not message.get("more_body", False):
                reply = reader.reply()
                if reply is not None:
                    commit(reply)
        await send(message)

    return reading


def reporting(send: Send, fields: dict[str, Any]) -> Send:
    """A ``send`` that merges ``fields`` into a 200 JSON answer (``http.asgi.annotating``) or
    into a stream's first event that carries ``usage`` (a stream without one: unchanged);
    any other answer passes unchanged."""
    json_answer = annotating(send, fields)
    mode, buf = "json", b""

    async def reported(message: Message) -> None:
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

    return reported


def _usage_event(events: bytes, fields: dict[str, Any]) -> tuple[bytes, bool]:
    """``events`` (whole server-sent events) with ``fields`` merged into the first one whose
    JSON carries a ``usage`` object; whether there was one."""
    parts = events.split(b"\n\n")
    for i, part in enumerate(parts):
        if not part.startswith(b"data: {") or b'"usage":' not in part:
            continue
        data = _json(part[6:])
        if isinstance(data, dict) and isinstance(data.get("usage"), dict):
            parts[i] = b"data: " + annotate(part[6:], fields, False)
            return b"\n\n".join(parts), True
    return events, False
