"""The Leyline front of ``vllm serve``'s chat route: ``front.chat_turn``, carried over HTTP.

The plugin's middleware (``guard.LeylineGuard``) hands chat requests to ``ChatFront.splice``
before vLLM's own chat route sees them. The turn is the one ``leyline serve`` runs
(``front.chat_turn``): the request's conversation is found by content in the route's
``ConversationStore`` (its named session's, or for a request that names none, an anonymous
conversation proven by the reply it echoes), and its ``context_management`` edits, its
declared ``leyline.edits``, its in-place client edits and the token drift of its rendered
prompt are spliced in the conversation's namespace, through the directive route's own
execution (``VLLMRoute.run_edits``: checked, in the namespace's order, counted in
``/leyline/v1/stats``), with ``fallback`` (what is no longer cached is prefilled by the
turn itself).

The request then goes on to vLLM with the served messages (``forwarded``: the client's own
messages, with the fields the turn edited replaced: sticky and policy edits), without the
``leyline`` and ``context_management`` fields, under the conversation's salt, and finds the
spliced rows in the prefix cache. Every prompt the turn diffs or splices is rendered by
vLLM's own renderer (``EditRunner.render_chat``, what its ``/tokenize`` runs), from the
messages as they are forwarded, so the front's tokens are the ones vLLM's chat route will
prefill (vLLM reads an assistant message's thinking from ``reasoning``, not
``reasoning_content``; a system prompt may lose a line: whatever vLLM does, the front sees). The answer gets the
fields ``leyline serve`` adds (``leyline``: conversation, session, edited messages,
directives, drift; ``context_management.applied_edits``; ``leyline.edits`` for declared
edits; ``usage.leyline`` in a JSON answer), and once it is complete the guard reads its
reply (``replies``) and commits the conversation with the served prompt's tokens, which the
next turn's drift is diffed against.

The mode is the request's ``leyline.client_edits``, else ``LEYLINE_CLIENT_EDITS`` (default
``amortize``, as ``leyline serve --client-edits``). vLLM never computes the KV of an answer's
last sampled token, so the tail a splice keeps ends before it, and that token is prefilled
with the next turn.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from leyline_agent.directives.body_edits import outcome, request_edits
from leyline_agent.directives.drift_plan import DriftCounts
from leyline_agent.errors import RequestError
from leyline_agent.front.chat_turn import begin_turn
from leyline_agent.front.conversations import ConversationStore
from leyline_agent.namespaces import SESSION_HEADER, Namespace
from leyline_agent.vllm_plugin.namespace import salt_for
from leyline_agent.wire import DirectivesRequest, DirectivesResponse

__all__ = ["ChatFront", "EditRunner", "Spliced", "annotate", "default_mode"]

MODES = ("amortize", "forget", "repair", "off")
# the chat body's fields that change what vLLM renders (passed to its renderer as they are)
_RENDER_KEYS = (
    "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "add_special_tokens",
)


def default_mode() -> str:
    """``LEYLINE_CLIENT_EDITS``: how a conversation's client edits and drift are spliced when
    the request does not say (``amortize``, ``forget``, ``repair`` or ``off``)."""
    mode = os.environ.get("LEYLINE_CLIENT_EDITS", "amortize")
    if mode not in MODES:
        raise ValueError(f"LEYLINE_CLIENT_EDITS: {mode!r} must be one of {list(MODES)}")
    return mode


class EditRunner(DriftCounts, Protocol):
    """The directive route (``route.VLLMRoute``): its execution, tokenizer, conversations
    and counters."""

    conversations: ConversationStore

    async def run_edits(self, req: DirectivesRequest, session: str) -> DirectivesResponse: ...

    async def render_chat(
        self, messages: list[dict[str, Any]], tools: list[Any] | None, kwargs: dict[str, Any]
    ) -> list[int]: ...

    def tokenizer(self) -> Any: ...


@dataclass(frozen=True, slots=True)
class Spliced:
    """What ``ChatFront.splice`` did: the body to hand vLLM, the fields its answer gets
    (``annotate``; None for none), and ``commit(reply)`` once the answer is complete
    (None: nothing to record)."""

    body: dict[str, Any]
    fields: dict[str, Any] | None
    commit: Callable[[dict[str, Any]], None] | None = None


def forwarded(
    raw: list[dict[str, Any]], canon: list[dict[str, Any]], served: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The messages vLLM gets for the served (canonical) list: the client's own message
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
    """``front.turns.TurnEngine`` on vLLM, for a turn's job on a worker thread: renders with
    vLLM's renderer what would be forwarded, runs directives on the route, both through the
    event loop."""

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
        return self.runner


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
        """Run ``body``'s turn (module doc); the body vLLM gets has no ``leyline`` or
        ``context_management`` field."""
        messages = body.get("messages")
        rest = {k: v for k, v in body.items() if k not in ("leyline", "context_management")}
        if not isinstance(messages, list):
            return Spliced(rest, None)  # vLLM answers a body without messages
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
        body = {**rest, "messages": served, "cache_salt": salt_for(ready.namespace)}
        return Spliced(body, fields, lambda reply: ready.commit(reply, tokens))

    def _lock(self, ns: Namespace) -> asyncio.Lock:
        if len(self._locks) > 4096:  # forget idle conversations' locks
            self._locks = {k: v for k, v in self._locks.items() if v.locked()}
        return self._locks.setdefault(ns, asyncio.Lock())


def annotate(chunk: bytes, fields: dict[str, Any], stream: bool) -> bytes:
    """``chunk`` (a whole JSON answer, or a stream's first event) with ``fields`` merged into
    its top level (an object into an object key by key, at every depth); unchanged if it is
    not a JSON object. A stream's first event gets no ``usage``: OpenAI's streams carry it
    in their last event only."""
    if stream:
        head, sep, tail = chunk.partition(b"\n\n")
        if not head.startswith(b"data: {"):
            return chunk
        first = {k: v for k, v in fields.items() if k != "usage"}
        return b"data: " + annotate(head[6:], first, False) + sep + tail
    try:
        data = json.loads(chunk)
    except ValueError:
        return chunk
    if not isinstance(data, dict):
        return chunk
    return json.dumps(_merged(data, fields), separators=(",", ":")).encode()


def _merged(data: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    out = dict(data)
    for k, v in fields.items():
        old = out.get(k)
        out[k] = _merged(old, v) if isinstance(old, dict) and isinstance(v, dict) else v
    return out
