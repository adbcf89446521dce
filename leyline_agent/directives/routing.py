"""Which namespace of a plugin engine's prefix cache a request is served in (pure).

The rule of both plugins, each over its engine's own namespace key (vLLM's ``cache_salt``:
``vllm_plugin.namespace``; SGLang's radix ``extra_key``: ``sglang_plugin.routing``); the
namespaces themselves are ``leyline_agent.namespaces``':

- the **plain namespace** (no key) holds exact rows only: plain prefills, shared by token
  identity. No splice ever writes there.
- a session's namespace holds the session's spliced ``T'`` and every row its requests
  computed on top of it. Requests that name no session belong to the anonymous session,
  which is a session like any other.
- **routing** (``route_namespace``): a request of namespace ``N`` is looked up (and its new
  rows cached) in ``N`` as soon as ``N`` holds the start of its prompt, otherwise in the
  plain namespace. A session that never spliced shares exact rows with everyone; after a
  splice its requests stay in its own namespace while that namespace holds their start
  (evicted: the next request is a fresh prefill of exact rows). Other sessions and plain
  requests never look there. Why not "the longer match wins": the plain namespace may hold
  the session's edited tokens as exact rows that someone else sent; the session would then
  be served those instead of its own splice, and its answers would depend on what another
  client sent.
- a request with a key of its own that is not a Leyline one (a client's ``cache_salt``, a
  foreign ``extra_key``) is left alone: it never sees a Leyline splice.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["route_namespace"]


def route_namespace(
    key: str | None,
    anonymous: str,
    is_leyline: Callable[[str], bool],
    holds_start: Callable[[str], bool],
) -> str | None:
    """The key a request with ``key`` (None: it names none) is served under (module doc):
    ``key`` unchanged when it is not a Leyline one; else its namespace (``anonymous`` when
    it names none) if ``holds_start`` of it, else None (the plain namespace)."""
    if key is not None and not is_leyline(key):
        return key
    target = key if key is not None else anonymous
    return target if holds_start(target) else None
