"""Stored responses: what ``previous_response_id`` and ``GET /v1/responses/{id}`` read.

Each tenant has its own bounded store (least recently used first out): a response is found
only by requests of the tenant that created it, so an id leaked to another tenant reads as
unknown. An entry holds the response object as it was answered and the conversation it
ends, as chat messages without the request's ``instructions``: the input history, the
input and the assistant's reply, in the canonical form the chat route committed. A request
that continues it serves that list plus its own input, so the chat route's conversation
matching sees the same prefix it cached.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_STORED_RESPONSES", "ResponseStore", "StoredResponse"]

DEFAULT_STORED_RESPONSES = 1024  # per tenant


@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object, as answered
    conversation: list[dict[str, Any]]  # chat messages, reply included, no instructions


class ResponseStore:
    """Per-tenant LRU maps of response id -> ``StoredResponse`` (thread-safe)."""

    def __init__(self, per_tenant: int = DEFAULT_STORED_RESPONSES) -> None:
        if per_tenant < 1:
            raise ValueError(f"per_tenant: {per_tenant} must be >= 1")
        self.per_tenant = per_tenant
        self._tenants: dict[str, OrderedDict[str, StoredResponse]] = {}
        self._lock = threading.Lock()

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        with self._lock:
            entries = self._tenants.get(tenant)
            if entries is None or response_id not in entries:
                return None
            entries.move_to_end(response_id)
            return entries[response_id]

    def put(self, tenant: str, response_id: str, entry: StoredResponse) -> None:
        with self._lock:
            entries = self._tenants.setdefault(tenant, OrderedDict())
            entries[response_id] = entry
            entries.move_to_end(response_id)
            while len(entries) > self.per_tenant:
                entries.popitem(last=False)

    def delete(self, tenant: str, response_id: str) -> bool:
        with self._lock:
            entries = self._tenants.get(tenant)
            return entries is not None and entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        with self._lock:
            return sum(len(e) for e in self._tenants.values())
