"""Edits that ride with a chat request on ``vllm serve``: ``{"leyline": {"edits": [...]}}``.

``wrap_openai`` and ``LeylineTransport`` put a turn's edits of cached messages in the chat
request itself (``directives.body_edits``: the ``MessageEdit`` form, checked and applied
exactly as ``leyline serve`` checks and applies them). On vLLM the plugin's middleware
(``guard.LeylineGuard``) hands such a request to ``ChatFront.splice`` before vLLM's own chat
route sees it:

1. the edits are checked and applied to the request's messages (a 400 naming the field,
   ``leyline.edits[0].index``, before anything runs);
2. the messages the session sent before (``ChatMemory``: the last lists of each named
   session, in canonical form) give the conversation the cache holds: the newest list that
   the request repeats except at the edited indices, each of which it covers;
3. the request's messages with the edited ones as that list had them (the conversation the
   cache holds: the earlier list, then the reply and what follows, as this request sends
   them) and the request's messages are spliced as one message-form directive in the
   session's namespace (``VLLMRoute.run_edits``: the directive route's own execution,
   counted in ``/leyline/v1/stats``), with ``fallback``: what is not cached any more is
   prefilled by the turn itself;
4. the request goes on to vLLM without the ``leyline`` field, under the session's salt, and
   finds the spliced rows in the prefix cache.

The answer says what came of the edits, as on ``leyline serve``: ``leyline.edits`` =
``{"declared", "spliced", "fallback"}`` in the JSON answer, or in the first chunk of a
stream (``annotate``). A declared edit with no matching earlier list, or whose rows were no
longer cached, is served by a re-prefill, reported ``fallback: true`` and logged at warning
level: never dropped silently.

Edits need a named session (``X-Leyline-Session``): the lists remembered, and the rows spliced,
are the session's own. vLLM has no conversation tracking of its own, so edits a client makes
without declaring them (``client_edits`` on, no ``edits``) are refused by name in the
middleware, as is ``context_management``.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from leyline_agent.chat_input import canonical_messages
from leyline_agent.directives.body_edits import RequestEdits, outcome, request_edits
from leyline_agent.directives.core import Mode
from leyline_agent.errors import RequestError
from leyline_agent.namespaces import SESSION_HEADER
from leyline_agent.wire import DirectivesRequest, DirectivesResponse

__all__ = ["ChatFront", "ChatMemory", "EditRunner", "annotate"]

SESSIONS = 1024  # named sessions whose recent lists are remembered (least recently used go)
PER_SESSION = 2  # lists remembered per session (the wrapper edits the previous turn's)


class EditRunner(Protocol):
    """The directive route's execution (``route.VLLMRoute``)."""

    async def run_edits(self, req: DirectivesRequest, session: str) -> DirectivesResponse: ...


class ChatMemory:
    """The canonical message lists of the last ``PER_SESSION`` chat requests of each of the
    last ``SESSIONS`` named sessions."""

    def __init__(self, sessions: int = SESSIONS, per_session: int = PER_SESSION) -> None:
        self.sessions, self.per_session = sessions, per_session
        self._lists: OrderedDict[str, list[list[dict[str, Any]]]] = OrderedDict()

    def remember(self, session: str, messages: list[dict[str, Any]]) -> None:
        lists = self._lists.pop(session, [])
        lists = [m for m in lists if m != messages][: self.per_session - 1]
        self._lists[session] = [messages, *lists]
        while len(self._lists) > self.sessions:
            self._lists.popitem(last=False)

    def base_for(
        self, session: str, messages: Sequence[dict[str, Any]], edited: frozenset[int]
    ) -> list[dict[str, Any]] | None:
        """The newest remembered list of ``session`` that ``messages`` repeats except at the
        ``edited`` indices, all of which it covers; None if there is none."""
        for old in self._lists.get(session, []):
            if len(old) > len(messages) or (edited and max(edited) >= len(old)):
                continue
            if all(old[j] == messages[j] for j in range(len(old)) if j not in edited):
                return old
        return None


@dataclass(frozen=True, slots=True)
class Spliced:
    """What ``ChatFront.splice`` did: the body to hand vLLM, and ``leyline`` of the answer."""

    body: dict[str, Any]
    leyline: dict[str, Any] | None


class ChatFront:
    def __init__(self, runner: EditRunner, memory: ChatMemory | None = None) -> None:
        self.runner = runner
        self.memory = memory if memory is not None else ChatMemory()

    async def splice(self, body: dict[str, Any], session: str | None) -> Spliced:
        """Apply ``body``'s ``leyline.edits`` (module doc, steps 1-3) and remember its
        messages; the body vLLM gets has no ``leyline`` field."""
        messages = body.get("messages")
        if not isinstance(messages, list):
            return Spliced(body, None)  # vLLM answers a body without messages
        edits = request_edits(body.get("leyline"), messages)
        rest = {k: v for k, v in body.items() if k != "leyline"}
        if not edits.edits:
            if session is not None:
                self.memory.remember(session, canonical_messages(messages))
            return Spliced(rest, None)
        if session is None:
            raise RequestError(
                "edits in a chat body need a named session on vLLM (the rows they splice "
                "are the session's own)",
                SESSION_HEADER,
            )
        new = canonical_messages(edits.messages)
        done = await self._run(edits, new, body.get("tools"), session)
        self.memory.remember(session, new)
        return Spliced({**rest, "messages": edits.messages}, {"edits": done})

    async def _run(
        self, edits: RequestEdits, new: list[dict[str, Any]], tools: Any, session: str
    ) -> dict[str, Any]:
        old = self.memory.base_for(session, new, edits.declared)
        spliced: list[int] | None = None
        if old is not None:
            mode = Mode(edits.options.get("client_edits", "amortize"))
            # the cache holds the earlier list and what followed it (the reply, as this request
            # echoes it): the same conversation, the edited messages as they were
            req = DirectivesRequest(
                old_messages=old + new[len(old) :],
                new_messages=new,
                tools=tools if isinstance(tools, list) else None,
                mode=mode,
                fallback=True,
                session=session,
            )
            resp = await self.runner.run_edits(req, session)
            # one span per edited message, left to right; the spans past the cached prefix
            # are the ones dropped (``clip_to_cached``)
            spliced = sorted(edits.declared)[: len(resp.applied)] if resp.applied else None
        return outcome(edits, spliced, session)


def annotate(chunk: bytes, leyline: dict[str, Any], stream: bool) -> bytes:
    """``chunk`` (a whole JSON answer, or a stream's first event) with ``leyline`` added at
    its top level; unchanged if it is not a JSON object."""
    if stream:
        head, sep, tail = chunk.partition(b"\n\n")
        if not head.startswith(b"data: {"):
            return chunk
        return b"data: " + annotate(head[6:], leyline, False) + sep + tail
    try:
        data = json.loads(chunk)
    except ValueError:
        return chunk
    if not isinstance(data, dict):
        return chunk
    data["leyline"] = {**(data.get("leyline") or {}), **leyline}
    return json.dumps(data, separators=(",", ":")).encode()
