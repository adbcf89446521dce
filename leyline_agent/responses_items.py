"""Responses API items and the chat messages they stand for (both sides, no torch).

``/v1/responses`` is served through the chat route, and the agent-side wrappers run their
policies on chat messages; both read a request's ``input`` with the same rules:

- a message (``{"role", "content"}``, ``type: "message"`` optional): ``developer`` and
  ``system`` become a system message, ``user`` a user message, ``assistant`` an assistant
  message; content a string or a list of ``input_text`` / ``output_text`` parts (joined);
- ``function_call`` items (``call_id``, ``name``, ``arguments``) join the assistant message
  before them (or open one with ``content: null``) as its ``tool_calls``, ids = ``call_id``;
- ``function_call_output`` (``call_id``, ``output``) becomes a ``tool`` message.

``responses_messages(body)`` is what a whole request stands for on the agent side (the
``instructions`` as a system message first). ``input_messages(items)`` is that reading (``RequestError`` naming the item at fault);
``message_of_item(items)`` says which message each item landed in, so ``edited_items`` can
write a policy's edits of those messages back into the items. ``reply_message(output)`` is
the chat assistant message of a response's output items (what a later turn continues).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from leyline_agent.errors import LeylineError, RequestError

__all__ = [
    "edited_items",
    "input_messages",
    "message_of_item",
    "reply_message",
    "responses_messages",
]

_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
_MESSAGE_ROLES = {"user": "user", "assistant": "assistant", "system": "system"}
_MESSAGE_ROLES["developer"] = "system"


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError("must be a string or a list of text parts", where)
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError(f"{kind!r} parts are not supported (text only)", f"{where}[{j}]")
        if not isinstance(part.get("text"), str):
            raise RequestError("must be a string", f"{where}[{j}].text")
        out.append(part["text"])
    return "".join(out)


def _str_field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise RequestError("must be a non-empty string", f"{where}.{key}")
    return value


def _read(
    items: str | Sequence[dict[str, Any]], where: str
) -> tuple[list[dict[str, Any]], list[int]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}], [0]
    out: list[dict[str, Any]] = []
    at_message: list[int] = []
    for k, item in enumerate(items):
        at = f"{where}[{k}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = _MESSAGE_ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise RequestError(f"unknown role {item.get('role')!r}", f"{at}.role")
            out.append({"role": role, "content": _text(item.get("content"), f"{at}.content")})
        elif kind == "function_call":
            call = {
                "id": _str_field(item, "call_id", at),
                "type": "function",
                "function": {
                    "name": _str_field(item, "name", at),
                    "arguments": _str_field(item, "arguments", at),
                },
            }
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                out.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = _text(item.get("output"), f"{at}.output")
            out.append(
                {"role": "tool", "tool_call_id": _str_field(item, "call_id", at), "content": output}
            )
        else:
            raise RequestError(f"{kind!r} items are not supported", f"{at}.type")
        at_message.append(len(out) - 1)
    return out, at_message


def input_messages(
    items: str | Sequence[dict[str, Any]], where: str = "input"
) -> list[dict[str, Any]]:
    """The chat messages of a request's ``input`` (see the module doc)."""
    return _read(items, where)[0]


def message_of_item(items: Sequence[dict[str, Any]]) -> list[int]:
    """For each item of ``items``, the index of the message it is part of."""
    return _read(items, "input")[1]


def edited_items(
    items: Sequence[dict[str, Any]], old: Sequence[dict[str, Any]], new: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """``items`` with the edits ``new`` makes to ``old`` (``input_messages(items)``, same
    length) written back: a message's text, a tool result's ``output``, a call's
    ``arguments``. ``ValueError`` for an edit items cannot carry (a role or a call changed)."""
    if len(old) != len(new):
        raise ValueError("the policy added or removed messages")
    out = [copy.deepcopy(dict(i)) for i in items]
    calls = {}
    for k, m in enumerate(message_of_item(items)):
        if old[m] == new[m]:
            continue
        item, msg = out[k], new[m]
        if msg.get("role") != old[m].get("role"):
            raise ValueError(f"message {m} changed its role")
        kind = item.get("type", "message")
        if kind == "function_call_output":
            item["output"] = _text(msg.get("content"), f"messages[{m}].content")
        elif kind == "message":
            item["content"] = _text(msg.get("content") or "", f"messages[{m}].content")
        else:  # function_call: its call in the assistant message, by id
            calls = {c["id"]: c for c in msg.get("tool_calls") or ()}
            call = calls.get(item["call_id"])
            if call is None or call["function"]["name"] != item["name"]:
                raise ValueError(f"message {m} changed its calls")
            item["arguments"] = call["function"]["arguments"]
    return out


def reply_message(output: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The chat assistant message of a response's ``output`` items (``content`` None for
    calls without text)."""
    texts = [
        p["text"] for i in output if i.get("type") == "message" for p in i.get("content") or ()
    ]
    calls = [
        {
            "id": i["call_id"],
            "type": "function",
            "function": {"name": i["name"], "arguments": i["arguments"]},
        }
        for i in output
        if i.get("type") == "function_call"
    ]
    text = "".join(texts) if texts else None
    out: dict[str, Any] = {"role": "assistant", "content": text if (text or not calls) else None}
    if calls:
        out["tool_calls"] = calls
    return out


def responses_messages(
    body: dict[str, Any],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, int]:
    """The chat messages a Responses request ``body`` stands for (``instructions`` first),
    its function tools in chat's shape, and how many head messages came from
    ``instructions``; ``LeylineError`` for a body whose history only the server has
    (``previous_response_id``), ``RequestError`` for items it cannot read."""
    if body.get("previous_response_id") is not None:
        raise LeylineError("previous_response_id: the history is stored on the server")
    instructions = body.get("instructions")
    head = [{"role": "system", "content": instructions}] if instructions else []
    tools = [
        {"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                          if k in t}}
        for t in body.get("tools") or ()
        if isinstance(t, dict) and t.get("type") == "function"
    ]  # fmt: skip
    return [*head, *input_messages(body.get("input", []))], tools or None, len(head)
