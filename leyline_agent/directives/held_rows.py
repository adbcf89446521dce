"""Rows past a sequence's last full block, held for the namespace's next request (pure).

A paged cache that shares full blocks only (vLLM's prefix cache; SGLang's paged pools)
frees the block holding a sequence's rows past its last full block when the request ends,
so the next request (or a splice of the sequence) would prefill them again. An engine keeps
them instead: a ``HeldRows`` is one block kept with one reference whose first ``num_rows``
rows are the rows of ``tokens[base:]`` (``base`` a multiple of the block size) as some
request or splice of a namespace computed them, over that namespace's cached full blocks of
``tokens[:base]``.

``HeldRowsTable`` keeps a few of them per namespace, least recently used first out (a
namespace whose splice result is pinned is passed over while it is, up to twice the bound),
and answers one question (``match``): for a request of namespace ``ns`` served under salt
``salt`` whose full blocks hit the cache through ``num_local`` tokens, how many rows past
them a held block can give (the longest common prefix of ``tokens`` and the prompt inside
that block, never the prompt's last token, which the engine computes for the logits).
Rows at positions ``< k`` depend only on tokens ``< k`` (causal attention), so a prefix of
a held block is valid for any prompt that shares those tokens.

Blocks are opaque handles with a ``block_id``; the engine takes and gives back the
references (``release`` is called with every block that leaves the table).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["BlockRef", "HeldRows", "HeldRowsTable", "RowsMatch", "common_prefix"]

PER_NAMESPACE = 6  # a request's own rows and its prompt's, a splice's T', a FORGET's or a
# head's prefix
HELD_TTL_S = 600.0


class BlockRef(Protocol):
    """An engine's cache block, opaque here but for its id (vLLM's ``BlockRef``)."""

    @property
    def block_id(self) -> int: ...


@dataclass(slots=True)
class HeldRows:
    tokens: tuple[int, ...]  # the sequence whose rows [base, len(tokens)) the block holds
    base: int  # first row in the block (a multiple of the block size)
    block: BlockRef  # one reference held by the table
    salt: str | None  # the salt the full blocks of tokens[:base] are cached under
    since: float = field(default_factory=time.monotonic)

    @property
    def num_rows(self) -> int:
        return len(self.tokens) - self.base

    @property
    def block_id(self) -> int:
        return int(self.block.block_id)


@dataclass(slots=True, frozen=True)
class RowsMatch:
    held: HeldRows
    num_rows: int  # rows of held.block to copy, from its offset 0


def common_prefix(a: Sequence[int], b: Sequence[int], lo: int, hi: int) -> int:
    """The first ``k`` in ``[lo, hi)`` where ``a`` and ``b`` differ (``hi`` if none)."""
    k = lo
    while k < hi and a[k] == b[k]:
        k += 1
    return k


def _same(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """``a == b``, the last tokens first: held sequences of a namespace often share a long
    prefix (one conversation's turns) and differ at their end."""
    return len(a) == len(b) and a[-1:] == b[-1:] and a == b


class HeldRowsTable:
    def __init__(
        self,
        release: Callable[[BlockRef], None],
        max_entries: int,
        protect: Callable[[str], bool] = lambda ns: False,
    ) -> None:
        self._release = release
        self._max = max(1, max_entries)
        self._protect = protect  # namespaces whose rows the bound never drops (pinned)
        self._by_ns: OrderedDict[str, list[HeldRows]] = OrderedDict()

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_ns.values())

    def add(self, ns: str, held: HeldRows) -> None:
        """Keep ``held`` (its block's reference now belongs to the table). An entry of the
        same namespace over the same tokens and salt is replaced."""
        if held.num_rows <= 0:
            self._release(held.block)
            return
        rows = self._by_ns.pop(ns, [])
        for old in [h for h in rows if h.salt == held.salt and _same(h.tokens, held.tokens)]:
            rows.remove(old)
            self._release(old.block)
        rows.insert(0, held)
        while len(rows) > PER_NAMESPACE:
            self._release(rows.pop().block)
        self._by_ns[ns] = rows
        while len(self) > self._max:
            victim = next((k for k in self._by_ns if k != ns and not self._protect(k)), None)
            if victim is None:  # protected namespaces get up to twice the bound, no more
                if len(self) <= 2 * self._max:
                    break
                victim = next(iter(self._by_ns))
            for h in self._by_ns.pop(victim):
                self._release(h.block)

    def match(
        self, ns: str, salt: str | None, prompt: Sequence[int], num_local: int, block_size: int
    ) -> RowsMatch | None:
        """The held rows that extend a local hit of ``num_local`` tokens of ``prompt``."""
        best: RowsMatch | None = None
        limit = len(prompt) - 1  # the last prompt token is always computed
        head: tuple[int, ...] | None = None  # prompt[:num_local], made once if needed
        for h in self._by_ns.get(ns, []):
            if h.salt != salt or h.base != num_local or h.base % block_size:
                continue
            hi = min(len(h.tokens), limit)
            if hi <= h.base:
                continue
            # the rows inside the block first (a few tokens), the prefix only for a candidate
            k = common_prefix(h.tokens, prompt, h.base, hi) - h.base
            if k <= 0 or (best is not None and k <= best.num_rows):
                continue
            if head is None:
                head = tuple(prompt[: h.base])
            if h.tokens[: h.base] == head:
                best = RowsMatch(h, k)
        if best is not None:
            self._by_ns.move_to_end(ns)
        return best

    def holds_start(
        self, ns: str, salt: str, prompt: Sequence[int], *, whole: bool = False
    ) -> bool:
        """A held block of ``ns`` under ``salt`` starts the prompt (base 0, first token
        equal): the namespace holds the prompt's first rows though not a full block.
        ``whole``: all of its rows must be the prompt's (for a prompt whose first block is
        full, so that a shared first token alone does not take it from the plain pool)."""
        for h in self._by_ns.get(ns, []):
            if h.salt != salt or h.base != 0 or not h.tokens:
                continue
            n = len(h.tokens) if whole else 1
            if len(prompt) >= n and list(prompt[:n]) == list(h.tokens[:n]):
                return True
        return False

    def find(self, ns: str, salt: str | None, tokens: Sequence[int], base: int) -> HeldRows | None:
        """A held block of ``ns`` under ``salt`` with rows from ``base`` whose tokens agree
        with ``tokens`` through ``base`` and as far as it holds rows (the longest)."""
        best = None
        for h in self._by_ns.get(ns, []):
            if h.salt != salt or h.base != base or len(tokens) <= base:
                continue
            if list(h.tokens[:base]) != list(tokens[:base]):
                continue
            k = common_prefix(h.tokens, tokens, base, min(len(h.tokens), len(tokens)))
            if k > base and (best is None or k > len(best.tokens)):
                best = HeldRows(tuple(tokens[:k]), base, h.block, salt, h.since)
        return best

    def drop_past(self, ns: str, tokens: Sequence[int], start: int) -> int:
        """Drop ``ns``'s held rows that agree with ``tokens`` beyond ``start`` (a FORGET:
        rows from ``start`` on must be computed again)."""
        rows = self._by_ns.get(ns, [])
        gone = [h for h in rows if len(h.tokens) > start and common_prefix(
            h.tokens, tokens, 0, min(len(h.tokens), len(tokens))) > start]  # fmt: skip
        for h in gone:
            rows.remove(h)
            self._release(h.block)
        return len(gone)

    def expire(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for ns in list(self._by_ns):
            keep = []
            for h in self._by_ns[ns]:
                if now - h.since > HELD_TTL_S:
                    self._release(h.block)
                else:
                    keep.append(h)
            if keep:
                self._by_ns[ns] = keep
            else:
                del self._by_ns[ns]

    def clear(self) -> int:
        n = 0
        for rows in self._by_ns.values():
            for h in rows:
                self._release(h.block)
                n += 1
        self._by_ns.clear()
        return n
