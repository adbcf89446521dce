"""PIN on ``leyline serve``'s radix tree: ``directives.pin_table.PinTable`` holding tree paths.

After a directive, the session's next request is the one that profits from the splice; if
memory pressure evicted ``T'`` in between, that request would silently re-prefill it. So
the engine pins each namespace's latest directive result: one lock on the node its path
ends at, until the namespace's next request or directive, or until ``ttl_s`` passes; pins
are broken oldest first under pressure that unpinned rows cannot relieve. The semantics
(pins, watches, what a lost result is, said once) are the table's; here they act on the
tree: a result is watched by its tokens, slots and exact length (``Watch``), the table's
references are tree nodes (``lock`` / ``unlock``), and a result not wholly cached is
neither pinned nor watched. No tensors and no allocator here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass

from leyline_agent.directives.pin_table import DEFAULT_WATCHED, PinTable, Refs
from leyline_agent.engine.cache.radix import Node, RadixCache
from leyline_agent.namespaces import Namespace

__all__ = ["TreePins", "Watch"]


@dataclass(frozen=True, slots=True)
class Watch:
    """A splice result's rows as the directive left them (no lock held)."""

    tokens: list[int]
    slots: list[int]
    exact_len: int


class _TreeRows:
    """``pin_table.Rows`` on the tree: the result's path still matches its slots and
    exact length."""

    def __init__(self, tree: RadixCache) -> None:
        self.tree = tree

    def intact(self, ns: Namespace, watch: Watch, with_partial: bool) -> bool:
        m = self.tree.match_prefix(watch.tokens, ns)
        return (
            m.length == len(watch.tokens)
            and m.slots == watch.slots
            and m.exact_len == watch.exact_len
        )


class TreePins:
    """The engine's pins (module doc); sizes are tokens."""

    def __init__(
        self,
        tree: RadixCache,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        max_watched: int = DEFAULT_WATCHED,
    ) -> None:
        self.tree = tree
        self.table: PinTable[Namespace, Watch] = PinTable(
            _TreeRows(tree), ttl_s, clock=clock, max_watched=max_watched
        )

    def pin(self, ns: Namespace, tokens: list[int]) -> None:
        """Hold the path of ``tokens`` in ``ns`` (the directive's result) and watch it;
        replaces ns's pin and watch (a result not wholly cached: dropped only)."""
        m = self.tree.match_prefix(tokens, ns) if tokens else None
        if m is None or m.length != len(tokens):
            self._apply(self.table.drop(ns))
            return
        watch = Watch(list(tokens), list(m.slots), m.exact_len)
        self._apply(self.table.pin(ns, watch, (m.node,), len(tokens)))

    def release(self, ns: Namespace, prompt: Sequence[int] | None = None) -> bool:
        """``ns`` is back: its pin ends. True if its splice result was lost meanwhile, said
        once; ``prompt`` not continuing the result ends the watch."""
        arrival = self.table.arrive(ns)
        self._apply(arrival.refs + self.table.scheduled(ns, prompt))
        return arrival.lost

    def watched(self, ns: Namespace) -> bool:
        return self.table.watches(ns)

    def release_tenant(self, tenant: str) -> int:
        """Drop every pin and watch of ``tenant`` (a flush); how many pins."""
        n, refs = self.table.clear(lambda ns: ns.tenant == tenant)
        self._apply(refs)
        return n

    def expire(self) -> None:
        self._apply(self.table.expire())

    def break_oldest(self, tenants: Collection[str] | None = None) -> bool:
        """Unlock the oldest held pin (of ``tenants``, if given); False if none holds."""
        among = None if tenants is None else (lambda ns: ns.tenant in tenants)
        refs = self.table.break_oldest(among)
        self._apply(refs)
        return bool(refs.give_back)

    def count_lost(self, by_tenant: dict[str, int] | None = None) -> int:
        """Unheld pins whose rows are gone, newly found (added up per tenant into
        ``by_tenant`` if given)."""
        lost = self.table.count_lost()
        for ns in lost if by_tenant is not None else ():
            by_tenant[ns.tenant] = by_tenant.get(ns.tenant, 0) + 1
        return len(lost)

    @property
    def pinned_tokens(self) -> int:
        return self.table.pinned()

    def pinned_tokens_of(self, tenant: str) -> int:
        return self.table.pinned(lambda ns: ns.tenant == tenant)

    def _apply(self, refs: Refs) -> None:
        for node in refs.take:
            self.tree.lock(_node(node))
        for node in refs.give_back:
            self.tree.unlock(_node(node))


def _node(ref: Hashable) -> Node:
    assert isinstance(ref, Node)
    return ref
