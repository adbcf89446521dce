"""``POST /v1/responses``: the request on the wire, checked, and turned into a chat request.

The Responses API is served through the chat route: ``chat_request`` turns a checked
``ResponsesRequest`` (plus the history of its ``previous_response_id``, if any) into the body of
a ``/v1/chat/completions`` request, so everything chat does - the template, tool-call
parsing, ``tool_choice``, conversations, client edits, ``context_management``, sessions -
applies to a response unchanged. A client that replays its items itself (stateless, the
Agents SDK's ``store=False`` way) and edits an earlier one is an in-place edit of the
conversation the server cached, spliced as chat splices it.

Input items become chat messages by ``responses_items.input_messages`` (the rules the
agent-side wrappers read them by too).

``instructions`` is a system message at the head (not carried over from a previous
response, as OpenAI does). Tools: ``function`` tools, and ``namespace`` tools flattened into
their function tools (a call of one names its ``namespace`` in the output item).

What OpenAI treats as a hint, for a model that writes no reasoning items, is accepted and
listed as ignored (``request_fields``; ``chat_request`` returns the notes): ``include:
["reasoning.encrypted_content"]``, ``reasoning.summary`` / ``generate_summary``, a hosted
``web_search`` tool the server cannot run (left out of the prompt), and ``reasoning.effort``
where the chat template reads no effort (where it does, it becomes chat's
``reasoning_effort``). Anything else the embedded engine cannot honour - images, files,
other item and tool types, ``background``, ``truncation: "auto"``, other ``include`` values -
is refused with a 400 naming the field, never dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from leyline_agent.responses_items import input_messages
from leyline_agent.server.errors import RequestError
from leyline_agent.server.request_fields import Ignored, check_effort

__all__ = [
    "FunctionTool",
    "ResponsesRequest",
    "chat_request",
    "input_messages",
    "responses_field",
    "tool_namespaces",
]

_REQUEST = ConfigDict(frozen=True, extra="ignore", strict=True)
_NO_REASONING = "the served model writes no reasoning items"
HOSTED_LEFT_OUT = frozenset({"web_search", "web_search_preview"})  # left out of the prompt


class FunctionTool(BaseModel):
    """A Responses function tool: flat, not nested under ``function`` as in chat."""

    model_config = _REQUEST

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(BaseModel):
    model_config = _REQUEST

    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    seed: int | None = None
    prompt_cache_key: str | None = None  # names the session where no header does
    # accepted where their value asks for nothing the engine does not do
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    conversation: Any = None
    prompt: Any = None
    # Leyline's, passed to the chat route as they are
    context_management: Any = None
    leyline: Any = None


def _refuse_unsupported(req: ResponsesRequest, effort_in_template: bool) -> list[Ignored]:
    """Refuse what cannot be honoured; the hints accepted instead, to list as ignored."""
    notes = []
    if req.background:
        raise RequestError("background responses are not supported", "background")
    for key, value in (req.reasoning or {}).items():
        if value is None:
            continue
        if key in ("summary", "generate_summary"):
            notes.append(Ignored(f"reasoning.{key}", _NO_REASONING))
        elif key == "effort":
            check_effort(value, "reasoning.effort")
            if not effort_in_template:
                notes.append(Ignored("reasoning.effort", "the chat template reads no effort"))
        else:
            raise RequestError(
                "the served model takes no such reasoning option", f"reasoning.{key}"
            )
    if req.truncation == "auto":
        raise RequestError("'auto' truncation is not supported; use 'disabled'", "truncation")
    for k, name in enumerate(req.include or ()):
        if name != "reasoning.encrypted_content":
            raise RequestError(f"{name!r} cannot be included", f"include[{k}]")
        notes.append(Ignored(f"include[{k}]", _NO_REASONING))
    if req.top_logprobs:
        raise RequestError("logprobs are not supported on /v1/responses", "top_logprobs")
    if req.max_tool_calls is not None:
        raise RequestError("max_tool_calls is not supported", "max_tool_calls")
    for name in ("conversation", "prompt"):
        if getattr(req, name) is not None:
            raise RequestError(f"{name} objects are not supported", name)
    return notes


def _function_tools(
    tools: list[dict[str, Any]] | None,
) -> list[tuple[str, dict[str, Any], str | None]]:
    """``(where, tool, namespace)`` of every function tool, those inside a ``namespace`` tool
    too; hosted tools in ``HOSTED_LEFT_OUT`` are skipped (``_chat_tools`` lists them)."""
    out: list[tuple[str, dict[str, Any], str | None]] = []
    for k, raw in enumerate(tools or ()):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind == "function":
            out.append((f"tools[{k}]", raw, None))
        elif kind == "namespace" and isinstance(raw.get("name"), str):
            inner = raw.get("tools")
            if not isinstance(inner, list):
                raise RequestError("must be a list of function tools", f"tools[{k}].tools")
            for j, t in enumerate(inner):
                if not isinstance(t, dict) or t.get("type") != "function":
                    kind = t.get("type") if isinstance(t, dict) else None
                    raise RequestError(
                        f"{kind!r} tools are not supported in a namespace (functions only)",
                        f"tools[{k}].tools[{j}]",
                    )
                out.append((f"tools[{k}].tools[{j}]", t, raw["name"]))
        elif kind not in HOSTED_LEFT_OUT:
            raise RequestError(
                f"{kind!r} tools are not supported (functions and namespaces only)", f"tools[{k}]"
            )
    return out


def tool_namespaces(tools: list[dict[str, Any]] | None) -> dict[str, str]:
    """The namespace of each flattened tool's name (what a call of it names in its item)."""
    try:
        return {t["name"]: ns for _, t, ns in _function_tools(tools) if ns is not None}
    except RequestError:
        return {}


def _chat_tools(
    tools: list[dict[str, Any]] | None, notes: list[Ignored]
) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    for k, raw in enumerate(tools):
        if isinstance(raw, dict) and raw.get("type") in HOSTED_LEFT_OUT:
            reason = f"hosted {raw['type']!r} tools cannot run here; left out of the prompt"
            notes.append(Ignored(f"tools[{k}]", reason))
    out, seen = [], set()
    for where, raw, _ in _function_tools(tools):
        tool = FunctionTool.model_validate(raw)
        if tool.name in seen:
            raise RequestError(f"a second tool named {tool.name!r}", f"{where}.name")
        seen.add(tool.name)
        fn = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestError(
        "must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}", "tool_choice"
    )


def _response_format(text: dict[str, Any] | None, chat_fields: set[str]) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    if "response_format" not in chat_fields:
        raise RequestError("only plain text output is supported by this server", "text.format")
    if not isinstance(fmt, dict):
        raise RequestError("must be an object", "text.format")
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    raise RequestError(f"unknown format type {fmt.get('type')!r}", "text.format.type")


# A chat field an error names, and the Responses field it came from (longest first).
_FIELDS = (
    ("response_format.json_schema.", "text.format."),
    ("response_format", "text.format"),
    ("tool_choice.function.name", "tool_choice.name"),
)


def responses_field(field: str | None) -> str | None:
    """The Responses name of a chat request's ``field`` (an error names what the client sent)."""
    for chat, responses in _FIELDS:
        if field is not None and field.startswith(chat):
            return responses + field[len(chat) :]
    return field


def _check_outputs_follow_calls(items: Any, history: list[dict[str, Any]]) -> None:
    """Each ``function_call_output`` answers a ``function_call`` before it (in ``items`` or
    in the previous response's conversation); else a 400 naming its ``call_id``."""
    if isinstance(items, str):
        return
    calls = {c.get("id") for m in history for c in m.get("tool_calls") or ()}
    for k, item in enumerate(items):
        if item.get("type") == "function_call":
            calls.add(item.get("call_id"))
        elif item.get("type") == "function_call_output" and item.get("call_id") not in calls:
            raise RequestError(
                f"no function_call with call_id {item.get('call_id')!r} comes before it",
                f"input[{k}].call_id",
            )


def chat_request(
    req: ResponsesRequest,
    history: list[dict[str, Any]],
    chat_fields: set[str],
    effort_in_template: bool = False,
) -> tuple[dict[str, Any], list[dict[str, Any]], list[Ignored]]:
    """(the chat body to serve, the conversation without ``instructions``: ``history`` and
    the request's input, what a later ``previous_response_id`` continues, the hints
    accepted and ignored). ``effort_in_template``: the chat template reads
    ``reasoning_effort``, so ``reasoning.effort`` goes there."""
    notes = _refuse_unsupported(req, effort_in_template)
    conversation = [*history, *input_messages(req.input)]
    _check_outputs_follow_calls(req.input, history)
    if not conversation:
        raise RequestError("must hold at least one item", "input")
    head = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {
        "model": req.model,
        "messages": [*head, *conversation],
        "stream": req.stream,
    }
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    optional = {
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "seed": req.seed,
        "user": req.user,
        "tools": _chat_tools(req.tools, notes),
        "tool_choice": _chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req.text, chat_fields),
        "context_management": req.context_management,
        "leyline": req.leyline,
        "reasoning_effort": (req.reasoning or {}).get("effort") if effort_in_template else None,
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    return body, conversation, notes
