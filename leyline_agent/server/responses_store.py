"""Stored responses: what ``previous_response_id`` and ``GET /v1/responses/{id}`` read.

Each tenant has its own bounded store (least recently used first out): a response is found
only by requests of the tenant that created it, so an id leaked to another tenant reads as
unknown. An entry holds the response object as it was answered and the conversation it
ends, as chat messages without the request's ``instructions``: the input history, the
input and the assistant's reply, in the canonical form the chat route committed. A request
that continues it serves that list plus its own input, so the chat route's conversation
matching sees the same prefix it cached.

Entries live on disk, not in memory: each is one file in the store's directory (its
response's and its conversation's compact JSON), and memory holds only an index of them (a
path, a size and an expiry per entry, about 300 bytes), so a tenant's stored responses cost
the server's resident memory nothing that grows with their text; a read parses the file
again (the routes run reads and writes off the event loop).

Bounds (``StoreLimits``), so that a tenant's store has a size one can budget for:

- per tenant, at most ``entries`` responses and ``tenant_bytes`` bytes on disk (an entry's
  size is the compact JSON of its response and conversation, its file less one newline);
  past either, the least recently used go first (their files with them);
- an entry is at most ``entry_bytes``: ``check_request`` refuses a request that asks to store
  more (its input plus the history it continues) before it runs, a 400 naming ``store``;
- an entry expires ``ttl_s`` after it was stored (then it reads as unknown);
- what a request would store beside its input is checked as OpenAI checks it
  (``check_request``): ``metadata`` at most 16 pairs, keys at most 64 characters, values at
  most 512; ``user`` at most 512 characters; ``text`` only ``format`` and ``verbosity``.

``stats(tenant)`` counts a tenant's entries and bytes (``/leyline/v1/stats``);
``forget_tenant`` empties a tenant's store and deletes its files (``/leyline/v1/flush``).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leyline_agent.server.errors import RequestError

__all__ = [
    "DEFAULT_STORED_RESPONSES",
    "SPILL_PREFIX",
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
SPILL_PREFIX = "leyline-responses-"  # + the server's pid: its store's directory


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


@dataclass(frozen=True, slots=True)
class _Index:
    """What memory holds of a stored entry."""

    path: Path  # its file: the response's compact JSON, a newline, the conversation's
    nbytes: int
    expires: float


def entry_bytes(*values: Any) -> int:
    """Bytes of ``values`` as compact JSON (what an entry is counted as)."""
    return sum(len(_dumps(v)) for v in values)


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
    """Per-tenant LRU indexes of response id -> an entry spilled to ``directory`` (thread-safe).

    Each entry is one file (its response's and its conversation's compact JSON, one line
    each); memory holds only the index (``_Index``: a path, a size, an expiry per entry).
    ``put``, ``get`` and ``forget_tenant`` do file I/O and JSON work: the routes call them off
    the event loop (``offload.off_loop``). ``directory`` (default: a new directory under the
    system's temporary directory) belongs to the store: it is emptied by ``close`` (also run at
    exit), and a store made with the default removes the directories earlier servers on this
    machine left behind when they died (their process is gone)."""

    def __init__(
        self,
        per_tenant: int | None = None,
        limits: StoreLimits | None = None,
        directory: Path | None = None,
    ) -> None:
        limits = limits or StoreLimits()
        if per_tenant is not None:
            limits = StoreLimits(per_tenant, limits.tenant_bytes, limits.entry_bytes, limits.ttl_s)
        if limits.entries < 1:
            raise ValueError(f"per_tenant: {limits.entries} must be >= 1")
        self.limits = limits
        self.per_tenant = limits.entries
        if directory is None:
            _sweep_dead()
            directory = Path(tempfile.mkdtemp(prefix=f"{SPILL_PREFIX}{os.getpid()}-"))
        else:
            directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self._tenants: dict[str, OrderedDict[str, _Index]] = {}
        self._bytes: dict[str, int] = {}
        self._files = itertools.count()
        self._lock = threading.Lock()
        self._closed = weakref.finalize(self, shutil.rmtree, directory, ignore_errors=True)

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The entry, read back from its file; None if unknown, expired or forgotten."""
        with self._lock:
            entries = self._tenants.get(tenant)
            if entries is None or response_id not in entries:
                return None
            index = entries[response_id]
            if index.expires <= time.monotonic():
                self._drop(tenant, response_id)
                return None
            entries.move_to_end(response_id)
        try:  # outside the lock: a put may evict it meanwhile (then it reads as unknown)
            response, conversation = index.path.read_bytes().split(b"\n", 1)
        except FileNotFoundError:
            return None
        return StoredResponse(
            json.loads(response), json.loads(conversation), index.nbytes, index.expires
        )

    def has(self, tenant: str, response_id: str) -> bool:
        """Is ``response_id`` stored for ``tenant`` (no file read)?"""
        with self._lock:
            index = self._tenants.get(tenant, {}).get(response_id)
            return index is not None and index.expires > time.monotonic()

    def put(self, tenant: str, response_id: str, entry: StoredResponse) -> None:
        """Store ``entry``: written to its own file, then indexed; least recently used entries
        past the tenant's bounds go (their files with them)."""
        response, conversation = (_dumps(v) for v in (entry.response, entry.conversation))
        entry.nbytes = len(response) + len(conversation)
        entry.expires = time.monotonic() + self.limits.ttl_s
        path = self.directory / f"{next(self._files)}.json"
        path.write_bytes(response + b"\n" + conversation)
        with self._lock:
            entries = self._tenants.setdefault(tenant, OrderedDict())
            if response_id in entries:
                self._drop(tenant, response_id)
            entries[response_id] = _Index(path, entry.nbytes, entry.expires)
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
        """Drop every entry of ``tenant`` (their files too); how many there were."""
        with self._lock:
            entries = self._tenants.pop(tenant, None) or {}
            self._bytes.pop(tenant, None)
        for index in entries.values():
            index.path.unlink(missing_ok=True)
        return len(entries)

    def stats(self, tenant: str) -> tuple[int, int]:
        """``(entries, bytes)`` of ``tenant``'s store (the bytes are its files' on disk)."""
        with self._lock:
            return len(self._tenants.get(tenant) or ()), self._bytes.get(tenant, 0)

    def close(self) -> None:
        """Forget every entry and remove the directory."""
        with self._lock:
            self._tenants.clear()
            self._bytes.clear()
        self._closed()

    def _drop(self, tenant: str, response_id: str) -> None:
        index = self._tenants[tenant].pop(response_id)
        self._bytes[tenant] -= index.nbytes
        index.path.unlink(missing_ok=True)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(e) for e in self._tenants.values())


def _dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str).encode()


def _sweep_dead() -> None:
    """Remove the spill directories of servers whose process is gone."""
    for old in Path(tempfile.gettempdir()).glob(f"{SPILL_PREFIX}*"):
        pid = old.name[len(SPILL_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        shutil.rmtree(old, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
