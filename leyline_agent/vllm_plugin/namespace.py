"""Which prefix-cache namespace a vLLM request reads and writes: its ``cache_salt``.

What vLLM 0.32 does with ``cache_salt`` (``vllm/v1/core/kv_cache_utils.py``): the salt is an
extra key of the first block's hash (``generate_block_hash_extra_keys``), and every block
hash chains over its parent, so two salts never share a block, not even the first one. A
salt is at most 128 characters without ``@ / \\`` or NUL (``validate_cache_salt``).

Leyline's use of it is the plugins' one rule (``directives.routing``): no salt is the plain
namespace of exact rows, a session's salt is :func:`salt_for` of its ``Namespace`` (the
anonymous session's too), and the scheduler routes every request with :func:`route_salt`
(a namespace "holds the start" of a prompt when it has the prompt's first block cached, or
the plugin holds the rows of a shorter start). Requests with a salt of their own (not a
Leyline salt) are left alone.

A client names its session with the ``X-Leyline-Session`` header (``wrap_openai`` sends it on
every call); the plugin's middleware turns it into the request's ``cache_salt``. No torch,
no vLLM imports here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from leyline_agent.directives.routing import route_namespace
from leyline_agent.namespaces import Namespace

__all__ = ["SALT_PREFIX", "is_leyline_salt", "route_salt", "salt_for"]

SALT_PREFIX = "leyline-"


def salt_for(ns: Namespace) -> str:
    """The ``cache_salt`` of ``ns``: a digest of ``ns.key`` (the key itself holds ``/``,
    which vLLM refuses in a salt)."""
    return SALT_PREFIX + hashlib.sha256(ns.key.encode()).hexdigest()[:40]


def is_leyline_salt(salt: object) -> bool:
    return isinstance(salt, str) and salt.startswith(SALT_PREFIX)


def route_salt(
    salt: str | None, anonymous: str, holds_first_block: Callable[[str], bool]
) -> str | None:
    """The salt a request with ``salt`` is served under (``directives.routing``);
    ``holds_first_block(s)``: whether namespace ``s`` holds the request's start."""
    return route_namespace(salt, anonymous, is_leyline_salt, holds_first_block)
