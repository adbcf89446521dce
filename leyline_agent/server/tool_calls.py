"""Parse the model's Hermes/Qwen-style tool calls into OpenAI ``tool_calls``.

The chat template asks the model to answer a call as
``<tool_call>{"name": "f", "arguments": {...}}</tool_call>`` (one block per call). A block
whose body is a JSON object with a string ``name`` (and ``arguments`` an object, a JSON
string of one, or absent) becomes a call; anything else - bad JSON, no name, a block left
open when generation stopped - stays in the content verbatim, so nothing the model wrote
is lost. Pure functions: no engine, no HTTP.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from leyline_agent.families import CHATML_HERMES

__all__ = ["OPEN_TAG", "CLOSE_TAG", "ParsedOutput", "new_call_id", "parse_tool_calls"]

OPEN_TAG = CHATML_HERMES.tool_call_open
CLOSE_TAG = CHATML_HERMES.tool_call_close
_BLOCK = re.compile(re.escape(OPEN_TAG) + r"(.*?)" + re.escape(CLOSE_TAG), re.DOTALL)


@dataclass(slots=True)
class ParsedOutput:
    """``content`` is None when the model only called tools (as OpenAI reports it)."""

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call(body: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(body.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            if not isinstance(json.loads(args), dict):
                return None
        except ValueError:
            return None
        arguments = args
    elif isinstance(args, dict):
        arguments = json.dumps(args, ensure_ascii=False)
    else:
        return None
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": obj["name"], "arguments": arguments},
    }


def parse_tool_calls(text: str) -> ParsedOutput:
    """Split ``text`` into content and tool calls.

    Without a well-formed call the content is ``text`` unchanged. With calls, the content
    is the text around them with trailing whitespace removed, or None when nothing is left.
    """
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    for m in _BLOCK.finditer(text):
        call = _call(m.group(1))
        if call is None:
            continue  # malformed: stays in the content
        kept.append(text[pos : m.start()])
        calls.append(call)
        pos = m.end()
    if not calls:
        return ParsedOutput(content=text)
    kept.append(text[pos:])
    content = "".join(kept).rstrip()
    return ParsedOutput(content=content if content.strip() else None, tool_calls=calls)
