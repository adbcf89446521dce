"""Tools and tool calls in the prompt of a chat template that has no tool block.

Some chat templates (SmolLM2's ChatML, most small instruct models') render neither the
request's ``tools`` nor an assistant's ``tool_calls``: they concatenate ``content`` (a call
message's ``content: null`` fails) and never read ``tools`` (the model could never call).
``render`` (``compile.py``) puts every conversation through ``prepare`` first, which asks the
template what it carries (``template_tools``: a probe render, once per template text) and
does the rest itself, by the model's setting (``setting``):

- ``hermes`` (the default): what the template does not render is written in the
  Hermes / Qwen convention, the one the forced-call grammar writes (``families``'s Hermes
  tags): the tool list goes into the system message (a system message of its own when the
  conversation has none) as one JSON object per line inside ``<tools></tools>`` with an
  instruction to answer ``<tool_call>{"name", "arguments"}</tool_call>``; an assistant's calls
  are appended to its content (``null`` renders as empty), each
  ``<tool_call>\\n{"name": F, "arguments": ARGS}\\n</tool_call>`` with ``ARGS`` the client's
  arguments text as sent (so the model's own call renders back as it wrote it); a ``tool``
  message's content becomes ``<tool_response>\\n{"tool_call_id", "name", "content"}\\n
  </tool_response>`` (``name``: the call's, found by its id in the conversation).
- ``template``: the template alone. A request with ``tools`` (or messages with calls) that
  the template cannot render is refused: 400 naming ``tools`` (or the message).

A template that renders tools and calls itself (Qwen, Llama 3, DeepSeek) is never changed.
The setting is a per-model choice: the key ``leyline_tool_format`` in the model folder's
``tokenizer_config.json`` (transformers keeps it in ``tokenizer.init_kwargs``), which
``leyline serve --tool-format`` overrides. Pure: a tokenizer in, messages out, no torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from leyline_agent.errors import RequestError
from leyline_agent.families import CHATML_HERMES

__all__ = [
    "SETTINGS",
    "SETTING_KEY",
    "TemplateTools",
    "call_text",
    "prepare",
    "set_setting",
    "setting",
    "template_tools",
]

SETTING_KEY = "leyline_tool_format"
SETTINGS = ("hermes", "template")
OPEN, CLOSE = CHATML_HERMES.tool_call_open, CHATML_HERMES.tool_call_close
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
_PROBE_TOOL, _PROBE_CALL = "leyline_probe_tool_7f3a", "leyline_probe_call_7f3a"


@dataclass(frozen=True, slots=True)
class TemplateTools:
    """What a chat template renders itself: the ``tools`` list, an assistant's ``tool_calls``."""

    tools: bool
    calls: bool


_PROBED: dict[str, TemplateTools] = {}


def _renders(tokenizer: Any, messages: list[dict[str, Any]], tools: Any, needle: str) -> bool:
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    except Exception:  # a template that fails on the probe does not carry it
        return False
    return isinstance(text, str) and needle in text


def template_tools(tokenizer: Any) -> TemplateTools:
    """Whether ``tokenizer``'s chat template renders tools and calls (a probe render per
    template text, remembered)."""
    template = getattr(tokenizer, "chat_template", None)
    key = template if isinstance(template, str) else ""
    if key not in _PROBED:
        user = {"role": "user", "content": "x"}
        tool = {"type": "function", "function": {"name": _PROBE_TOOL, "parameters": {}}}
        call = {"id": "call_probe", "type": "function",
                "function": {"name": _PROBE_CALL, "arguments": "{}"}}  # fmt: skip
        calls = [user, {"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "call_probe", "content": "y"}]  # fmt: skip
        _PROBED[key] = TemplateTools(
            tools=_renders(tokenizer, [user], [tool], _PROBE_TOOL),
            calls=_renders(tokenizer, calls, [tool], _PROBE_CALL),
        )
    return _PROBED[key]


def setting(tokenizer: Any) -> str:
    """The model's tool setting (``SETTINGS``; ``hermes`` unless its folder or the server
    says otherwise)."""
    kwargs = getattr(tokenizer, "init_kwargs", None)
    value = kwargs.get(SETTING_KEY) if isinstance(kwargs, dict) else None
    return value if value in SETTINGS else "hermes"


def set_setting(tokenizer: Any, value: str) -> None:
    """Make ``value`` the tool setting of the model ``tokenizer`` serves."""
    if value not in SETTINGS:
        raise ValueError(f"{value!r} is not one of {SETTINGS}")
    tokenizer.init_kwargs[SETTING_KEY] = value


def call_text(name: str, arguments: Any) -> str:
    """One call in the Hermes form the forced-call grammar writes (``tool_choice.py``)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments or {})
    try:
        json.loads(args)
    except ValueError:
        args = json.dumps(args, ensure_ascii=False)  # not JSON: kept, as a JSON string
    return (
        f'{OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}\n{CLOSE}'
    )


def _tools_block(tools: Sequence[dict[str, Any]]) -> str:
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more of these functions. Their signatures are "
        f"inside <tools></tools>:\n<tools>\n{lines}\n</tools>\n\nTo call one, answer with a "
        f'JSON object inside {OPEN}{CLOSE} tags, one per call:\n{OPEN}\n{{"name": '
        f'<function name>, "arguments": <arguments object>}}\n{CLOSE}'
    )


def _with_tools(messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]]) -> None:
    block = _tools_block(tools)
    if messages and messages[0]["role"] == "system":
        head = messages[0]
        text = head.get("content") or ""
        head["content"] = f"{text}\n\n{block}" if text else block
    else:
        messages.insert(0, {"role": "system", "content": block})


def _with_calls(messages: list[dict[str, Any]]) -> None:
    names: dict[str, str] = {}
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = m.pop("tool_calls")
            for c in calls:
                if c.get("id"):
                    names[c["id"]] = c["function"]["name"]
            written = "\n".join(call_text(c["function"]["name"], c["function"]["arguments"])
                                for c in calls)  # fmt: skip
            text = m.get("content") or ""
            m["content"] = f"{text}\n{written}" if text else written
        elif m["role"] == "tool":
            body = {
                "tool_call_id": m.get("tool_call_id"),
                "name": names.get(m.get("tool_call_id") or ""),
            }
            body["content"] = m.get("content") or ""
            m["content"] = (
                f"{RESPONSE_OPEN}\n{json.dumps(body, ensure_ascii=False)}\n{RESPONSE_CLOSE}"
            )
        if m.get("content") is None:
            m["content"] = ""


def prepare(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    where: str = "messages",
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to give ``tokenizer``'s chat template (see the module doc):
    unchanged when it renders tools and calls itself, else written in the Hermes form, or
    ``RequestError`` (400) naming ``tools`` (or the message) under the ``template`` setting."""
    has_calls = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if not tools and not has_calls:
        return messages, tools
    can = template_tools(tokenizer)
    if (can.tools or not tools) and (can.calls or not has_calls):
        return messages, tools
    if setting(tokenizer) == "template":
        if tools and not can.tools:
            raise RequestError(
                "this model's chat template has no tool block and its tool setting is "
                "'template' (serve it with --tool-format hermes to render tools in the "
                "Hermes form)",
                "tools",
            )
        i = next(i for i, m in enumerate(messages) if m.get("tool_calls") or m["role"] == "tool")
        raise RequestError(
            "this model's chat template cannot render tool calls or results and its tool "
            "setting is 'template'",
            f"{where}[{i}]",
        )
    out = [dict(m) for m in messages]
    if not can.calls:
        _with_calls(out)
    if tools and not can.tools:
        _with_tools(out, tools)
        tools = None
    return out, tools
