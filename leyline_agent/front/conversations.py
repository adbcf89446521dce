"""Conversations the server has served, found again by their content (pure, no engine).

Messages are compared in their canonical form (``leyline_agent.chat_input``), the form
the server renders.

A chat request continues a conversation when its messages start with the prompt the client
sent last time, message for message, except for messages *edited in place* (a tool result
with the same ``tool_call_id``, an assistant message with the same tool call ids, and a user
message at the same place when the echo is proven by call ids, below); edits are believed
only when the next message echoes the reply the server gave: its random ``call_...`` ids (in
the echo's ``tool_calls``, or quoted in its text: smolagents echoes its calls as text and
sends tool results as user messages), or, for a reply without calls, its text. A client
that never saw that reply cannot pass its own history off as an edit of this one; a user
message, which carries no call id of its own, is believed edited only by a client that
proved it holds the reply's 96-bit call ids. A request equal to the last prompt (a retry)
continues it too. Of all conversations a request continues, the longest wins, then the one
with fewest edits, then the newest.

Provenance: conversations are kept per tenant and, for requests that name a session
(``X-Leyline-Session``), per session: a request is matched only into conversations of its
own tenant and its own named session. A conversation found for a request that named none
has a server-side session id of its own (``SERVER_SESSION_PREFIX`` + 128 random bits),
which is the namespace of its spliced rows: clients cannot name it (``check_session_id``
refuses the prefix) and it is never shown (the answer's ``leyline.session`` is the
request's own named session, or null). An anonymous conversation also belongs to its
``owner``, the API key that started it (``""`` on a server without keys): a request that
names no session is matched only into conversations of its own key, so another key of the
tenant (which may replay the same prompt elsewhere, or continue the creator's stored
response) can neither pass an echo nor land in the creator's conversation. Named sessions
are shared by the tenant's keys, as their rows are: naming one is the tenant's choice. If the best match is ambiguous (two conversations of
different sessions fit equally well) and one of them holds spliced rows, the request
starts a new conversation: rows that depend on a history are never handed to a request
that might not share it. A request that names no session *claims* the state it continues
(``find(claim=True)``, decided under the store's lock): a second request that matches the
same state (a client with the same opening, arriving together) continues another one or
starts its own, and a repeat of the last prompt never continues an anonymous conversation
(it proves nothing about who sent it). The answer's commit saves the next state unclaimed;
a request that fails leaves its state claimed, so the client's next turn starts afresh.
Bounded: the least recently used conversations are forgotten, past ``per_tenant`` of them
or past ``per_tenant_bytes`` of memory held by a tenant's conversations (``held_bytes``: the
messages as sent and as served and the reply, every dict, list and string counted as Python
holds it, and ``TOKEN_BYTES`` per cached token id), so the bound is on resident memory, not
on characters (a character takes 1 to 4 bytes, a token id 40); the one just saved is always
kept. Cost: a lookup compares the
request with each conversation of its tenant (and key, or session); without an echo (or a
declared edit) no message may differ, so a conversation whose last message differs from the
request's message at that place is ruled out by that one comparison before any walk over
the rest (the server runs lookups off its event loop too).

Drift (``find`` falls back to it when no conversation is continued message for message): a
request whose message *after* a conversation's prompt echoes that conversation's reply (the
proof above: its call ids, or its text), with the same roles before it, continues it even
though earlier messages differ in ways that are not in-place edits (a system message's
first line, a date). Such a ``Match`` has ``drift=True``: the turn serves the messages as
sent and the token diff (``directives.drift``, ``chat_context``) decides what is spliced.
Every conversation a request continues may be diffed at the token level against the tokens
its last answer left in the cache (``Conversation.tokens``); ``Match.echoed`` says whether
the request proved it holds the reply, without which no drift is believed.
"""

from __future__ import annotations

import itertools
import sys
import threading
import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from leyline_agent.directives import Mode
from leyline_agent.namespaces import SERVER_SESSION_PREFIX, Namespace
from leyline_agent.trajectory import call_ids, edited_in_place, message_text
from leyline_agent.wire import DirectivesRequest

__all__ = [
    "CONVERSATION_PREFIX",
    "Conversation",
    "ConversationStore",
    "Match",
    "TOKEN_BYTES",
    "edited_in_place",
    "held_bytes",
]

CONVERSATION_PREFIX = SERVER_SESSION_PREFIX  # an anonymous conversation's session
DEFAULT_CONVERSATIONS = 4096
DEFAULT_CONVERSATION_BYTES = 64 << 20  # per tenant, of memory held (``held_bytes``)
TOKEN_BYTES = 40  # a cached token id: its tuple slot (8) and its int object (32 allocated)
_clock = itertools.count(1)


def _echo(reply: Mapping[str, Any], echo: Mapping[str, Any]) -> str | None:
    """How ``echo`` shows it is the client's copy of a reply the server produced: ``"ids"``
    (the reply's call ids, in the echo's ``tool_calls`` or quoted in its text), ``"text"``
    (a reply without calls: the same non-empty text, to which the client may have attached
    tool calls of its own, a framework driving tools from the model's text), or ``None``."""
    if echo.get("role") != "assistant":
        return None
    ids = call_ids(reply)
    if ids:
        if ids == call_ids(echo):
            return "ids"
        quoted = message_text(echo)
        return "ids" if all(isinstance(i, str) and i in quoted for i in ids) else None
    text = message_text(reply).strip()
    return "text" if text and text == message_text(echo).strip() else None


@dataclass(slots=True)
class Conversation:
    """What the server served last in one conversation (normalized messages)."""

    id: str
    session: str
    raw: list[dict[str, Any]]  # the prompt as the client sent it
    served: list[dict[str, Any]]  # the prompt as served (sticky edits, policy edits)
    reply: dict[str, Any] | None = None
    labels: dict[int, str] = field(default_factory=dict)  # served index -> edit type
    spliced: bool = False  # its session holds spliced rows
    used: int = 0
    claimed: bool = False  # an anonymous request is continuing it (``find(claim=True)``)
    exact: bool = False  # a token-form FORGET in its session: its detected edits are FORGETs
    tokens: tuple[int, ...] | None = None  # the last answer's prompt + output ids (cached)
    owner: str = ""  # the API key that started an anonymous conversation (module doc)

    @property
    def anonymous(self) -> bool:
        """Its session is the server's own (a request that named none started it)."""
        return self.session.startswith(CONVERSATION_PREFIX)

    def visible(self, session: str | None, owner: str) -> bool:
        """May a request naming ``session`` (None: none) with key ``owner`` continue it?"""
        if session is not None:
            return self.session == session
        return self.anonymous and self.owner == owner


@dataclass(frozen=True, slots=True)
class Match:
    conversation: Conversation
    edited: tuple[int, ...]  # prompt indices the request edited in place
    known: int  # messages of the conversation the request repeats (or edits in place)
    retry: bool = False
    drift: bool = False  # found by its echo alone: earlier messages may differ in any way

    @property
    def echoed(self) -> bool:
        """The request's message after the cached prompt echoes the server's reply."""
        return not self.retry and self.known > len(self.conversation.raw)


class ConversationStore:
    """Conversations per tenant; thread-safe."""

    def __init__(
        self,
        per_tenant: int = DEFAULT_CONVERSATIONS,
        per_tenant_bytes: int = DEFAULT_CONVERSATION_BYTES,
    ) -> None:
        if per_tenant < 1 or per_tenant_bytes < 1:
            raise ValueError(f"per_tenant {per_tenant}, bytes {per_tenant_bytes}: must be >= 1")
        self.per_tenant, self.per_tenant_bytes = per_tenant, per_tenant_bytes
        self._lock = threading.Lock()
        self._tenants: dict[str, OrderedDict[str, Conversation]] = {}
        self._bytes: dict[str, dict[str, int]] = {}  # tenant -> conversation id -> held_bytes

    def find(
        self,
        tenant: str,
        session: str | None,
        messages: Sequence[Mapping[str, Any]],
        *,
        declared: frozenset[int] = frozenset(),
        claim: bool = False,
        owner: str = "",
    ) -> Match | None:
        """The conversation ``messages`` (normalized) continue, as the module doc says.
        ``declared``: messages a request of a named session says it edited in place
        (``request_edits``): believed edited as a directive request naming the session would
        be, without the echo proof (a user message too; tool results keep their call ids).
        ``owner``: the request's API key (anonymous conversations are matched per key)."""
        declared = declared if session is not None else frozenset()
        with self._lock:  # held to the claim: two requests never continue one state
            best = self._best(tenant, session, owner, messages, declared, claim)
            if best is None:
                best = self._drifted(tenant, session, owner, messages, claim)
            if best is not None and claim:
                best.conversation.claimed = True
            return best

    def _best(
        self,
        tenant: str,
        session: str | None,
        owner: str,
        messages: Sequence[Mapping[str, Any]],
        declared: frozenset[int],
        claim: bool,
    ) -> Match | None:
        scored = []
        for c in self._tenants.get(tenant, {}).values():
            if not c.visible(session, owner):
                continue
            if claim and c.claimed:
                continue  # another request already continues this state
            m = _continues(c, messages, declared)
            if m is None or (claim and m.retry):
                continue  # a repeat of the last prompt proves nothing about who sent it
            scored.append(((m.known, -len(m.edited), c.used), m))
        if not scored:
            return None
        scored.sort(key=lambda s: s[0], reverse=True)
        best_key, best = scored[0]
        rivals = [m for k, m in scored[1:] if k[:2] == best_key[:2]]
        sessions = {best.conversation.session, *(m.conversation.session for m in rivals)}
        if len(sessions) > 1 and any(m.conversation.spliced for m in (best, *rivals)):
            return None
        return best

    def _drifted(
        self,
        tenant: str,
        session: str | None,
        owner: str,
        messages: Sequence[Mapping[str, Any]],
        claim: bool,
    ) -> Match | None:
        """The conversation whose reply ``messages`` echo right after its prompt, with the
        same roles before it (own tenant, session and owner, as ``_best``); None if there is
        none, or if conversations of two sessions fit and one holds spliced rows."""
        fits = []
        for c in self._tenants.get(tenant, {}).values():
            if not c.visible(session, owner):
                continue
            if (claim and c.claimed) or c.reply is None or c.tokens is None:
                continue
            n = len(c.raw)
            if not n or len(messages) <= n or _echo(c.reply, messages[n]) is None:
                continue
            if [m.get("role") for m in c.raw] != [m.get("role") for m in messages[:n]]:
                continue
            fits.append(c)
        if not fits:
            return None
        fits.sort(key=lambda c: (len(c.raw), c.used), reverse=True)
        best = fits[0]
        rivals = [c for c in fits[1:] if len(c.raw) == len(best.raw)]
        if {c.session for c in (best, *rivals)} != {best.session} and any(
            c.spliced for c in (best, *rivals)
        ):
            return None
        return Match(best, (), len(best.raw) + 1, drift=True)

    def new(self, tenant: str, session: str | None, owner: str = "") -> Conversation:
        """A conversation not yet saved: in ``session``, or (None) in a server-made session
        of its own, owned by ``owner``. Its id (shown in answers) is not its session."""
        cid = "conv-" + uuid.uuid4().hex
        own = CONVERSATION_PREFIX + uuid.uuid4().hex if session is None else session
        return Conversation(id=cid, session=own, raw=[], served=[], owner=owner)

    def save(self, tenant: str, conv: Conversation) -> None:
        conv.used = next(_clock)
        size = held_bytes(conv)
        with self._lock:
            convs = self._tenants.setdefault(tenant, OrderedDict())
            sizes = self._bytes.setdefault(tenant, {})
            convs[conv.id] = conv
            convs.move_to_end(conv.id)
            sizes[conv.id] = size
            total = sum(sizes.values())
            while len(convs) > self.per_tenant or (
                len(convs) > 1 and total > self.per_tenant_bytes
            ):
                cid, _ = convs.popitem(last=False)
                total -= sizes.pop(cid, 0)

    def forgotten(
        self,
        tenant: str,
        session: str | None,
        old: Sequence[Mapping[str, Any]],
        new: Sequence[Mapping[str, Any]],
        owner: str = "",
    ) -> int:
        """A message-form FORGET ``old`` -> ``new`` (normalized) has run: each conversation of
        the directive's session (anonymous ones for a directive that names none) whose prompt
        ``old`` starts with takes ``new``'s messages in place of the ones it changed, so the
        chat request that sends the edited history continues it with nothing left to splice
        (a client edit there would be AMORTIZE by default, undoing the FORGET). Only in-place
        edits (lists of one length) are recorded: after a FORGET that drops or adds messages
        the edited history no longer continues the conversation, and is prefilled exactly.
        ``owner``: the directive's API key (anonymous conversations of other keys are not
        touched). How many conversations were updated."""
        if len(old) != len(new):
            return 0
        old, new = list(old), list(new)
        updated = 0
        with self._lock:
            convs = self._tenants.get(tenant, {})
            for cid, c in list(convs.items()):
                if not c.visible(session, owner):
                    continue
                n = len(c.raw)
                if not n or len(old) < n or old[:n] not in (c.raw, c.served):
                    continue
                changed = [i for i in range(n) if old[i] != new[i]]
                if not changed:
                    continue
                raw, served = list(c.raw), list(c.served)
                labels = {i: v for i, v in c.labels.items() if i not in changed}
                for i in changed:
                    raw[i] = served[i] = dict(new[i])
                # tokens: the FORGET changed them; a token diff against the old ones
                # would find its edit again and splice it back
                convs[cid] = replace(c, raw=raw, served=served, labels=labels, tokens=None)
                self._bytes.setdefault(tenant, {})[cid] = held_bytes(convs[cid])
                updated += 1
        return updated

    def mark_exact(self, tenant: str, session: str) -> int:
        """A token-form FORGET has run in ``session`` (its spans cannot be mapped back to
        messages): from now on the session's conversations splice detected client edits as
        FORGET, never AMORTIZE, so no later edit of the same span amortizes it back. How many
        conversations were marked."""
        with self._lock:
            mine = [c for c in self._tenants.get(tenant, {}).values() if c.session == session]
            for c in mine:
                c.exact = True
            return len(mine)

    def directive_ran(self, ns: Namespace, req: DirectivesRequest, owner: str = "") -> None:
        """A directive request ``req`` has run in ``ns``: what its FORGETs forgot stays
        forgotten. A message-form FORGET gives the conversations it edited its new messages
        (``forgotten``), so the chat request that sends the edited history continues them
        with nothing left to splice (a client edit there would be AMORTIZE by default,
        undoing the FORGET); a token-form FORGET marks the session exact (``mark_exact``)."""
        if req.mode == Mode.FORGET and req.old_messages is not None:
            assert req.new_messages is not None  # a message-form request has both
            self.forgotten(ns.tenant, ns.session, req.old_messages, req.new_messages, owner)
        forgets = any(d.mode == Mode.FORGET for d in req.directives or [])
        if forgets and ns.session is not None:
            self.mark_exact(ns.tenant, ns.session)

    def forget_tenant(self, tenant: str) -> int:
        """Drop every conversation of ``tenant`` (a cache flush); how many there were."""
        with self._lock:
            self._bytes.pop(tenant, None)
            return len(self._tenants.pop(tenant, {}))

    def __len__(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._tenants.values())


def held_bytes(conv: Conversation) -> int:
    """The memory ``conv`` holds: its messages (as sent, as served, the reply), each dict, list
    and string once (``sys.getsizeof``; a message shared by the two lists counts once), and
    ``TOKEN_BYTES`` per cached token id. An upper bound of what dropping it frees: objects it
    shares with another conversation are counted in both."""
    seen: set[int] = set()
    total = 0
    todo: list[Any] = [conv.raw, conv.served, conv.reply]
    while todo:
        value = todo.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        total += sys.getsizeof(value)
        if isinstance(value, Mapping):
            todo.extend(value.keys())
            todo.extend(value.values())
        elif isinstance(value, list | tuple):
            todo.extend(value)
    return total + TOKEN_BYTES * len(conv.tokens or ())


def _continues(
    c: Conversation, messages: Sequence[Mapping[str, Any]], declared: frozenset[int] = frozenset()
) -> Match | None:
    if not c.raw:
        return None
    n = len(c.raw)
    if len(messages) <= n:
        return Match(c, (), 0, retry=True) if list(messages) == c.raw else None
    echo = _echo(c.reply, messages[n]) if c.reply is not None else None
    if echo is None and not declared and messages[n - 1] != c.raw[-1]:
        return None  # without an echo no edit is believed: one differing message ends it
    edited = []
    for i, (old, new) in enumerate(zip(c.raw, messages, strict=False)):
        if old == new:
            continue
        if not edited_in_place(old, new, user=echo == "ids" or i in declared):
            return None
        edited.append(i)
    echoed = echo is not None
    if edited and not echoed and not set(edited) <= declared:
        return None  # an edit is only believed from the client that got the reply, or
        # declared by a request that names the session (what a directive request may do)
    return Match(c, tuple(edited), len(c.raw) + int(echoed))
