"""The Response object and its stream, built from what the chat route answered.

``output_items(message)`` turns the chat answer's assistant message into output items: a
``message`` item with one ``output_text`` part (when the answer has text, or has neither text
nor calls), then one ``function_call`` item per tool call (``call_id`` is the chat call's id,
so a client that sends the items back echoes the ids the server's conversation matching
checks). ``responses_items.reply_message(items)`` is the inverse, the chat message a later
turn continues.

``ResponseEvents`` reads the chat route's stream (``chat.completion.chunk`` payloads) and
writes the Responses event sequence the OpenAI SDK reads: ``response.created``,
``response.in_progress``; for text ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta``... ``.done``,
``response.content_part.done``, ``response.output_item.done``; per call
``response.output_item.added``, ``response.function_call_arguments.delta`` (one per chat
arguments delta) / ``.done``, ``response.output_item.done``; then ``response.completed`` with
the whole response, or ``response.incomplete`` when the token budget cut it (``status``
``incomplete``, ``incomplete_details.reason`` ``max_output_tokens``: the chat answer's
``finish_reason`` ``length``; a call it cut is an ``incomplete`` item). An error after the
stream started is an ``error`` event then ``response.failed``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from leyline_agent.responses_items import reply_message

__all__ = [
    "ResponseEvents",
    "new_item_id",
    "output_items",
    "reply_message",
    "response_object",
    "responses_usage",
]


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def call_item(
    item_id: str,
    call: dict[str, Any],
    status: str = "completed",
    namespaces: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A ``function_call`` item; a tool flattened out of a ``namespace`` tool names it
    (``namespaces``: tool name -> namespace, ``responses_api.tool_namespaces``)."""
    fn = call["function"]
    item = {
        "id": item_id,
        "type": "function_call",
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn["arguments"] if status == "completed" else "",
        "status": status,
    }
    if namespaces and fn["name"] in namespaces:
        item["namespace"] = namespaces[fn["name"]]
    return item


def output_items(
    message: dict[str, Any], namespaces: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """The output items of the chat answer's assistant ``message`` (see the module doc)."""
    calls = message.get("tool_calls") or []
    text = message.get("content")
    items = []
    if text or not calls:
        items.append(message_item(new_item_id("msg"), text or ""))
    items.extend(call_item(new_item_id("fc"), c, namespaces=namespaces) for c in calls)
    return items


def responses_usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """Chat ``usage`` in the Responses shape. ``cache_write_tokens``: the prompt tokens this
    request prefilled (every one of them is written to the prefix cache);
    ``usage.leyline`` is kept."""
    prompt = int(chat_usage["prompt_tokens"])
    cached = int((chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    out = {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": prompt - cached},
        "output_tokens": int(chat_usage["completion_tokens"]),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": int(chat_usage["total_tokens"]),
    }
    if "leyline" in chat_usage:
        out["leyline"] = chat_usage["leyline"]
    return out


def response_object(
    head: dict[str, Any],
    output: list[dict[str, Any]],
    *,
    status: str = "completed",
    usage: dict[str, Any] | None = None,
    finish_reason: str | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A Response: ``head`` (id, model, the request's echoed settings) with ``output``; cut
    by the token budget, it is ``incomplete``, and so is a call it ends with."""
    incomplete = status == "completed" and finish_reason == "length"
    if incomplete and output and output[-1].get("type") == "function_call":
        output = [*output[:-1], {**output[-1], "status": "incomplete"}]
    body = {
        **head,
        "status": "incomplete" if incomplete else status,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "output": output,
        "usage": usage,
        "completed_at": time.time() if status == "completed" else None,
    }
    body.update(extra or {})
    return body


class ResponseEvents:
    """The Responses events of one chat stream (see the module doc). Feed each chat payload
    to ``chunk``; ``finish`` gives the closing events; ``items`` / ``reply`` /
    ``response`` are the result once finished."""

    def __init__(self, head: dict[str, Any], namespaces: dict[str, str] | None = None) -> None:
        self.head = head
        self.namespaces = namespaces  # of tools flattened out of namespace tools
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.text: list[str] = []
        self.extra: dict[str, Any] = {}
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.response: dict[str, Any] | None = None
        self._message: dict[str, Any] | None = None  # the open message item
        self._call_open: dict[str, Any] | None = None  # the open call: item id, call, index

    def event(self, type_: str, **fields: Any) -> str:
        payload = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
        return f"event: {type_}\ndata: {data}\n\n"

    def start(self) -> list[str]:
        body = response_object(self.head, [], status="in_progress")
        return [self.event("response.created", response=body),
                self.event("response.in_progress", response=body)]  # fmt: skip

    def chunk(self, payload: dict[str, Any]) -> list[str]:
        out: list[str] = []
        for key in ("leyline", "context_management"):
            if key in payload:
                self.extra[key] = payload[key]
        if payload.get("usage"):
            self.usage = responses_usage(payload["usage"])
        for choice in payload.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out += self._close_call() + self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._close_message() + self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out

    def finish(self, store: Callable[[dict[str, Any]], None] | None = None) -> list[str]:
        cut = "incomplete" if self.finish_reason == "length" else "completed"
        out = self._close_message() + self._close_call(cut)
        if not self.items:  # no text and no call: an empty message, as answered unstreamed
            out += self._open_message() + self._close_message()
        self.response = response_object(
            self.head, self.items, usage=self.usage, finish_reason=self.finish_reason,
            extra=self.extra,
        )  # fmt: skip
        if store is not None:
            store(self.response)
        cut = self.response["status"] == "incomplete"  # the token budget ran out
        last = "response.incomplete" if cut else "response.completed"
        return [*out, self.event(last, response=self.response)]

    def failed(self, error: dict[str, Any]) -> list[str]:
        code = error.get("code") or "server_error"
        failed = response_object(
            self.head, self.items, status="failed", extra={"error": {"code": "server_error",
                                                                      "message": error["message"]}},
        )  # fmt: skip
        return [
            self.event("error", code=code, message=error["message"], param=error.get("param")),
            self.event("response.failed", response=failed),
        ]

    def reply(self) -> dict[str, Any]:
        return reply_message(self.items)

    # -- items -------------------------------------------------------------------------
    def _open_message(self) -> list[str]:
        item = message_item(new_item_id("msg"), None, "in_progress")
        self._message, index = item, len(self.items)
        self.items.append(item)
        return [
            self.event("response.output_item.added", output_index=index, item=item),
            self.event(
                "response.content_part.added", item_id=item["id"], output_index=index,
                content_index=0, part=_text_part(""),
            ),
        ]  # fmt: skip

    def _text_delta(self, delta: str) -> list[str]:
        out = self._open_message() if self._message is None else []
        self.text.append(delta)
        assert self._message is not None
        return [*out, self.event(
            "response.output_text.delta", item_id=self._message["id"],
            output_index=len(self.items) - 1, content_index=0, delta=delta, logprobs=[],
        )]  # fmt: skip

    def _close_message(self) -> list[str]:
        if self._message is None:
            return []
        text, index = "".join(self.text), len(self.items) - 1
        done = message_item(self._message["id"], text)
        self.items[index], self._message = done, None
        where = {"item_id": done["id"], "output_index": index, "content_index": 0}
        return [
            self.event("response.output_text.done", **where, text=text, logprobs=[]),
            self.event("response.content_part.done", **where, part=_text_part(text)),
            self.event("response.output_item.done", output_index=index, item=done),
        ]

    def _call(self, delta: dict[str, Any]) -> list[str]:
        """One chat tool-call delta: a call's head (it has an ``id``) opens its item, and the
        arguments pieces of every delta are ``function_call_arguments.delta`` events."""
        out: list[str] = []
        if delta.get("id"):
            out += self._close_call()
            fn = delta.get("function") or {}
            call = {"id": delta["id"], "type": "function",
                    "function": {"name": fn.get("name"), "arguments": ""}}  # fmt: skip
            index, item_id = len(self.items), new_item_id("fc")
            item = call_item(item_id, call, "in_progress", self.namespaces)
            self.items.append(item)
            self._call_open = {"id": item_id, "call": call, "index": index}
            out.append(self.event("response.output_item.added", output_index=index, item=item))
        piece = (delta.get("function") or {}).get("arguments") or ""
        if piece and self._call_open is not None:
            self._call_open["call"]["function"]["arguments"] += piece
            where = {"item_id": self._call_open["id"], "output_index": self._call_open["index"]}
            out.append(self.event("response.function_call_arguments.delta", **where, delta=piece))
        return out

    def _close_call(self, status: str = "completed") -> list[str]:
        if self._call_open is None:
            return []
        opened, self._call_open = self._call_open, None
        item_id, call, index = opened["id"], opened["call"], opened["index"]
        done = {**call_item(item_id, call, "completed", self.namespaces), "status": status}
        self.items[index] = done
        args = call["function"]["arguments"]
        where = {"item_id": item_id, "output_index": index}
        return [
            self.event("response.function_call_arguments.done", **where, arguments=args),
            self.event("response.output_item.done", output_index=index, item=done),
        ]
