"""PIN, at its simplest: a splice result is kept from eviction until its session comes back.

After a directive, the session's next request is the one that profits from the splice; if
memory pressure evicted ``T'`` in between, that request would silently re-prefill it. So
the engine locks the path of each namespace's latest directive result (one pin per
namespace) until the namespace's next request or directive, or until ``ttl_s`` passes.

Under memory pressure that unpinned rows cannot relieve, pins are broken oldest first;
a broken pin whose rows are then really gone is counted (``pin_evictions``) and the
session's next request is told (``GenerationResult.splice_evicted``).

No tensors and no allocator here: the tree's locks do the holding.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from leyline_agent.engine.cache.radix import Node, RadixCache
from leyline_agent.namespaces import Namespace

__all__ = ["Pin", "PinTable"]


@dataclass(slots=True)
class Pin:
    node: Node
    tokens: list[int]
    slots: list[int]
    deadline: float
    held: bool = True  # the lock is still taken
    evicted: bool = False  # rows lost to memory pressure before the session came back


class PinTable:
    def __init__(self, tree: RadixCache, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        if ttl_s < 0:
            raise ValueError(f"pin_ttl_s: {ttl_s} must be >= 0")
        self.tree, self.ttl_s, self.clock = tree, ttl_s, clock
        self._pins: dict[Namespace, Pin] = {}

    def pin(self, ns: Namespace, tokens: list[int]) -> None:
        """Hold the path of ``tokens`` in ``ns`` (the directive's result); replaces ns's pin."""
        self.release(ns)
        if self.ttl_s == 0 or not tokens:
            return
        m = self.tree.match_prefix(tokens, ns)
        if m.length != len(tokens):
            return  # not (or not wholly) cached: nothing to hold
        self.tree.lock(m.node)
        self._pins[ns] = Pin(m.node, list(tokens), list(m.slots), self.clock() + self.ttl_s)

    def release(self, ns: Namespace) -> bool:
        """``ns`` is back: drop its pin. True if its splice result was evicted meanwhile."""
        p = self._pins.pop(ns, None)
        if p is None:
            return False
        if p.held:
            self.tree.unlock(p.node)
        return p.evicted

    def release_tenant(self, tenant: str) -> int:
        """Drop every pin of ``tenant``'s namespaces (a flush); how many were dropped."""
        mine = [ns for ns in self._pins if ns.tenant == tenant]
        for ns in mine:
            self.release(ns)
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
