"""``{"leyline": {"edits": [...]}}`` on ``/v1/chat/completions``: edits that ride with the turn.

Checked and applied the same way by every Leyline front (``leyline serve``'s chat route, the
vLLM plugin's chat front, ``front.chat_proxy``).

A client that edits messages the server has cached (``wrap_openai``'s and
``LeylineTransport``'s policies, or the agent's own in-place edits they pass on) sends the
edits inside the chat request, in the ``MessageEdit`` form::

    {"leyline": {"client_edits": "amortize",
                 "edits": [{"index": 3, "content": "[stale]", "policy": "stale-tool"}]}}

Each edit replaces the ``content`` (and, on an assistant message with tool calls, the
``tool_calls``, same ids and names) of ``messages[index]``. The server:

1. checks them before anything runs (a 400 naming the field, ``leyline.edits[0].index``;
   ``index`` strictly an integer; at most ``MAX_BODY_EDITS`` edits);
2. applies them to the request's messages (a client that already sent the edited text sends
   the same list: applying is idempotent);
3. turns client-edit splicing on for this request (``client_edits`` defaults to
   ``amortize`` when edits are sent; ``"off"`` beside edits is a 400, the edits could not
   act; an edit's own ``mode`` / ``budget`` counts too: the turn splices in the most exact
   mode asked for, ``modes.turn_mode``, a REPAIR budget riding as ``repair_budget``) and tells the conversation matching that these messages are declared edits
   (``chat_context``), so the turn's own job splices them before its prefill: no separate
   ``POST /leyline/v1/directives``.

``outcome(edits, ctx)`` says what came of them, for the answer's ``leyline.edits``:
``declared`` (the indices sent) and ``spliced`` (those the turn's directive covered). A
declared edit of a conversation the server no longer holds (evicted, restarted) is served
exactly (a re-prefill), logged at warning level and reported with ``fallback: true``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from leyline_agent.directives.core import MessageEdit
from leyline_agent.directives.modes import turn_mode
from leyline_agent.errors import RequestError
from leyline_agent.http_errors import field_path
from leyline_agent.logs import get_logger
from leyline_agent.trajectory import apply_edits, call_ids

__all__ = ["MAX_BODY_EDITS", "RequestEdits", "outcome", "request_edits"]

MAX_BODY_EDITS = 1024

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class RequestEdits:
    """A chat request's ``leyline`` field split: the options ``chat_context`` reads, the
    messages with the edits applied, and the declared indices."""

    options: Any
    messages: list[dict[str, Any]]
    edits: tuple[MessageEdit, ...] = ()
    declared: frozenset[int] = field(default_factory=frozenset)


def request_edits(leyline: Any, messages: list[dict[str, Any]]) -> RequestEdits:
    """Split ``leyline.edits`` off the request's ``leyline`` field, checked and applied."""
    if not isinstance(leyline, dict) or "edits" not in leyline:
        return RequestEdits(leyline, messages)
    options = {k: v for k, v in leyline.items() if k != "edits"}
    raw = leyline["edits"]
    if not isinstance(raw, list):
        raise RequestError("must be a list of message edits", "leyline.edits")
    if len(raw) > MAX_BODY_EDITS:
        raise RequestError(f"{len(raw)} edits; at most {MAX_BODY_EDITS}", "leyline.edits")
    edits = tuple(_edit(e, k, messages) for k, e in enumerate(raw))
    seen: set[int] = set()
    for k, e in enumerate(edits):
        if e.index in seen:
            raise RequestError(f"message {e.index} is edited twice", f"leyline.edits[{k}].index")
        seen.add(e.index)
    if not edits:
        return RequestEdits(options or None, messages)
    mode = options.get("client_edits")
    if mode == "off":
        raise RequestError(
            "edits need client_edits 'amortize' or 'forget' (with 'off' they could not act)",
            "leyline.client_edits",
        )
    asked = [(e.mode, e.budget) for e in edits]
    if mode is not None:
        asked.append((mode, options.get("repair_budget")))
    if any(m is not None for m, _ in asked):
        splice, budget = turn_mode(asked, "amortize")
        options["client_edits"] = splice.value
        if budget is not None:
            options["repair_budget"] = budget
    options.setdefault("client_edits", "amortize")
    return RequestEdits(options, apply_edits(messages, edits), edits, frozenset(seen))


def outcome(edits: RequestEdits, edited: list[int] | None, session: str) -> dict[str, Any]:
    """What came of the declared edits: ``edited`` is the turn's client-edited indices
    (``None``: the request was served without conversation tracking)."""
    declared = sorted(edits.declared)
    spliced = [i for i in declared if edited is not None and i in edited]
    fallback = len(spliced) < len(declared)
    if fallback:
        log.warning(
            "request_edits.fallback",
            session=session,
            declared=declared,
            spliced=spliced,
            why="no cached conversation of this session matched (a declared edit keeps its "
            "message's role, a tool result its tool_call_id): served by a re-prefill",
        )
    return {"declared": declared, "spliced": spliced, "fallback": fallback}


def _edit(raw: Any, k: int, messages: list[dict[str, Any]]) -> MessageEdit:
    where = ("leyline", "edits", k)
    if not isinstance(raw, dict):
        raise RequestError("each edit is an object", field_path(where))
    body = {"policy": "client", **raw}
    try:
        edit = MessageEdit.model_validate(body, strict=True)
    except ValidationError as e:
        err = e.errors()[0]
        loc = tuple(x for x in err.get("loc", ()) if x != "__root__")
        raise RequestError(err.get("msg", "invalid value"), field_path((*where, *loc))) from e
    if edit.index >= len(messages):
        raise RequestError(
            f"{edit.index} is past the end of messages ({len(messages)})",
            field_path((*where, "index")),
        )
    msg = messages[edit.index]
    if edit.tool_calls is not None:
        _check_calls(edit.tool_calls, msg, (*where, "tool_calls"))
    if edit.content is not None and msg.get("role") == "tool" and not edit.content:
        raise RequestError("a tool result cannot be emptied", field_path((*where, "content")))
    return edit


def _check_calls(
    calls: list[dict[str, Any]], msg: dict[str, Any], where: tuple[str | int, ...]
) -> None:
    """An in-place edit of an assistant message's calls: the same ids and names, in order
    (tool results pair with the ids; another call is another message, not an edit)."""
    if msg.get("role") != "assistant" or not msg.get("tool_calls"):
        raise RequestError("only an assistant message with tool calls has calls", field_path(where))
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError("each call has a function with a name", field_path((*where, j)))
        if not isinstance(fn.get("arguments", ""), str):
            raise RequestError("must be a string", field_path((*where, j, "function", "arguments")))
    names = [c["function"]["name"] for c in calls]
    if call_ids({"tool_calls": calls}) != call_ids(msg) or names != [
        c.get("function", {}).get("name") for c in msg["tool_calls"]
    ]:
        raise RequestError(
            "must keep the message's call ids and names, in order (an edit in place)",
            field_path(where),
        )
