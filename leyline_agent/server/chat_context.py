"""``leyline serve``'s transport of a tracked chat turn (``front.chat_turn``).

``prepare_chat`` runs before a chat request is rendered: it finds the request's conversation
(``begin_turn``), runs the turn's job on the worker in the conversation's session order (its
directives never land in the middle of another request of the same conversation), and
returns the ``PreparedChat`` the route serves: it renders and generates
``PreparedChat.messages`` in ``PreparedChat.namespace``, adds ``body`` to its answer and
``usage`` to ``usage.leyline``, and calls ``commit(reply, tokens)`` with the answer's prompt
and output ids once the answer is complete.

The lookup (``begin_turn``: the request's messages compared with the tenant's
conversations, up to ``conversations.DEFAULT_CONVERSATIONS`` of them, each as long as a
request may be) runs on ``LOOKUP_THREADS`` threads of its own, never on the event loop: at
thousands of long conversations it is tenths of a second of CPU per request, which on the
loop would stall every stream and ``/health``.

Mode: ``leyline serve --client-edits amortize|forget|off`` (``create_app(client_edits=)``),
overridden per request by ``{"leyline": {"client_edits": ...}}``.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from fastapi import Request

from leyline_agent.front.chat_turn import PreparedChat, begin_turn
from leyline_agent.namespaces import Namespace
from leyline_agent.server.disconnect import run_connected
from leyline_agent.server.state import ServerState
from leyline_agent.server.tenants import key_owner
from leyline_agent.server.worker import session_key

__all__ = ["LOOKUP_THREADS", "PreparedChat", "prepare_chat"]

LOOKUP_THREADS = 2
_LOOKUPS = ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix="leyline-lookup")


async def prepare_chat(
    request: Request,
    st: ServerState,
    raw_messages: list[dict[str, Any]],
    context_management: Any,
    leyline: Any,
    tools: list[dict[str, Any]] | None,
    ns: Namespace,
    *,
    declared: frozenset[int] = frozenset(),
) -> PreparedChat | None:
    """The conversation-tracked form of the request, or None (serve it as it is).
    ``declared``: indices the request says it edited in place (``request_edits``)."""
    tok = st.worker.engine.tokenizer  # called on the worker thread only (inside the job)

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False)) if text else 0

    lookup = partial(
        begin_turn,
        st.conversations,
        st.client_edits,
        raw_messages,
        context_management,
        leyline,
        tools,
        ns,
        count,
        declared=declared,
        owner=key_owner(request),
    )
    turn = await asyncio.get_running_loop().run_in_executor(_LOOKUPS, lookup)
    if turn is None:
        return None
    out = await run_connected(request, st.worker, turn.run, key=session_key(turn.namespace))
    return turn.prepared(out)
