"""``ContextSession``: per-session diffing between what the agent sends and what was sent.

The agent keeps its own, unedited history and sends all of it at every turn. The session
runs the policies on that raw list, keeps every edit it ever made (sticky: an edit once made
stays made, with the same text, so the edited history only grows, except at edits), and
tells the serving side which cached messages changed:

    plan(messages)  ->  Plan(messages_to_send, request, new_edits)

``request`` is a message-form ``DirectivesRequest``: ``old_messages`` is what the server
holds for this session (the last list sent + the assistant reply it produced) and
``new_messages`` the same list with this turn's new edits applied. Only edits of messages
the server has seen (index < len(old_messages)) are forwarded; edits of messages it has
not seen yet simply go into the prompt. If the agent appends another assistant turn than
the reply the model produced (a scripted or rewritten turn), ``old_messages`` still ends
with the model's reply (that is what is cached) and only edits before it are forwarded.

``plan`` is sans-IO and assumes its ``messages_to_send`` will be sent; ``prepare`` /
``aprepare`` also send the request to a ``Runtime`` and, if the runtime fails with an
``Exception``, log it, count it and let the call through (the edited prompt then costs a
re-prefill). ``fallback=False`` raises ``RuntimeUnavailableError`` instead.

In-place edits by the agent: a framework that edits its own history (LangChain's
``ClearToolUsesEdit``, a loop that stubs old tool results) sends last turn's list with some
contents changed. Where every changed message is edited in place by the rule the server's
conversation matching uses (``trajectory.edited_in_place``: a tool result answering the same
call, an assistant turn with the same calls, a user message once the echo of a reply with
call ids proves the history) and the reply is echoed, the session keeps going: the agent's
text replaces the sticky edit of that message (the policies see it afresh), and the change
is forwarded like a policy edit (``Plan.forwarded``, ``policy="client"``).

``Plan.forwarded`` is every edit of a cached message this turn (the policies' new ones and the
agent's own). It reaches the server either as a directive (``request``, sent by ``prepare``
to a ``Runtime``: explicit use) or inside the chat request itself (``leyline_field``: the
``{"leyline": {"client_edits": mode, "edits": [...]}}`` body field that ``wrap_openai`` and
``LeylineTransport`` send, applied by the server in the turn's own job).

Divergence: otherwise the agent's list must extend the raw list it saw last time. If the
agent rewrote its history (truncation, summarisation, a new episode, an edit the rule above
does not cover) the session resets, counted in ``stats.resets`` and logged at warning level:
sticky edits are dropped, nothing is forwarded this turn (the server's prefix cache still
reuses whatever common prefix it holds), and the new list starts a fresh history. A retry
of the same list (no reply observed) is not a divergence.
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from leyline_agent.directives import MessageEdit, Mode
from leyline_agent.directives.modes import turn_mode
from leyline_agent.errors import LeylineError, RuntimeUnavailableError
from leyline_agent.logs import get_logger
from leyline_agent.policies.pipeline import PolicyPipeline
from leyline_agent.protocols import AsyncRuntime, Runtime
from leyline_agent.trajectory import apply_edits, edited_in_place, message_text
from leyline_agent.wire import DirectivesRequest, DirectivesResponse

__all__ = ["ContextSession", "Plan", "SessionStats", "normalize_reply"]

log = get_logger(__name__)  # silent until configured (leyline_agent.logs)


def normalize_reply(message: Any) -> dict[str, Any]:
    """An assistant reply as ``{"role", "content", "tool_calls"?}`` (from a dict or an SDK
    object), dropping SDK extras (refusal, annotations, audio, ...)."""
    if hasattr(message, "model_dump"):
        message = message.model_dump(exclude_none=True)
    content = message.get("content")
    out: dict[str, Any] = {"role": "assistant", "content": content if content else None}
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [
            {
                "id": tc["id"],
                "type": "function",
                "function": {
                    "name": tc["function"]["name"],
                    "arguments": tc["function"]["arguments"],
                },
            }
            for tc in calls
        ]
    return out


def _same_reply(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """``b`` (what the agent sent back) is the reply ``a``: the same text and tool calls, the
    calls' arguments compared as JSON values (frameworks re-serialize them: pydantic-ai
    echoes ``{"path":"a"}`` for the model's ``{"path": "a"}``)."""
    if b.get("role") != "assistant":
        return False
    try:
        return _comparable(normalize_reply(a)) == _comparable(normalize_reply(b))
    except (KeyError, TypeError, AttributeError):
        return False


def _comparable(reply: dict[str, Any]) -> dict[str, Any]:
    calls = [
        {
            **tc,
            "function": {**tc["function"], "arguments": _json_value(tc["function"]["arguments"])},
        }
        for tc in reply.get("tool_calls", [])
    ]
    return {**reply, "tool_calls": calls} if calls else reply


def _json_value(text: Any) -> Any:
    try:
        return ("json", json.loads(text)) if isinstance(text, str) else ("raw", text)
    except ValueError:
        return ("raw", text)


@dataclass(frozen=True, slots=True)
class Plan:
    messages_to_send: list[dict[str, Any]]
    request: DirectivesRequest | None
    new_edits: list[MessageEdit]
    forwarded: list[MessageEdit] = field(default_factory=list)  # edits of cached messages


@dataclass(slots=True)
class SessionStats:
    turns: int = 0
    edits: int = 0  # edits made (sticky), all turns
    forwarded_edits: int = 0  # edits sent to the runtime as directives
    requests: int = 0  # directive requests planned
    runtime_calls: int = 0  # ... that reached a runtime and succeeded
    runtime_failures: int = 0  # ... that failed and were let through
    server_fallbacks: int = 0  # the server had no cached base (DirectivesResponse.fallback)
    resets: int = 0  # the agent's history diverged from what the session sent
    agent_edits: int = 0  # messages the agent edited in place (the session kept going)
    body_edits: int = 0  # chat requests that carried their edits in the body (leyline_field)
    replaced_replies: int = 0  # the agent appended another assistant turn than the reply


@dataclass(slots=True)
class _State:
    raw: list[dict[str, Any]] | None = None  # the agent's list last turn (unedited)
    sent: list[dict[str, Any]] | None = None  # what was sent (edited)
    reply: dict[str, Any] | None = None  # the assistant reply to ``sent``, once observed
    sticky: dict[int, MessageEdit] = field(default_factory=dict)  # index -> edit, as made


class ContextSession:
    def __init__(
        self,
        policies: Sequence[Any],
        runtime: Runtime | AsyncRuntime | None = None,
        *,
        mode: Mode = Mode.AMORTIZE,
        session_id: str | None = None,
        fallback: bool = True,
    ) -> None:
        self.pipeline = PolicyPipeline(policies)
        self.runtime = runtime
        self.mode = Mode(mode)
        self.session_id = session_id or f"leyline-{uuid.uuid4().hex[:12]}"
        self.fallback = fallback
        self.stats = SessionStats()
        self._state = _State()

    @property
    def sticky_edits(self) -> list[MessageEdit]:
        return [self._state.sticky[i] for i in sorted(self._state.sticky)]

    def reset(self) -> None:
        self._state = _State()

    # -- sans-IO core -------------------------------------------------------------------
    def plan(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        model: str | None = None,
    ) -> Plan:
        result = self.pipeline.apply(messages)  # validates; raises before any state changes
        raw = [copy.deepcopy(dict(m)) for m in messages]
        st = self._state
        cached = self._cached_messages(raw)
        if cached is None and st.raw is not None:
            self.stats.resets += 1
            log.warning(
                "session.reset",
                session=self.session_id,
                had=len(st.raw),
                got=len(raw),
                resets=self.stats.resets,
                why="the history is not the last one extended or edited in place",
            )
            st = self._state = _State()
        old, limit, changed = cached or ([], 0, [])
        for i in changed:  # the agent's own text replaces what the session made of it
            st.sticky.pop(i, None)
        self.stats.agent_edits += len(changed)
        new_edits = [e for e in result.edits if e.index not in st.sticky]
        for e in new_edits:
            st.sticky[e.index] = e
        to_send = apply_edits(raw, self.sticky_edits)
        request = None
        forwarded: list[MessageEdit] = []
        if old:
            forwarded = _forwarded(old, to_send, limit, changed, new_edits)
            if forwarded:
                mode, budget = self.turn_mode(forwarded)
                request = DirectivesRequest(
                    model=model,
                    old_messages=old,
                    new_messages=apply_edits(old, forwarded),
                    tools=list(tools) if tools is not None else None,
                    mode=mode,
                    budget=budget,
                    fallback=self.fallback,
                    session=self.session_id,
                )
                self.stats.forwarded_edits += len(forwarded)
                self.stats.requests += 1
        st.raw, st.sent, st.reply = raw, copy.deepcopy(to_send), None
        self.stats.turns += 1
        self.stats.edits += len(new_edits)
        if new_edits:
            log.debug(
                "session.plan",
                session=self.session_id,
                new_edits=[e.index for e in new_edits],
                forwarded=[e.index for e in forwarded],
            )
        return Plan(to_send, request, new_edits, forwarded)

    def leyline_field(self, plan: Plan) -> dict[str, Any]:
        """The ``leyline`` body field of the chat request that sends ``plan``: the session's
        mode as ``client_edits`` and, when the turn edits cached messages, ``edits`` (the
        ``MessageEdit`` form). The server applies the edits in the turn's own job, before
        its prefill, so no separate directive request is needed. A server that splices only
        declared edits (its runtime's ``client_edits`` is False: the vLLM plugin) gets the
        field only with edits: there ``client_edits`` on alone would ask for a search of
        undeclared edits it does not run (and refuses)."""
        detects = bool(getattr(self.runtime, "client_edits", True))
        if not plan.forwarded and not detects:
            return {}
        out: dict[str, Any] = {"client_edits": self.turn_mode(plan.forwarded)[0].value}
        if plan.forwarded:
            out["edits"] = [e.model_dump(mode="json", exclude_none=True) for e in plan.forwarded]
            self.stats.body_edits += 1
        return out

    def turn_mode(self, edits: Sequence[MessageEdit]) -> tuple[Mode, float | None]:
        """The mode (and REPAIR budget) ``edits`` are spliced in: the most exact one their
        policies asked for (``directives.modes.turn_mode``), else the session's ``mode``."""
        return turn_mode(((e.mode, e.budget) for e in edits), self.mode)

    def observe_reply(self, assistant_message: Any) -> None:
        """Record the assistant reply to the last planned list (a dict or an SDK message)."""
        self._state.reply = normalize_reply(assistant_message)

    def continued_by(self, messages: Sequence[dict[str, Any]]) -> tuple[int, bool] | None:
        """Does ``messages`` continue this session's conversation? ``(n, echoed)``: it
        repeats the ``n`` messages of the last turn, or edits some of them in place as
        ``plan`` accepts (then only with the reply echoed), and (``echoed``) the reply
        observed to them; None if it does not. A list equal to the last one counts only
        while no reply was observed (a retry); once answered, the same list again is another
        conversation that starts alike. Used to find the session of a request by its content."""
        st = self._state
        if st.raw is None:
            return None
        n = len(st.raw)
        if len(messages) < n:
            return None
        head = [dict(m) for m in messages[:n]]
        changed = [i for i in range(n) if head[i] != st.raw[i]]
        if len(messages) == n:
            return (n, False) if st.reply is None and not changed else None
        echo = dict(messages[n])
        echoed = st.reply is not None and _same_reply(st.reply, echo)
        if changed:
            trusted = echoed or (st.reply is None and echo.get("role") == "assistant")
            reply = st.reply if st.reply is not None else normalize_reply(echo)
            proof = trusted and bool(reply.get("tool_calls"))
            if not trusted or not all(
                edited_in_place(st.raw[i], head[i], user=proof) for i in changed
            ):
                return None
        return n, echoed

    def _cached_messages(
        self, raw: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], int, list[int]] | None:
        """What the server holds for this session, below which index an edit may be
        forwarded, and which of last turn's messages the agent edited in place; None if
        ``raw`` neither extends last turn's list nor edits it in place (first turn, or the
        agent rewrote its history). ``([], 0, [])``: a retry, nothing new to diff against."""
        st = self._state
        if st.raw is None or st.sent is None:
            return None
        n = len(st.raw)
        if len(raw) < n:
            return None
        changed = [i for i in range(n) if raw[i] != st.raw[i]]
        if len(raw) == n:
            return None if changed else ([], 0, [])
        echo, reply = raw[n], st.reply
        replaced = False
        if reply is None:  # not observed (unconsumed stream, raw response): trust the echo
            if echo.get("role") != "assistant":
                old, limit = list(st.sent), n  # no reply was produced (failed call?)
            else:
                old, limit = [*st.sent, normalize_reply(echo)], n + 1
        elif _same_reply(reply, echo):
            old, limit = [*st.sent, reply], n + 1
        else:
            # The agent put another assistant turn in place of the model's reply: the cache
            # still holds the model's reply, so it stays in old/new and edits stop before it.
            old, limit, replaced = [*st.sent, reply], n, True
        if changed:
            # as the server believes edits: only with the reply echoed; a user message only
            # once the echo carries the reply's call ids
            proof = limit == n + 1 and bool(old[n].get("tool_calls"))
            if limit != n + 1 or not all(
                edited_in_place(st.raw[i], raw[i], user=proof) for i in changed
            ):
                return None
        self.stats.replaced_replies += int(replaced)
        return old, limit, changed

    # -- with a runtime -----------------------------------------------------------------
    def prepare(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        model: str | None = None,
    ) -> list[dict[str, Any]]:
        """``plan`` and send its directives to the (synchronous) runtime; the list to send."""
        plan = self.plan(messages, tools, model)
        if plan.request is not None and self.runtime is not None:
            try:
                self._record(self.runtime.apply_directives(plan.request))  # type: ignore[arg-type]
            except Exception as e:  # noqa: BLE001 - middleware failure must not break the call
                self._failed(e)
        return plan.messages_to_send

    async def aprepare(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        model: str | None = None,
    ) -> list[dict[str, Any]]:
        """``prepare`` for an ``AsyncRuntime`` (a synchronous runtime is called directly)."""
        plan = self.plan(messages, tools, model)
        if plan.request is not None and self.runtime is not None:
            try:
                res = self.runtime.apply_directives(plan.request)
                if hasattr(res, "__await__"):
                    res = await res
                self._record(res)
            except Exception as e:  # noqa: BLE001
                self._failed(e)
        return plan.messages_to_send

    def _record(self, response: DirectivesResponse) -> None:
        self.stats.runtime_calls += 1
        if response.fallback:
            self.stats.server_fallbacks += 1
            log.info("session.server_fallback", session=self.session_id)

    def _failed(self, e: Exception) -> None:
        self.stats.runtime_failures += 1
        if not self.fallback:
            if isinstance(e, LeylineError):
                raise e
            raise RuntimeUnavailableError(
                f"directives for session {self.session_id!r} failed: {e}"
            ) from e
        log.warning(
            "session.runtime_failed",
            session=self.session_id,
            error=f"{type(e).__name__}: {e}",
            failures=self.stats.runtime_failures,
        )


def _forwarded(
    old: list[dict[str, Any]],
    to_send: list[dict[str, Any]],
    limit: int,
    changed: list[int],
    new_edits: list[MessageEdit],
) -> list[MessageEdit]:
    """The edits that turn ``old`` (what the server holds) into ``to_send`` below ``limit``:
    a policy's new edit as it was made; a message the agent edited in place as the text now
    sent (the agent's, or a policy's edit of it). When ``old`` ends with the reply (``limit ==
    len(old)``), only a policy's edit of it counts: the agent's echo may differ in form."""
    by_index = {e.index: e for e in new_edits}
    reply_at = len(old) - 1 if limit == len(old) and old[-1].get("role") == "assistant" else -1
    out: list[MessageEdit] = []
    for i in range(min(limit, len(to_send))):
        if i not in changed and i in by_index:
            out.append(by_index[i])
        elif i in changed and i != reply_at and old[i] != to_send[i]:
            edit = _edit_between(i, old[i], to_send[i])
            if edit is not None:
                out.append(edit)
    return out


def _edit_between(i: int, before: dict[str, Any], after: dict[str, Any]) -> MessageEdit | None:
    """The agent's in-place edit of message ``i`` as a ``MessageEdit``; None when only another
    field changed (left to the server's client-edit detection)."""
    content = None
    if before.get("content") != after.get("content"):
        text = after.get("content")
        content = text if isinstance(text, str) else message_text(after)
    calls = after.get("tool_calls") if before.get("tool_calls") != after.get("tool_calls") else None
    if content is None and calls is None:
        return None
    return MessageEdit(
        index=i, content=content, tool_calls=calls, policy="client", reason="edited in place"
    )
