"""The Leyline chat turn in front of an engine's own chat route (the vLLM plugin's front).

A server that keeps its own chat route (``vllm serve``) gets Leyline's chat turn from a
middleware that hands each chat request to ``ChatFront.splice`` before the route sees it.
The turn is the one ``leyline serve`` runs (``front.chat_turn``): the request's conversation
is found by content in the runner's ``ConversationStore`` (its named session's, or for a
request that names none, an anonymous conversation proven by the reply it echoes), and its
``context_management`` edits, its declared ``leyline.edits``, its in-place client edits and
the token drift of its rendered prompt are spliced in the conversation's namespace, through
the runner's directive execution (``EditRunner.run_edits``: checked, in the namespace's
order, counted), with ``fallback`` (what is no longer cached is prefilled by the turn
itself).

The request then goes on to the engine with the served messages (``forwarded``: the
client's own messages, with the fields the turn edited replaced: sticky and policy edits),
without the ``leyline`` and ``context_management`` fields, in the conversation's namespace
(``Spliced.namespace``: the middleware says it the engine's way), and finds the spliced
rows in the prefix cache. Every prompt the turn diffs or splices is rendered by the
engine's own renderer (``EditRunner.render_chat``), from the messages as they are
forwarded, so the front's tokens are the ones the engine's chat route will prefill. The
answer gets the fields ``leyline serve`` adds (``Spliced.fields``: ``leyline``,
``context_management.applied_edits``, ``leyline.edits``, ``usage.leyline``), and once it is
complete ``Spliced.commit(reply)`` records the conversation with the served prompt's
tokens, which the next turn's drift is diffed against.

``check_fields`` refuses (naming the field) what this front cannot act on: ``leyline`` and
``context_management`` outside a chat request, or beside a ``cache_salt`` of the client's
own. The mode is the request's ``leyline.client_edits``, else ``LEYLINE_CLIENT_EDITS``
(default ``amortize``, as ``leyline serve --client-edits``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from leyline_agent.directives.body_edits import outcome, request_edits
from leyline_agent.directives.drift_plan import DriftCounts
from leyline_agent.errors import RequestError
from leyline_agent.front.chat_turn import begin_turn
from leyline_agent.front.conversations import ConversationStore
from leyline_agent.http.guards import GuardError
from leyline_agent.namespaces import SESSION_HEADER, Namespace
from leyline_agent.wire import DirectivesRequest, DirectivesResponse

__all__ = [
    "MODES",
    "ChatFront",
    "EditRunner",
    "Encoder",
    "FrontTurnEngine",
    "Spliced",
    "check_fields",
    "default_mode",
    "forwarded",
]

MODES = ("amortize", "forget", "repair", "off")
# the chat body's fields that change what the engine renders (passed to its renderer as they are)
_RENDER_KEYS = (
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
)


def default_mode() -> str:
    """``LEYLINE_CLIENT_EDITS``: how a conversation's client edits and drift are spliced when
    the request does not say (``amortize``, ``forget``, ``repair`` or ``off``)."""
    mode = os.environ.get("LEYLINE_CLIENT_EDITS", "amortize")
    if mode not in MODES:
        raise ValueError(f"LEYLINE_CLIENT_EDITS: {mode!r} must be one of {list(MODES)}")
    return mode


class Encoder(Protocol):
    """What the front needs of a tokenizer (``context_management``'s token counts)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


class EditRunner(Protocol):
    """The backend's directive route (the vLLM plugin's ``route.VLLMRoute``): its execution,
    renderer, tokenizer, conversations and counters."""

    conversations: ConversationStore
    counters: DriftCounts

    async def run_edits(self, req: DirectivesRequest, session: str) -> DirectivesResponse: ...

    async def render_chat(
        self, messages: list[dict[str, Any]], tools: list[Any] | None, kwargs: dict[str, Any]
    ) -> list[int]: ...

    def tokenizer(self) -> Encoder: ...


@dataclass(frozen=True, slots=True)
class Spliced:
    """What ``ChatFront.splice`` did: the body to hand the engine, the namespace to serve
    it in (None: as the request says), the fields its answer gets (``http.asgi.annotate``;
    None for none), and ``commit(reply)`` once the answer is complete (None: nothing to
    record)."""

    body: dict[str, Any]
    fields: dict[str, Any] | None
    commit: Callable[[dict[str, Any]], None] | None = None
    namespace: Namespace | None = None


def forwarded(
    raw: list[dict[str, Any]], canon: list[dict[str, Any]], served: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The messages the engine gets for the served (canonical) list: the client's own message
    where the turn left it as sent, else the client's message with the fields the turn
    changed replaced (its thinking in ``reasoning`` too, where the client sent that key)."""
    out = []
    for i, m in enumerate(served):
        if i < len(canon) and i < len(raw) and m == canon[i]:
            out.append(raw[i])
            continue
        msg = dict(raw[i]) if i < len(raw) else {}
        for key in _EDITABLE:
            if key in m:
                msg[key] = m[key]
            else:
                msg.pop(key, None)
        if "reasoning" in msg:
            msg["reasoning"] = m.get("reasoning_content")
        out.append(msg)
    return out


_EDITABLE = ("role", "content", "name", "tool_call_id", "tool_calls", "reasoning_content")


class FrontTurnEngine:
    """``front.turns.TurnEngine`` over an ``EditRunner``, for a turn's job on a worker
    thread: renders with the engine's renderer what would be forwarded, runs directives on
    the runner, both through the event loop."""

    def __init__(
        self,
        runner: EditRunner,
        loop: asyncio.AbstractEventLoop,
        raw: list[dict[str, Any]],
        canon: list[dict[str, Any]],
        kwargs: dict[str, Any],
    ) -> None:
        self.runner, self.loop = runner, loop
        self.raw, self.canon, self.kwargs = raw, canon, kwargs

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        msgs = forwarded(self.raw, self.canon, messages)
        kwargs = {"add_generation_prompt": add_generation_prompt, **self.kwargs}
        run = self.runner.render_chat(msgs, tools, kwargs)
        return asyncio.run_coroutine_threadsafe(run, self.loop).result()

    def apply_directives(
        self, request: DirectivesRequest, *, namespace: Namespace | None = None
    ) -> DirectivesResponse:
        assert namespace is not None and namespace.session is not None  # a conversation's
        req = request.model_copy(update={"session": namespace.session})
        run = self.runner.run_edits(req, namespace.session)
        return asyncio.run_coroutine_threadsafe(run, self.loop).result()

    def counters(self, tenant: str) -> DriftCounts:
        return self.runner.counters


class ChatFront:
    def __init__(self, runner: EditRunner, mode: str | None = None) -> None:
        self.runner = runner
        self.mode = mode if mode is not None else default_mode()
        self._locks: dict[Namespace, asyncio.Lock] = {}

    def count(self, text: str) -> int:
        """The served tokenizer's count of ``text`` (``context_management``'s token counts)."""
        tok = self.runner.tokenizer()
        return len(tok.encode(text, add_special_tokens=False)) if text else 0

    async def splice(self, body: dict[str, Any], session: str | None) -> Spliced:
        """Run ``body``'s turn (module doc); the body the engine gets has no ``leyline`` or
        ``context_management`` field."""
        messages = body.get("messages")
        rest = {k: v for k, v in body.items() if k not in ("leyline", "context_management")}
        if not isinstance(messages, list):
            return Spliced(rest, None)  # the engine answers a body without messages
        edits = request_edits(body.get("leyline"), messages)
        if edits.edits and session is None:
            raise RequestError(
                "edits in a chat body need a named session (the conversation they edit is "
                "the session's own)",
                SESSION_HEADER,
            )
        tools = body.get("tools") if isinstance(body.get("tools"), list) else None
        turn = begin_turn(
            self.runner.conversations,
            self.mode,
            edits.messages,
            body.get("context_management"),
            edits.options,
            tools,
            Namespace(session=session),
            self.count,
            declared=edits.declared,
        )
        if turn is None:
            return Spliced({**rest, "messages": edits.messages}, None)
        kwargs = {k: body[k] for k in _RENDER_KEYS if k in body}
        loop = asyncio.get_running_loop()
        engine = FrontTurnEngine(self.runner, loop, edits.messages, turn.messages, kwargs)
        async with self._lock(turn.namespace):  # one turn of a conversation at a time
            out = await asyncio.to_thread(turn.run, engine)
            ready = turn.prepared(out)
            tokens = out.rendered
            if tokens is None and turn.mode != "off":  # what the next turn's drift diffs
                tokens = await asyncio.to_thread(engine.render, ready.messages, tools)
        fields: dict[str, Any] = {**ready.body, "usage": {"leyline": ready.usage}}
        if edits.edits:
            spliced = ready.body["leyline"]["edited_messages"]
            fields["leyline"]["edits"] = outcome(edits, spliced, session or "")
        served = forwarded(edits.messages, turn.messages, ready.messages)
        body = {**rest, "messages": served}
        return Spliced(body, fields, lambda reply: ready.commit(reply, tokens), ready.namespace)

    def _lock(self, ns: Namespace) -> asyncio.Lock:
        if len(self._locks) > 4096:  # forget idle conversations' locks
            self._locks = {k: v for k, v in self._locks.items() if v.locked()}
        return self._locks.setdefault(ns, asyncio.Lock())


# Body fields the front refuses by name where it cannot act on them (``check_fields``):
# the engine would ignore them (a 200 that applied nothing).
_CHAT_ONLY = "rides with a chat request only"
_OWN_SALT = (
    "a request with a cache_salt of its own is served in that private namespace, which "
    "Leyline does not splice; drop the salt, or name a session with " + SESSION_HEADER
)


def check_fields(data: dict[str, Any], chat: bool, own_salt: bool) -> None:
    """Refuse (``GuardError`` naming the field) the body fields that ask for work this
    front cannot do: ``context_management``, ``leyline.edits`` or client edits turned on
    anywhere but in a chat request, or beside a ``cache_salt`` of the client's own.
    ``{"leyline": {"client_edits": "off"}}`` asks for nothing."""
    if "context_management" in data:
        if not chat:
            raise GuardError("context_management " + _CHAT_ONLY, "context_management")
        if own_salt:
            raise GuardError(_OWN_SALT, "cache_salt")
    if "leyline" not in data:
        return
    opts = data["leyline"]
    if not isinstance(opts, dict):
        raise GuardError("must be an object", "leyline")
    unknown = sorted(set(opts) - {"client_edits", "edits"})
    if unknown:
        raise GuardError(f"unknown option {unknown[0]!r}", f"leyline.{unknown[0]}")
    mode = opts.get("client_edits", "off")
    if mode not in MODES:
        raise GuardError(f"must be one of {list(MODES)}", "leyline.client_edits")
    if "edits" in opts and not chat:
        raise GuardError("edits " + _CHAT_ONLY, "leyline.edits")
    if "edits" in opts:
        return  # checked with the messages (``body_edits.request_edits``)
    if mode != "off" and not chat:
        raise GuardError("client edits " + _CHAT_ONLY, "leyline.client_edits")
    if mode != "off" and own_salt:
        raise GuardError(_OWN_SALT, "cache_salt")
