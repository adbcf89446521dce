"""Which prefix-cache namespace a vLLM request reads and writes: its ``cache_salt``.

What vLLM 0.32 does with ``cache_salt`` (``vllm/v1/core/kv_cache_utils.py``): the salt is an
extra key of the first block's hash (``generate_block_hash_extra_keys``), and every block
hash chains over its parent, so two salts never share a block, not even the first one. A
salt is at most 128 characters without ``@ / \\`` or NUL (``validate_cache_salt``).

Leyline's use of it (the rule is ``leyline_agent.namespaces``):

- **no salt** holds exact rows only: plain prefills, shared by token identity. No splice
  ever writes there.
- a session's namespace, salt :func:`salt_for` ``(Namespace(session=id))``, holds the
  session's spliced ``T'`` (each block either the session's own or a copy) and everything
  its requests computed on top of them. Requests that name no session belong to the
  anonymous session, ``salt_for(Namespace())``, which is a session like any other.
- **routing** (:func:`route_salt`, applied by the scheduler to every request): a request of
  namespace ``N`` is looked up (and its new blocks cached) under ``N``'s salt as soon as
  ``N`` holds the first block of its prompt, otherwise without a salt. A session that never
  spliced shares exact blocks with everyone; after a splice its requests stay in its own
  namespace while that namespace holds their first block. Other sessions and plain requests
  never look there. Requests with a salt of their own (not a Leyline salt) are left alone.

A client names its session with the ``X-Leyline-Session`` header (``wrap_openai`` sends it on
every call); the plugin's middleware turns it into the request's ``cache_salt``. No torch,
no vLLM imports here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

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
    """The salt a request with ``salt`` is served under (see the module docstring).

    ``holds_first_block(s)``: whether namespace ``s`` has the request's first block cached.
    A foreign salt is returned unchanged.
    """
    if salt is not None and not is_leyline_salt(salt):
        return salt
    target = salt if salt is not None else anonymous
    return target if holds_first_block(target) else None
