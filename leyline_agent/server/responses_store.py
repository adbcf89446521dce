"""Stored responses: what ``previous_response_id`` and ``GET /v1/responses/{id}`` read.

Each tenant has its own bounded store (least recently used first out): a response is found
only by requests of the tenant that created it, so an id leaked to another tenant reads as
unknown. An entry holds the response object as it was answered and the conversation it
ends, as chat messages without the request's ``instructions``: the input history, the
input and the assistant's reply, in the canonical form the chat route committed. A request
that continues it serves that list plus its own input, so the chat route's conversation
matching sees the same prefix it cached.

Bounds (``StoreLimits``), so that a tenant's store has a size one can budget for:

- per tenant, at most ``entries`` responses and ``tenant_bytes`` bytes (an entry's size is
  the compact JSON of its response and conversation); past either, the least recently used
  go first;
- an entry is at most ``entry_bytes``: ``check_request`` refuses a request that asks to store
  more (its input plus the history it continues) before it runs, a 400 naming ``store``;
- an entry expires ``ttl_s`` after it was stored (then it reads as unknown);
- what a request would store beside its input is checked as OpenAI checks it
  (``check_request``): ``metadata`` at most 16 pairs, keys at most 64 characters, values at
  most 512; ``user`` at most 512 characters; ``text`` only ``format`` and ``verbosity``.

``stats(tenant)`` counts a tenant's entries and bytes (``/leyline/v1/stats``);
``forget_tenant`` empties a tenant's store (``/leyline/v1/flush``).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from leyline_agent.server.errors import RequestError

__all__ = [
    "DEFAULT_STORED_RESPONSES",
    "ResponseStore",
    "StoreLimits",
    "StoredResponse",
    "check_request",
    "entry_bytes",
]

DEFAULT_STORED_RESPONSES = 1024  # per tenant
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's
MAX_USER_CHARS = 512
TEXT_KEYS = frozenset({"format", "verbosity"})


@dataclass(frozen=True, slots=True)
class StoreLimits:
    entries: int = DEFAULT_STORED_RESPONSES  # per tenant
    tenant_bytes: int = 256 << 20
    entry_bytes: int = 4 << 20
    ttl_s: float = 30 * 24 * 3600.0  # OpenAI keeps a stored response 30 days


@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object, as answered
    conversation: list[dict[str, Any]]  # chat messages, reply included, no instructions
    nbytes: int = 0  # set by ``put``
    expires: float = 0.0  # time.monotonic() past which it is gone; set by ``put``


def entry_bytes(*values: Any) -> int:
    """Bytes of ``values`` as compact JSON (what an entry is counted as)."""
    return sum(
        len(json.dumps(v, ensure_ascii=False, separators=(",", ":"), default=str).encode())
        for v in values
    )


def check_request(
    *,
    store: bool,
    metadata: dict[str, str] | None,
    user: str | None,
    text: dict[str, Any] | None,
    stored_bytes: int,
    limits: StoreLimits,
) -> None:
    """Refuse (``RequestError`` naming the field) what the store would not keep as asked;
    ``stored_bytes``: the input and history the response would store."""
    if metadata is not None:
        if len(metadata) > MAX_METADATA_PAIRS:
            raise RequestError(f"{len(metadata)} pairs; at most {MAX_METADATA_PAIRS}", "metadata")
        for key, value in metadata.items():
            if len(key) > MAX_METADATA_KEY:
                raise RequestError(
                    f"a key of {len(key)} characters; at most {MAX_METADATA_KEY}", "metadata"
                )
            if len(value) > MAX_METADATA_VALUE:
                raise RequestError(
                    f"{len(value)} characters; at most {MAX_METADATA_VALUE}",
                    f"metadata.{key}",
                )
    if user is not None and len(user) > MAX_USER_CHARS:
        raise RequestError(f"{len(user)} characters; at most {MAX_USER_CHARS}", "user")
    for key in sorted(set(text or {}) - TEXT_KEYS):
        raise RequestError(f"unknown field; known: {sorted(TEXT_KEYS)}", f"text.{key}")
    if store and stored_bytes > limits.entry_bytes:
        raise RequestError(
            f"the response would store {stored_bytes} bytes of input and history; a stored "
            f"response holds at most {limits.entry_bytes} (send store: false, or less)",
            "store",
        )


class ResponseStore:
    """Per-tenant LRU maps of response id -> ``StoredResponse`` (thread-safe)."""

    def __init__(self, per_tenant: int | None = None, limits: StoreLimits | None = None) -> None:
        limits = limits or StoreLimits()
        if per_tenant is not None:
            limits = StoreLimits(per_tenant, limits.tenant_bytes, limits.entry_bytes, limits.ttl_s)
        if limits.entries < 1:
            raise ValueError(f"per_tenant: {limits.entries} must be >= 1")
        self.limits = limits
        self.per_tenant = limits.entries
        self._tenants: dict[str, OrderedDict[str, StoredResponse]] = {}
        self._bytes: dict[str, int] = {}
        self._lock = threading.Lock()

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        with self._lock:
            entries = self._tenants.get(tenant)
            if entries is None or response_id not in entries:
                return None
            entry = entries[response_id]
            if entry.expires <= time.monotonic():
                self._drop(tenant, response_id)
                return None
            entries.move_to_end(response_id)
            return entry

    def put(self, tenant: str, response_id: str, entry: StoredResponse) -> None:
        entry.nbytes = entry_bytes(entry.response, entry.conversation)
        entry.expires = time.monotonic() + self.limits.ttl_s
        with self._lock:
            entries = self._tenants.setdefault(tenant, OrderedDict())
            if response_id in entries:
                self._drop(tenant, response_id)
            entries[response_id] = entry
            self._bytes[tenant] = self._bytes.get(tenant, 0) + entry.nbytes
            now = time.monotonic()
            while entries and (
                len(entries) > self.limits.entries
                or self._bytes[tenant] > self.limits.tenant_bytes
                or next(iter(entries.values())).expires <= now
            ):
                self._drop(tenant, next(iter(entries)))

    def delete(self, tenant: str, response_id: str) -> bool:
        with self._lock:
            entries = self._tenants.get(tenant)
            if entries is None or response_id not in entries:
                return False
            self._drop(tenant, response_id)
            return True

    def forget_tenant(self, tenant: str) -> int:
        """Drop every entry of ``tenant``; how many there were."""
        with self._lock:
            entries = self._tenants.pop(tenant, None)
            self._bytes.pop(tenant, None)
            return len(entries or ())

    def stats(self, tenant: str) -> tuple[int, int]:
        """``(entries, bytes)`` of ``tenant``'s store."""
        with self._lock:
            return len(self._tenants.get(tenant) or ()), self._bytes.get(tenant, 0)

    def _drop(self, tenant: str, response_id: str) -> None:
        entry = self._tenants[tenant].pop(response_id)
        self._bytes[tenant] -= entry.nbytes

    def __len__(self) -> int:
        with self._lock:
            return sum(len(e) for e in self._tenants.values())
