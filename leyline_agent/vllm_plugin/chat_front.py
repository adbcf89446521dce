"""The Leyline front of ``vllm serve``'s chat route: declared edits and token drift, spliced.

The plugin's middleware (``guard.LeylineGuard``) hands every chat request to
``ChatFront.splice`` before vLLM's own chat route sees it. For a named session
(``X-Leyline-Session``) the front remembers the last lists it sent (``ChatMemory``: canonical
messages and their rendered prompt), and splices in the session's namespace, through the
directive route's own execution (``VLLMRoute.run_edits``: counted in ``/leyline/v1/stats``),
with ``fallback`` (what is no longer cached is prefilled by the turn itself):

- **declared edits** (``{"leyline": {"edits": [...]}}``: what ``wrap_openai`` and
  ``LeylineTransport`` send; checked and applied by ``directives.body_edits`` exactly as
  ``leyline serve`` does). The conversation the cache holds is the request's messages with
  the edited ones as the newest remembered list that the request repeats had them (that list,
  then the reply and what follows, as this request sends them); it and the request's
  messages are spliced as one message-form directive. The answer says what came of them:
  ``leyline.edits`` = ``{"declared", "spliced", "fallback"}``.
- **token drift** (no declared edits): the request's rendered prompt is diffed against the
  session's last one (``directives.drift_plan``: a stripped or empty ``<think>`` block, a
  changed head line, a cached message edited in place) and the spans are spliced as one
  token-form directive. The answer says so in ``leyline.drift`` (as on ``leyline serve``).
  The mode is the request's ``leyline.client_edits``, else ``LEYLINE_CLIENT_EDITS`` (default
  ``amortize``, as ``leyline serve --client-edits``); a session that sent a FORGET directive
  is marked exact, and its drift is spliced by FORGET (what was forgotten stays forgotten).

The request then goes on to vLLM without the ``leyline`` field, under the session's salt, and
finds the spliced rows in the prefix cache. Nothing is dropped silently: a declared edit with
no matching list, or whose rows were evicted, is served by a re-prefill and reported
``fallback: true`` (logged at warning level); a drift found but not spliced says why.

Both need a named session: the lists remembered, and the rows spliced, are the session's own
(``leyline serve`` also tracks anonymous conversations, kept apart by the reply each one
echoes; this front does not). vLLM never computes the KV of an answer's last sampled token,
so the tail a splice keeps ends before it, and that token is prefilled with the next turn.
"""

from __future__ import annotations

import asyncio
import json
import os
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from leyline_agent.chat_input import canonical_messages, canonical_tools
from leyline_agent.directives.body_edits import RequestEdits, outcome, request_edits
from leyline_agent.directives.compile import render
from leyline_agent.directives.core import Mode
from leyline_agent.directives.drift_plan import DriftCounts, DriftOutcome, plan_drift
from leyline_agent.errors import RequestError
from leyline_agent.logs import get_logger
from leyline_agent.namespaces import SESSION_HEADER
from leyline_agent.wire import DirectivesRequest, DirectivesResponse

__all__ = ["ChatFront", "ChatMemory", "EditRunner", "annotate", "default_mode"]

log = get_logger(__name__)
SESSIONS = 1024  # named sessions whose recent lists are remembered (least recently used go)
PER_SESSION = 2  # lists remembered per session (the wrapper edits the previous turn's)
MODES = ("amortize", "forget", "off")


def default_mode() -> str:
    """``LEYLINE_CLIENT_EDITS``: how a session's drift is spliced when the request does not
    say (``amortize``, ``forget`` or ``off``)."""
    mode = os.environ.get("LEYLINE_CLIENT_EDITS", "amortize")
    if mode not in MODES:
        raise ValueError(f"LEYLINE_CLIENT_EDITS: {mode!r} must be one of {list(MODES)}")
    return mode


class EditRunner(DriftCounts, Protocol):
    """The directive route (``route.VLLMRoute``): its execution, tokenizer and counters."""

    async def run_edits(self, req: DirectivesRequest, session: str) -> DirectivesResponse: ...

    def tokenizer(self) -> Any: ...


@dataclass(frozen=True, slots=True)
class Sent:
    """One chat request of a session: its canonical messages and rendered prompt."""

    messages: list[dict[str, Any]]
    tokens: array


class ChatMemory:
    """The last ``PER_SESSION`` chat requests of each of the last ``SESSIONS`` named
    sessions, and the sessions marked exact (they sent a FORGET)."""

    def __init__(self, sessions: int = SESSIONS, per_session: int = PER_SESSION) -> None:
        self.sessions, self.per_session = sessions, per_session
        self._sent: OrderedDict[str, list[Sent]] = OrderedDict()
        self._exact: OrderedDict[str, None] = OrderedDict()

    def remember(self, session: str, sent: Sent) -> None:
        kept = [x for x in self._sent.pop(session, []) if x.messages != sent.messages]
        self._sent[session] = [sent, *kept[: self.per_session - 1]]
        while len(self._sent) > self.sessions:
            self._sent.popitem(last=False)

    def last(self, session: str) -> Sent | None:
        sent = self._sent.get(session)
        return sent[0] if sent else None

    def forget(self, session: str, exact: bool) -> None:
        """A directive ran in ``session`` outside this front: what it remembers may no longer
        be what the cache holds. ``exact``: a FORGET, whose edits must stay (drift is then
        spliced by FORGET)."""
        self._sent.pop(session, None)
        if exact:
            self._exact[session] = None
            while len(self._exact) > self.sessions:
                self._exact.popitem(last=False)

    def exact(self, session: str) -> bool:
        return session in self._exact

    def base_for(
        self, session: str, messages: Sequence[dict[str, Any]], edited: frozenset[int]
    ) -> list[dict[str, Any]] | None:
        """The newest remembered list of ``session`` that ``messages`` repeats except at the
        ``edited`` indices, all of which it covers; None if there is none."""
        for sent in self._sent.get(session, []):
            old = sent.messages
            if len(old) > len(messages) or (edited and max(edited) >= len(old)):
                continue
            if all(old[j] == messages[j] for j in range(len(old)) if j not in edited):
                return old
        return None


@dataclass(frozen=True, slots=True)
class Spliced:
    """What ``ChatFront.splice`` did: the body to hand vLLM, and the fields its answer gets
    (``leyline``, ``context_management``; ``annotate``), None for none."""

    body: dict[str, Any]
    fields: dict[str, Any] | None


class ChatFront:
    def __init__(
        self, runner: EditRunner, memory: ChatMemory | None = None, mode: str | None = None
    ) -> None:
        self.runner = runner
        self.memory = memory if memory is not None else ChatMemory()
        self.mode = mode if mode is not None else default_mode()

    async def splice(self, body: dict[str, Any], session: str | None) -> Spliced:
        """Splice what ``body`` declares or drifts (module doc) and remember its messages;
        the body vLLM gets has no ``leyline`` field."""
        messages = body.get("messages")
        if not isinstance(messages, list):
            return Spliced(body, None)  # vLLM answers a body without messages
        edits = request_edits(body.get("leyline"), messages)
        rest = {k: v for k, v in body.items() if k != "leyline"}
        if edits.edits and session is None:
            raise RequestError(
                "edits in a chat body need a named session on vLLM (the rows they splice "
                "are the session's own)",
                SESSION_HEADER,
            )
        if session is None:
            return Spliced(rest, None)
        mode = (edits.options or {}).get("client_edits") or self.mode  # set beside edits
        tools = body.get("tools") if isinstance(body.get("tools"), list) else None
        new = canonical_messages(edits.messages)
        # the rendered prompt is what a later turn's drift is diffed against: not rendered
        # for a request that asks for no splicing at all
        off = mode == "off" and not edits.edits
        tokens = array("i") if off else await asyncio.to_thread(self._render, new, tools)
        splice = Mode.FORGET if mode == "forget" or self.memory.exact(session) else Mode.AMORTIZE
        leyline: dict[str, Any] | None = None
        if edits.edits:
            leyline = {"edits": await self._declared(edits, new, tools, session, splice)}
        elif not off:
            drift = await self._drift(tokens, session, splice)
            leyline = {"drift": drift.wire()} if drift is not None else None
        self.memory.remember(session, Sent(new, tokens))
        fields = {"leyline": leyline} if leyline is not None else None
        return Spliced({**rest, "messages": edits.messages}, fields)

    def _render(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> array:
        tok = self.runner.tokenizer()
        return array("i", render(tok, messages, canonical_tools(tools), add_generation_prompt=True))

    async def _declared(
        self, edits: RequestEdits, new: list[dict[str, Any]], tools: Any, session: str, mode: Mode
    ) -> dict[str, Any]:
        old = self.memory.base_for(session, new, edits.declared)
        spliced: list[int] | None = None
        if old is not None:
            # the cache holds the earlier list and what followed it (the reply, as this request
            # echoes it): the same conversation, the edited messages as they were
            req = DirectivesRequest(
                old_messages=old + new[len(old) :],
                new_messages=new,
                tools=tools,
                mode=mode,
                fallback=True,
                session=session,
            )
            resp = await self.runner.run_edits(req, session)
            # one span per edited message, left to right; the spans past the cached prefix
            # are the ones dropped (``clip_to_cached``)
            spliced = sorted(edits.declared)[: len(resp.applied)] if resp.applied else None
        return outcome(edits, spliced, session)

    async def _drift(self, tokens: array, session: str, mode: Mode) -> DriftOutcome | None:
        last = self.memory.last(session)
        if last is None:
            return None
        planned = await asyncio.to_thread(plan_drift, last.tokens, tokens, mode)
        if planned is None:
            return None
        out, req = planned
        if req is not None:
            try:
                resp = await self.runner.run_edits(
                    req.model_copy(update={"session": session}), session
                )
                out.settle(resp)
            except Exception as exc:  # noqa: BLE001 - nothing changed: the turn prefills exactly
                log.warning(
                    "chat_front.drift_error", session=session, error=f"{type(exc).__name__}: {exc}"
                )
                out.refuse("error")
        out.count(self.runner)
        return out


def annotate(chunk: bytes, fields: dict[str, Any], stream: bool) -> bytes:
    """``chunk`` (a whole JSON answer, or a stream's first event) with ``fields`` merged into
    its top level (an object into an object key by key, at every depth); unchanged if it is
    not a JSON object."""
    if stream:
        head, sep, tail = chunk.partition(b"\n\n")
        if not head.startswith(b"data: {"):
            return chunk
        return b"data: " + annotate(head[6:], fields, False) + sep + tail
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
