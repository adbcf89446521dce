"""PIN, at its simplest: a splice result is kept from eviction until its session comes back.

After a directive, the session's next request is the one that profits from the splice; if
memory pressure evicted ``T'`` in between, that request would silently re-prefill it. So
the engine locks the path of each namespace's latest directive result (one pin per
namespace) until the namespace's next request or directive, or until ``ttl_s`` passes.

Under memory pressure that unpinned rows cannot relieve, pins are broken oldest first;
a broken pin whose rows are then really gone is counted (``pin_evictions``) and the
session's next request is told (``GenerationResult.splice_evicted``).

The pin ends with the session's next request, but the splice result lives on in the
session's rows: the table keeps *watching* it (its tokens, slots and exact length, without
a lock) until the session's next directive. Whenever the session starts a request and those
rows are no longer the ones the splice wrote (evicted, pinned or not, then re-prefilled or
gone), the request is told ``splice_evicted`` once, and the watch ends (the session's rows
are exact from then on); a request whose prompt does not continue the splice result ends
the watch too. Watches are bounded (``max_watched`` namespaces, least recently
spliced dropped first); a flush of the tenant drops them with its pins.

No tensors and no allocator here: the tree's locks do the holding.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from leyline_agent.engine.cache.radix import Node, RadixCache
from leyline_agent.namespaces import Namespace

__all__ = ["DEFAULT_WATCHED", "Pin", "PinTable", "Watch"]

DEFAULT_WATCHED = 4096


@dataclass(slots=True)
class Pin:
    node: Node
    tokens: list[int]
    slots: list[int]
    deadline: float
    held: bool = True  # the lock is still taken
    evicted: bool = False  # rows lost to memory pressure before the session came back


@dataclass(frozen=True, slots=True)
class Watch:
    """A splice result's rows as the directive left them (no lock held)."""

    tokens: list[int]
    slots: list[int]
    exact_len: int


class PinTable:
    def __init__(
        self,
        tree: RadixCache,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        max_watched: int = DEFAULT_WATCHED,
    ):
        if ttl_s < 0:
            raise ValueError(f"pin_ttl_s: {ttl_s} must be >= 0")
        if max_watched < 1:
            raise ValueError(f"max_watched: {max_watched} must be >= 1")
        self.tree, self.ttl_s, self.clock = tree, ttl_s, clock
        self.max_watched = max_watched
        self._pins: dict[Namespace, Pin] = {}
        self._watched: OrderedDict[Namespace, Watch] = OrderedDict()

    def pin(self, ns: Namespace, tokens: list[int]) -> None:
        """Hold the path of ``tokens`` in ``ns`` (the directive's result) and watch it;
        replaces ns's pin and watch."""
        self._drop(ns)
        if not tokens:
            return
        m = self.tree.match_prefix(tokens, ns)
        if m.length != len(tokens):
            return  # not (or not wholly) cached: nothing to hold
        self._watched[ns] = Watch(list(tokens), list(m.slots), m.exact_len)
        while len(self._watched) > self.max_watched:
            self._watched.popitem(last=False)
        if self.ttl_s == 0:
            return
        self.tree.lock(m.node)
        self._pins[ns] = Pin(m.node, list(tokens), list(m.slots), self.clock() + self.ttl_s)

    def release(self, ns: Namespace, prompt: Sequence[int] | None = None) -> bool:
        """``ns`` is back: drop its pin. True if its splice result was lost meanwhile
        (evicted while pinned, or its rows no longer the splice's since): said once.
        ``prompt``: the request's tokens; one that does not continue the splice result
        ends the watch (the session has left those rows behind)."""
        p = self._pins.pop(ns, None)
        if p is not None and p.held:
            self.tree.unlock(p.node)
        lost = p is not None and p.evicted
        w = self._watched.get(ns)
        if w is None:
            return lost
        lost = lost or not self._intact(ns, w)
        if lost or (prompt is not None and list(prompt[: len(w.tokens)]) != w.tokens):
            del self._watched[ns]
        return lost

    def _intact(self, ns: Namespace, w: Watch) -> bool:
        m = self.tree.match_prefix(w.tokens, ns)
        return m.length == len(w.tokens) and m.slots == w.slots and m.exact_len == w.exact_len

    def _drop(self, ns: Namespace) -> None:
        p = self._pins.pop(ns, None)
        if p is not None and p.held:
            self.tree.unlock(p.node)
        self._watched.pop(ns, None)

    def watched(self, ns: Namespace) -> bool:
        """Whether ``ns``'s last splice result is still watched."""
        return ns in self._watched

    def release_tenant(self, tenant: str) -> int:
        """Drop every pin (and watch) of ``tenant``'s namespaces (a flush); how many pins
        were dropped."""
        mine = [ns for ns in self._pins if ns.tenant == tenant]
        for ns in [*mine, *(ns for ns in self._watched if ns.tenant == tenant)]:
            self._drop(ns)
        return len(mine)

    def expire(self) -> None:
        """Unlock pins past their deadline (their rows stay cached, unprotected)."""
        now = self.clock()
        for p in self._pins.values():
            if p.held and now >= p.deadline:
                self.tree.unlock(p.node)
                p.held = False

    def break_oldest(self, tenants: Collection[str] | None = None) -> bool:
        """Unlock the oldest held pin (memory pressure), only among ``tenants``' pins if
        given. False if none is held."""
        held = [
            p
            for ns, p in self._pins.items()
            if p.held and (tenants is None or ns.tenant in tenants)
        ]
        if not held:
            return False
        p = min(held, key=lambda p: p.deadline)
        self.tree.unlock(p.node)
        p.held = False
        return True

    def count_lost(self, by_tenant: dict[str, int] | None = None) -> int:
        """Mark unheld pins whose rows are gone; how many were newly found gone (also added
        up per tenant into ``by_tenant`` if given)."""
        lost = 0
        for ns, p in self._pins.items():
            if p.held or p.evicted:
                continue
            m = self.tree.match_prefix(p.tokens, ns)
            if m.length < len(p.tokens) or m.slots != p.slots:
                p.evicted = True
                lost += 1
                if by_tenant is not None:
                    by_tenant[ns.tenant] = by_tenant.get(ns.tenant, 0) + 1
        return lost

    @property
    def pinned_tokens(self) -> int:
        return sum(len(p.tokens) for p in self._pins.values() if p.held)

    def pinned_tokens_of(self, tenant: str) -> int:
        return sum(len(p.tokens) for ns, p in self._pins.items() if p.held and ns.tenant == tenant)
