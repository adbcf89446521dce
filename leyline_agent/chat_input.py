"""The one canonical form of a chat's messages and tools: what every route renders.

The chat route (``/v1/chat/completions``) and the message-form directive route
(``/leyline/v1/directives``) render the same conversation with the chat template; a splice
lands in the cache only if both produce the same tokens. Clients send more than the
template needs - the OpenAI Agents SDK marks every tool ``"strict": true``, SDK message
objects dumped to dicts carry ``refusal``, ``annotations``, ``audio``, ``function_call``:
``None`` - and a template that renders a tool with ``tojson`` would print such keys into
the prompt. So both routes reduce their input to this form first, and nothing else:

- a message keeps ``role`` (OpenAI's ``developer`` becomes ``system``, its older name),
  ``content`` (text parts joined into one string; ``None`` stays ``None``), and where set
  ``name``, ``tool_call_id``, ``reasoning_content`` and ``tool_calls`` (each reduced to
  ``id``, ``type``, ``function.name``, ``function.arguments``);
- a tool keeps ``type`` and ``function.name``, ``function.description`` and
  ``function.parameters``; ``strict`` and any other key are dropped (the server does not
  enforce a schema: see docs/server.md on ``tool_choice``).

Shapes are the caller's to validate first (``chat_shapes.ChatMessage``/``ToolSpec``);
this module only projects. Pure, no torch, no pydantic models.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["canonical_message", "canonical_messages", "canonical_tool", "canonical_tools"]

_OPTIONAL_KEYS = ("name", "tool_call_id", "reasoning_content")
_FUNCTION_KEYS = ("name", "description", "parameters")


def _text(content: Any) -> Any:
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, Mapping) and "text" in p)
    return content


def _tool_call(call: Mapping[str, Any]) -> dict[str, Any]:
    fn = call.get("function") or {}
    out: dict[str, Any] = {}
    if call.get("id") is not None:
        out["id"] = call["id"]
    out["type"] = call.get("type") or "function"
    out["function"] = {"name": fn.get("name"), "arguments": fn.get("arguments")}
    return out


def canonical_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """``message`` reduced to what the chat template renders (see the module doc)."""
    role = message.get("role")
    out: dict[str, Any] = {
        "role": "system" if role == "developer" else role,
        "content": _text(message.get("content")),
    }
    for key in _OPTIONAL_KEYS:
        if message.get(key) is not None:
            out[key] = message[key]
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [_tool_call(c) for c in calls]
    return out


def canonical_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [canonical_message(m) for m in messages]


def canonical_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    """``tool`` reduced to ``type`` and the function's name, description and parameters."""
    fn = tool.get("function") or {}
    return {
        "type": tool.get("type") or "function",
        "function": {k: fn[k] for k in _FUNCTION_KEYS if fn.get(k) is not None},
    }


def canonical_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The tools to render, or None when there are none (an empty list renders as none)."""
    return [canonical_tool(t) for t in tools] if tools else None
