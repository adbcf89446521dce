"""The agent side's sessions: one registry behind ``wrap_openai`` and ``LeylineTransport``.

A call either names its session (a header, a body key, the wrapper's ``session_id``) or is
found by content: the session whose conversation the call continues
(``ContextSession.continued_by``: the longest, then one whose observed reply the call
echoes, then the least recently used), among the sessions found by content for the same
server (``root``) that have no call in flight. None continues -> a new session.

Both kinds are bounded, least recently used dropped first, never one with a call in flight:
``MAX_FOUND`` sessions found by content, ``MAX_NAMED`` named ones (a service that names a
session per user keeps the active ones). A dropped session's next call starts afresh: its
history is sent as the agent has it, which the server prefills (exact, only slower).
Thread-safe: every method takes the registry's lock.
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from leyline_agent.agent.session import ContextSession

__all__ = ["MAX_FOUND", "MAX_NAMED", "SessionRegistry"]

MAX_FOUND = 256
MAX_NAMED = 4096


@dataclass(slots=True)
class _Entry:
    session: ContextSession
    root: str
    busy: bool = False


class SessionRegistry:
    def __init__(
        self,
        new_session: Callable[[str], ContextSession],
        *,
        max_found: int = MAX_FOUND,
        max_named: int = MAX_NAMED,
    ) -> None:
        self._new = new_session
        self._max = {False: max_found, True: max_named}
        self._named: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._found: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def sessions(self) -> list[ContextSession]:
        """Every session kept, named ones first (a snapshot)."""
        with self._lock:
            return [e.session for e in (*self._named.values(), *self._found.values())]

    def named(self, sid: str, root: str = "", *, busy: bool = False) -> ContextSession:
        """The session ``sid`` names, made on first use (a session found by content that has
        this id is that session: one id, one session). ``busy``: until ``release``."""
        with self._lock:
            table = self._found if sid in self._found else self._named
            entry = table.pop(sid, None) or _Entry(self._new(sid), root)
            self._keep(table, sid, entry, named=table is self._named)
            entry.busy = entry.busy or busy
            return entry.session

    def by_content(
        self, messages: Sequence[dict[str, Any]], root: str = "", first_id: str | None = None
    ) -> ContextSession:
        """The session ``messages`` continue, marked busy until ``release``; else a new one
        (``first_id`` for the first new one, if no session has that id yet)."""
        with self._lock:
            best: _Entry | None = None
            best_key: tuple[int, bool] | None = None
            for entry in self._found.values():
                if entry.busy or entry.root != root:
                    continue
                key = entry.session.continued_by(messages)
                if key is not None and (best_key is None or key > best_key):
                    best, best_key = entry, key
            if best is None:
                taken = first_id is None or first_id in self._named or first_id in self._found
                sid = f"leyline-{uuid.uuid4().hex[:12]}" if taken else first_id
                best = _Entry(self._new(sid), root)
            else:
                del self._found[best.session.session_id]
            self._keep(self._found, best.session.session_id, best, named=False)
            best.busy = True
            return best.session

    def release(self, session: ContextSession) -> None:
        """The call of ``session`` is over: it may be found by content again."""
        with self._lock:
            sid = session.session_id
            entry = self._found.get(sid) or self._named.get(sid)
            if entry is not None and entry.session is session:
                entry.busy = False

    def _keep(self, table: OrderedDict[str, _Entry], sid: str, entry: _Entry, named: bool) -> None:
        table[sid] = entry  # most recently used last
        over = len(table) - self._max[named]
        for old in [k for k, e in table.items() if not e.busy and k != sid][: max(over, 0)]:
            del table[old]
