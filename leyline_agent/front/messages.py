"""Anthropic's Messages API (``/v1/messages``) as a transport over the chat turn.

Every Leyline front serves ``/v1/messages`` through its chat route, so the template, the
tool-call parse, conversations, client edits, drift splices and ``context_management``
(``front.context_management``) apply unchanged; this module only converts, with no engine:

- ``chat_body(req, chat_fields)``: a checked ``MessagesRequest`` becomes the body of a
  ``/v1/chat/completions`` request. ``system`` is a system message; a user message's
  ``text`` blocks a user message, its ``tool_result`` blocks ``tool`` messages (in block
  order; ``is_error: true`` prefixes the result with ``ERROR_PREFIX``, as the chat wire has
  no such flag); an assistant message's ``thinking`` blocks a ``<think>`` span at the head of
  its content (what the templates render and ``clear_thinking_20251015`` clears), its
  ``text`` blocks the content and its ``tool_use`` blocks ``tool_calls`` (ids kept).
  ``tools`` become function tools, ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none``
  the chat ``tool_choice`` (``disable_parallel_tool_use``: ``parallel_tool_calls: false``),
  ``metadata.user_id`` the chat ``user``; ``top_k`` goes through where the chat route takes
  it. ``ignored_fields(req)``: Anthropic's hints accepted and acted on by nothing, as the
  answer's ``leyline.ignored`` lists them: ``cache_control`` (on blocks, tools or the
  request: every prompt's prefix is cached), ``service_tier`` (one tier here),
  ``metadata.user_id`` (used for nothing). Anything else that cannot be honoured (images,
  documents, server tools, ``redacted_thinking``, ``thinking`` enabled, ``stop_sequences``,
  whose stop the chat answer does not name) is a 400 naming the field; unknown fields too.
- ``message_answer(chat, model)``: a chat answer becomes a Message: a ``thinking`` block
  (``reasoning_content``), a ``text`` block, ``tool_use`` blocks (arguments parsed);
  ``stop_reason`` ``end_turn`` / ``max_tokens`` / ``tool_use``; ``usage`` with
  ``input_tokens`` (prefilled: the prompt less what the cache held), ``cache_read_input_tokens``
  and ``output_tokens``; ``context_management.applied_edits`` and Leyline's ``leyline`` field
  where the chat answer has them.
- ``MessageEvents``: the chat stream's chunks become Anthropic's event sequence
  (``message_start``, ``content_block_start`` / ``_delta`` / ``_stop`` per block,
  ``message_delta`` with the stop reason, the usage and ``context_management``,
  ``message_stop``; an in-band chat error becomes an ``error`` event).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from leyline_agent.errors import RequestError
from leyline_agent.front.context_management import parse_context_management
from leyline_agent.front.turns import plan_turn
from leyline_agent.http_errors import field_path

__all__ = [
    "ERROR_PREFIX",
    "CountTokensRequest",
    "MessageEvents",
    "MessagesRequest",
    "chat_body",
    "count_input_tokens",
    "message_answer",
    "ignored_fields",
    "new_message_id",
    "parse_request",
    "with_ignored",
]

ERROR_PREFIX = "Error: "  # a tool_result with is_error: true, as the chat prompt shows it
_STRICT = ConfigDict(frozen=True, extra="forbid")
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn"}


class _Common(BaseModel):
    model_config = _STRICT

    model: str = Field(min_length=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    context_management: Any = None
    leyline: Any = None  # Leyline's per-request options, as on chat


class MessagesRequest(_Common):
    max_tokens: int = Field(ge=1)
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1)
    stop_sequences: list[str] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    cache_control: dict[str, Any] | None = None  # a hint: every prompt's prefix is cached


class CountTokensRequest(_Common):
    pass


def parse_request[M: BaseModel](model: type[M], raw: Any) -> M:
    """``raw`` checked as ``model``; the first problem is a ``RequestError`` naming its field."""
    if not isinstance(raw, dict):
        raise RequestError("the body must be a JSON object", "body")
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        raise RequestError(err.get("msg", "invalid value"), field_path(err.get("loc", ()))) from e


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


# ---- request -> chat --------------------------------------------------------------------
def chat_body(req: _Common, chat_fields: set[str] | frozenset[str]) -> dict[str, Any]:
    """The chat completions body ``req`` becomes (module doc). ``chat_fields``: the fields
    the front's chat route takes (``top_k`` goes through only where it does)."""
    body: dict[str, Any] = {"model": req.model, "messages": _messages(req)}
    if req.tools is not None:
        body["tools"] = [_tool(t, k) for k, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body.update(_tool_choice(req.tool_choice))
    _check_thinking(req.thinking)
    for key in ("context_management", "leyline"):
        value = getattr(req, key)
        if value is not None:
            body[key] = value
    if not isinstance(req, MessagesRequest):
        return body
    if req.stop_sequences:
        raise RequestError(
            "not served on /v1/messages (the chat answer does not name the stop it met)",
            "stop_sequences",
        )
    body["max_tokens"] = req.max_tokens
    for key in ("temperature", "top_p"):
        if getattr(req, key) is not None:
            body[key] = getattr(req, key)
    if req.top_k is not None:
        if "top_k" not in chat_fields:
            raise RequestError("this server does not sample with top_k", "top_k")
        body["top_k"] = req.top_k
    if req.metadata:
        unknown = sorted(set(req.metadata) - {"user_id"})
        if unknown:
            raise RequestError(f"unknown field {unknown[0]!r}", f"metadata.{unknown[0]}")
        if req.metadata.get("user_id") is not None:
            body["user"] = _str(req.metadata["user_id"], "metadata.user_id")
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


_CACHED = "every prompt's prefix is cached here; a cache breakpoint changes nothing"
_HINTS = {
    "service_tier": "one service tier here",
    "metadata.user_id": "an end-user id for Anthropic's abuse monitoring; not used here",
    "cache_control": _CACHED,
}


def ignored_fields(req: _Common) -> list[dict[str, str]]:
    """Anthropic's hints in ``req`` that nothing acts on (module doc), as
    ``leyline.ignored`` lists them: ``[{"field", "reason"}]``, each field by its path."""
    found: list[tuple[str, str]] = []  # (the field's path, its hint)
    if isinstance(req, MessagesRequest):
        top = {"service_tier": req.service_tier, "cache_control": req.cache_control,
               "metadata.user_id": (req.metadata or {}).get("user_id")}  # fmt: skip
        found += [(name, name) for name, value in top.items() if value is not None]
    marks = [*(_cache_controls(req.system, "system") if isinstance(req.system, list) else []),
             *_cache_controls(req.messages, "messages"), *_cache_controls(req.tools, "tools")]  # fmt: skip
    found += [(path, "cache_control") for path in marks]
    return [{"field": path, "reason": _HINTS[hint]} for path, hint in found]


def _cache_controls(items: Any, where: str) -> list[str]:
    """The paths of the ``cache_control`` marks on ``items`` (blocks, messages or tools) and
    on the blocks nested in their ``content`` (a ``tool_result``'s)."""
    out: list[str] = []
    for i, item in enumerate(items if isinstance(items, list) else []):
        if not isinstance(item, dict):
            continue
        if item.get("cache_control") is not None:
            out.append(f"{where}[{i}].cache_control")
        out += _cache_controls(item.get("content"), f"{where}[{i}].content")
    return out


def with_ignored(answer: dict[str, Any], notes: list[dict[str, str]]) -> dict[str, Any]:
    """``answer`` (a Message, or a chat answer or chunk) with ``notes`` added to its
    ``leyline.ignored``."""
    if not notes:
        return answer
    leyline = dict(answer.get("leyline") or {})
    leyline["ignored"] = [*leyline.get("ignored", []), *notes]
    return {**answer, "leyline": leyline}


def _messages(req: _Common) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.system is not None:
        text = req.system if isinstance(req.system, str) else _texts(req.system, "system")
        out.append({"role": "system", "content": text})
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        role, content = m.get("role"), m.get("content")
        unknown = sorted(set(m) - {"role", "content"})
        if unknown:
            raise RequestError(f"unknown field {unknown[0]!r}", f"{where}.{unknown[0]}")
        if role not in ("user", "assistant"):
            raise RequestError("must be 'user' or 'assistant'", f"{where}.role")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            out.extend(_user(content, where) if role == "user" else [_assistant(content, where)])
        else:
            raise RequestError("must be a string or a list of blocks", f"{where}.content")
    return out


def _block(b: Any, where: str, allowed: dict[str, frozenset[str]]) -> str:
    """The type of block ``b``, its keys checked against ``allowed[type]``."""
    if not isinstance(b, dict) or not isinstance(b.get("type"), str):
        raise RequestError("each block is an object with a 'type'", f"{where}.type")
    kind = b["type"]
    keys = allowed.get(kind)
    if keys is None:
        raise RequestError(
            f"block type {kind!r} is not served here; served: {sorted(allowed)}", f"{where}.type"
        )
    unknown = sorted(set(b) - keys - {"type", "cache_control"})
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r}", f"{where}.{unknown[0]}")
    return kind


_TEXT = {"text": frozenset({"text", "citations"})}
_USER = {**_TEXT, "tool_result": frozenset({"tool_use_id", "content", "is_error"})}
_ASSISTANT = {
    **_TEXT,
    "thinking": frozenset({"thinking", "signature"}),
    "tool_use": frozenset({"id", "name", "input"}),
}


def _texts(blocks: list[Any], where: str) -> str:
    parts = []
    for k, b in enumerate(blocks):
        _block(b, f"{where}[{k}]", _TEXT)
        if b.get("citations"):
            raise RequestError("citations are not served here", f"{where}[{k}].citations")
        parts.append(_str(b.get("text"), f"{where}[{k}].text"))
    return "".join(parts)


def _user(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for k, b in enumerate(blocks):
        at = f"{where}.content[{k}]"
        if _block(b, at, _USER) == "text":
            if b.get("citations"):
                raise RequestError("citations are not served here", f"{at}.citations")
            texts.append(_str(b.get("text"), f"{at}.text"))
            continue
        if texts:
            out.append({"role": "user", "content": "".join(texts)})
            texts = []
        content = b.get("content", "")
        text = content if isinstance(content, str) else None
        if isinstance(content, list):
            text = _texts(content, f"{at}.content")
        if text is None:
            raise RequestError("must be a string or a list of text blocks", f"{at}.content")
        is_error = b.get("is_error")
        if is_error is not None and not isinstance(is_error, bool):
            raise RequestError("must be a boolean", f"{at}.is_error")
        call = _str(b.get("tool_use_id"), f"{at}.tool_use_id")
        text = f"{ERROR_PREFIX}{text}" if is_error else text
        out.append({"role": "tool", "tool_call_id": call, "content": text})
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _assistant(blocks: list[Any], where: str) -> dict[str, Any]:
    thinking: list[str] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for k, b in enumerate(blocks):
        at = f"{where}.content[{k}]"
        kind = _block(b, at, _ASSISTANT)
        if kind == "text":
            texts.append(_str(b.get("text"), f"{at}.text"))
        elif kind == "thinking":
            thinking.append(_str(b.get("thinking"), f"{at}.thinking"))
        else:
            args = b.get("input", {})
            if not isinstance(args, dict):
                raise RequestError("must be an object", f"{at}.input")
            function = {"name": _str(b.get("name"), f"{at}.name"), "arguments": json.dumps(args)}
            calls.append({"id": _str(b.get("id"), f"{at}.id"), "type": "function",
                          "function": function})  # fmt: skip
    head = f"<think>{''.join(thinking)}</think>\n" if thinking else ""
    message: dict[str, Any] = {"role": "assistant", "content": head + "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _tool(t: Any, k: int) -> dict[str, Any]:
    where = f"tools[{k}]"
    if not isinstance(t, dict):
        raise RequestError("must be an object", where)
    if t.get("type") not in (None, "custom"):
        raise RequestError(
            f"server tool {t.get('type')!r} is not served here (function tools only)",
            f"{where}.type",
        )
    unknown = sorted(set(t) - {"type", "name", "description", "input_schema", "cache_control"})
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r}", f"{where}.{unknown[0]}")
    schema = t.get("input_schema")
    if not isinstance(schema, dict):
        raise RequestError("must be a JSON schema object", f"{where}.input_schema")
    function = {"name": _str(t.get("name"), f"{where}.name"), "parameters": schema}
    if t.get("description") is not None:
        function["description"] = _str(t["description"], f"{where}.description")
    return {"type": "function", "function": function}


def _tool_choice(choice: dict[str, Any]) -> dict[str, Any]:
    kind = choice.get("type")
    unknown = sorted(set(choice) - {"type", "name", "disable_parallel_tool_use"})
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r}", f"tool_choice.{unknown[0]}")
    out: dict[str, Any]
    if kind == "auto":
        out = {"tool_choice": "auto"}
    elif kind == "any":
        out = {"tool_choice": "required"}
    elif kind == "none":
        out = {"tool_choice": "none"}
    elif kind == "tool":
        name = _str(choice.get("name"), "tool_choice.name")
        out = {"tool_choice": {"type": "function", "function": {"name": name}}}
    else:
        raise RequestError("must be 'auto', 'any', 'tool' or 'none'", "tool_choice.type")
    single = choice.get("disable_parallel_tool_use")
    if single is not None:
        if not isinstance(single, bool):
            raise RequestError("must be a boolean", "tool_choice.disable_parallel_tool_use")
        out["parallel_tool_calls"] = not single
    return out


def _check_thinking(thinking: dict[str, Any] | None) -> None:
    if thinking is None:
        return
    if thinking.get("type") != "disabled" or set(thinking) != {"type"}:
        raise RequestError(
            "only {'type': 'disabled'} is served: the chat template decides whether the "
            "model thinks, and no thinking budget is enforced",
            "thinking.type",
        )


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise RequestError("must be a string", where)
    return value


# ---- chat -> message ----------------------------------------------------------------------
def _tool_use(call: dict[str, Any], cut: bool) -> dict[str, Any]:
    """A chat tool call as a ``tool_use`` block. A call the token budget cut (``cut``) may hold
    half-written arguments: its ``input`` is then ``{}``, as the answer's ``max_tokens`` stop
    reason says (the stream's ``input_json_delta`` events carry what was written)."""
    f = call.get("function") or {}
    try:
        args = json.loads(f.get("arguments") or "{}")
    except ValueError:
        args = None
    if not isinstance(args, dict):
        if not cut:  # a finished answer's calls are well-formed: the chat parse checks them
            raise RuntimeError(f"tool call {call.get('id')!r}: arguments are not a JSON object")
        args = {}
    return {"type": "tool_use", "id": call["id"], "name": f.get("name"), "input": args}


def _usage(chat_usage: dict[str, Any] | None) -> dict[str, Any]:
    u = chat_usage or {}
    prompt = int(u.get("prompt_tokens") or 0)
    cached = int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    out: dict[str, Any] = {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": int(u.get("completion_tokens") or 0),
    }
    if "leyline" in u:
        out["leyline"] = u["leyline"]
    return out


def _extras(chat: dict[str, Any]) -> dict[str, Any]:
    return {k: chat[k] for k in ("context_management", "leyline") if k in chat}


def _merged(extras: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """``extras`` updated with a later chunk's ``more``; ``leyline`` merged key by key (the
    first chunk lists the ignored fields, the last one the turn)."""
    out = {**extras, **more}
    if "leyline" in extras and "leyline" in more:
        out["leyline"] = {**extras["leyline"], **more["leyline"]}
    return out


def message_answer(chat: dict[str, Any], model: str) -> dict[str, Any]:
    """The Message a chat completion (``chat``, parsed JSON) becomes (module doc)."""
    choice = chat["choices"][0]
    m = choice["message"]
    content: list[dict[str, Any]] = []
    if m.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": m["reasoning_content"], "signature": ""})
    if m.get("content"):
        content.append({"type": "text", "text": m["content"]})
    cut = choice["finish_reason"] == "length"
    content.extend(_tool_use(c, cut) for c in m.get("tool_calls") or [])
    return {
        "id": new_message_id(),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": _STOP_REASONS.get(choice["finish_reason"], "end_turn"),
        "stop_sequence": None,
        "usage": _usage(chat.get("usage")),
        **_extras(chat),
    }


def event(kind: str, data: dict[str, Any]) -> str:
    """One server-sent event of Anthropic's stream."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


class MessageEvents:
    """Anthropic's event sequence for one chat stream: ``start()``, then ``chunk(payload)``
    per chat chunk, then ``finish()`` (or ``failed(error)``); ``message_delta`` carries
    ``context_management`` and ``leyline`` (with ``ignored``) as the chunks gave them.
    ``line(text)`` reads one line of the chat stream (``ended``: a failure ended it)."""

    def __init__(self, model: str, ignored: list[dict[str, str]] | None = None) -> None:
        self.model = model
        self._index = -1
        self._open: str | None = None  # the open block's kind
        self._calls: dict[int, int] = {}  # chat tool-call index -> block index
        self._finish = "stop"
        self._usage: dict[str, Any] | None = None
        # ``ignored``: fields to list in ``leyline.ignored`` beyond what the chunks list
        self._extras: dict[str, Any] = with_ignored({}, ignored or [])
        self.ended = False  # the chat stream failed: ``failed`` was said, nothing follows

    def start(self) -> Iterator[str]:
        message = {
            "id": new_message_id(), "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }  # fmt: skip
        yield event("message_start", {"message": message})

    def chunk(self, payload: dict[str, Any]) -> Iterator[str]:
        self._extras = _merged(self._extras, _extras(payload))
        if payload.get("usage"):
            self._usage = payload["usage"]
        for choice in payload.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                yield from self._delta("thinking", "thinking_delta", "thinking",
                                       delta["reasoning_content"])  # fmt: skip
            if delta.get("content"):
                yield from self._delta("text", "text_delta", "text", delta["content"])
            for call in delta.get("tool_calls") or []:
                yield from self._tool_delta(call)
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]

    def line(self, text: str) -> Iterator[str]:
        """The events for one line of the chat stream: ``chunk`` for a ``data:`` event,
        ``failed`` for an error event (after which nothing more is said)."""
        if self.ended or not text.startswith("data: ") or text[6:].strip() == "[DONE]":
            return
        payload = json.loads(text[6:])
        if "error" in payload:
            self.ended = True
            yield from self.failed(payload["error"])
        else:
            yield from self.chunk(payload)

    def finish(self) -> Iterator[str]:
        yield from self._close()
        delta = {"stop_reason": _STOP_REASONS.get(self._finish, "end_turn"), "stop_sequence": None}
        yield event("message_delta", {"delta": delta, "usage": _usage(self._usage),
                                      **self._extras})  # fmt: skip
        yield event("message_stop", {})

    def failed(self, error: dict[str, Any]) -> Iterator[str]:
        yield from self._close()
        kind = error.get("type") or "api_error"
        yield event("error", {"error": {"type": kind, "message": error.get("message", "")}})

    def _open_block(self, kind: str, block: dict[str, Any]) -> Iterator[str]:
        yield from self._close()
        self._index += 1
        self._open = kind
        yield event("content_block_start", {"index": self._index, "content_block": block})

    def _close(self) -> Iterator[str]:
        if self._open is not None:
            yield event("content_block_stop", {"index": self._index})
            self._open = None

    def _delta(self, kind: str, delta_type: str, key: str, text: str) -> Iterator[str]:
        if self._open != kind:
            start = {"type": kind, kind: ""}
            if kind == "thinking":
                start["signature"] = ""
            yield from self._open_block(kind, start)
        yield event("content_block_delta",
                    {"index": self._index, "delta": {"type": delta_type, key: text}})  # fmt: skip

    def _tool_delta(self, call: dict[str, Any]) -> Iterator[str]:
        k = int(call.get("index", len(self._calls)))
        f = call.get("function") or {}
        if k not in self._calls:
            block = {"type": "tool_use", "id": call.get("id"), "name": f.get("name"), "input": {}}
            yield from self._open_block(f"tool_use:{k}", block)
            self._calls[k] = self._index
        elif self._open != f"tool_use:{k}":
            raise RuntimeError(f"tool call {k}: its deltas are not contiguous")
        if f.get("arguments"):
            delta = {"type": "input_json_delta", "partial_json": f["arguments"]}
            yield event("content_block_delta", {"index": self._index, "delta": delta})


def count_input_tokens(
    messages: list[dict[str, Any]],
    canon: list[dict[str, Any]],
    context_management: object,
    tools: list[dict[str, Any]] | None,
    n: Callable[[list[dict[str, Any]]], int],
    count: Callable[[str], int],
) -> dict[str, Any]:
    """``{"input_tokens": n(messages)}`` (``n``: a list's prompt tokens), or with
    ``context_management`` (``count``: a text's tokens) the tokens of ``canon`` (the
    canonical form of ``messages``) after the edits that would trigger on it as a fresh
    conversation, and ``context_management.original_input_tokens`` (``leyline serve``'s ``count_tokens`` and the vLLM plugin's)."""
    original = n(messages)
    specs = parse_context_management(context_management, count)
    if not specs:
        return {"input_tokens": original}
    plan = plan_turn(canon, None, specs, "off", n, tools)
    return {
        "input_tokens": n(plan.served),
        "context_management": {"original_input_tokens": original},
    }
