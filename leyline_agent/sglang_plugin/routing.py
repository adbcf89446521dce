"""Which radix namespace a request reads and writes: SGLang 0.5.23's ``extra_key``.

What SGLang 0.5.23 does with ``extra_key`` (``sglang/srt/...``):
- ``RadixKey.child_key_at`` (``mem_cache/radix_cache.py:222-247``) keys a node's children
  by ``(extra_key, token)`` when the key has one, by ``token`` when not. So two extra keys
  never share a node, not even a child of the root: each extra key is a separate tree
  under the one root, and an exact prefix is not shared across them either.
  ``RadixKey.match_at`` refuses to compare keys of two namespaces (``_check_compatible``,
  ``:166-176``). ``cache_salt`` namespaces the same way (``:245-246``).
- A slot belongs to exactly one tree node: the ``TokenToKVPoolAllocator`` keeps no
  reference counts (``mem_cache/allocator/token.py:54-75``) and ``RadixCache.evict`` frees
  a leaf's slots outright (``radix_cache.py:552-577``, the free at ``:569``). Two
  namespaces therefore cannot hold the same slots; a namespace that needs another's rows
  gets copies (``splice.py``).
- The key travels with the request: ``GenerateReqInput.extra_key``
  (``managers/io_struct.py:325``; the OpenAI routes take ``extra_key`` and ``cache_salt``
  in the body, ``entrypoints/openai/protocol.py:434,1052``, ``serving_chat.py:1397``) ->
  ``TokenizerManager`` (``managers/tokenizer_manager.py:1618``) ->
  ``TokenizedGenerateReqInput.extra_key`` (``io_struct.py:1137``) -> ``Req(extra_key=...)``
  in ``Scheduler`` (``managers/scheduler.py:3025``; a LoRA id is appended,
  ``managers/schedule_batch.py:1165-1170``) -> every ``match_prefix`` and ``insert`` of the
  request (``mem_cache/common.py:207-212``, ``radix_cache.py:450-490``).
  ``Engine.generate`` has no ``extra_key`` argument (``entrypoints/engine.py:433-541``), so
  ``client.py`` builds the ``GenerateReqInput`` itself.

Leyline's use of it is the plugins' one rule (``directives.routing``): no extra key is the
plain tree of exact rows, a session's extra key is ``Namespace(tenant, session).key``
(``leyline/...``; the anonymous session's too), and every request is routed by
``route_key``: to its namespace's tree as soon as that tree holds any prefix of it (its
first token), otherwise to the plain tree. A session's tree holds each splice's ``T'`` in
full (the head reused from the session's tree or copied from the plain tree, the rotated
tail in new slots). The price of the rule: after a splice of the anonymous session, every
session-less request that starts like it (the same first token, usually every chat) is
served from the anonymous tree, and re-prefills there once what it had in the plain tree.

The hooks: ``before_generate_request`` (main process, ``TokenizerManager.generate_request``)
turns the ``X-Leyline-Session`` header into the request's extra key; ``before_scheduler_request``
(every scheduler rank, ``Scheduler.handle_generate_request``) applies ``route_key``. Every TP
rank holds a replica of the tree and routes alike. Requests with a ``cache_salt`` or a
foreign ``extra_key`` are left alone: they never see a Leyline splice.
"""

from __future__ import annotations

# No torch at import (``batch.py`` and the HTTP route import this): tree lookups import
# ``treeview`` when called.
from collections.abc import Sequence
from typing import Any

from leyline_agent.directives.routing import route_namespace
from leyline_agent.errors import DirectiveError
from leyline_agent.namespaces import ANONYMOUS, SESSION_HEADER, Namespace, check_session_id

__all__ = [
    "ANONYMOUS_KEY",
    "before_generate_request",
    "before_scheduler_request",
    "check_namespace",
    "is_leyline_key",
    "route_key",
    "route_request",
]

ANONYMOUS_KEY = ANONYMOUS.key
_PREFIX = "leyline/"


def is_leyline_key(key: object) -> bool:
    return isinstance(key, str) and key.startswith(_PREFIX)


def check_namespace(namespace: object) -> str:
    if not is_leyline_key(namespace):
        raise DirectiveError(
            f"namespace: {namespace!r} is not a Leyline namespace key (Namespace(...).key)"
        )
    return namespace


def route_key(tree: Any, token_ids: Sequence[int], namespace: str | None) -> str | None:
    """The tree a request of ``namespace`` (None: the anonymous one) is matched in
    (``directives.routing``): its namespace if that tree holds a prefix of ``token_ids``
    (their first token), else ``None`` (the plain tree). Read-only, one dictionary lookup."""
    from leyline_agent.sglang_plugin.treeview import peek_prefix

    def holds_start(ns: str) -> bool:
        return bool(token_ids) and bool(peek_prefix(tree, token_ids[:1], ns).length)

    return route_namespace(namespace, ANONYMOUS_KEY, is_leyline_key, holds_start)


def route_request(tree: Any, req: Any) -> None:
    """Set ``req.extra_key`` (a ``TokenizedGenerateReqInput``) to the tree it must use."""
    from sglang.srt.mem_cache.radix_cache import RadixCache

    key = getattr(req, "extra_key", None)
    if getattr(req, "cache_salt", None) or (key is not None and not is_leyline_key(key)):
        return  # the caller's own namespace: no splice is ever there
    if type(tree) is not RadixCache or tree.disable or tree.page_size != 1:
        req.extra_key = None  # no Leyline splices without the plugin's tree
        return
    ids = req.input_ids
    req.extra_key = route_key(tree, ids, key) if ids is not None else None


def before_scheduler_request(scheduler: Any, recv_req: Any, *args: Any, **kwargs: Any) -> None:
    """``HookType.BEFORE`` on ``Scheduler.handle_generate_request``; args unchanged."""
    route_request(scheduler.tree_cache, recv_req)
    return None


def before_generate_request(
    tokenizer_manager: Any, obj: Any, request: Any = None, *args: Any, **kwargs: Any
) -> None:
    """``HookType.BEFORE`` on ``TokenizerManager.generate_request(obj, request)``: a request
    with the ``X-Leyline-Session`` header gets that session's extra key. Raises
    ``ValueError`` (SGLang answers 400) for a bad id, or for a header together with a body
    ``extra_key`` / ``cache_salt`` (the session's rows live under the Leyline key only)."""
    request = kwargs.get("request", request)
    headers = getattr(request, "headers", None)
    value = headers.get(SESSION_HEADER) if headers is not None else None
    if value is None or not hasattr(obj, "extra_key"):
        return None
    sid = check_session_id(value, SESSION_HEADER)
    for name in ("extra_key", "cache_salt"):
        if getattr(obj, name, None) not in (None, ""):
            raise ValueError(
                f"{name}: cannot be combined with the {SESSION_HEADER} header "
                "(the session's spliced rows live under its own Leyline key)"
            )
    obj.extra_key = Namespace(session=sid).key
    return None
