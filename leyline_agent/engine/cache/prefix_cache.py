"""``PrefixCache``: the radix tree, the slot allocator and the token budget behind one API.

The engine and the directive executor talk to this, never to the tree's internals:

- ``match(tokens, ns)``: the longest prefix namespace ``ns`` may reuse (pure).
- ``hold(match)`` / ``release(match)``: keep a match's rows from eviction while they are read.
- ``insert(tokens, slots, fresh, ns, exact_len)``: cache ``tokens -> slots``, free every slot
  of ``fresh`` the tree did not adopt and every old row the write superseded.
- ``pin(ns, tokens)`` / ``arrive(ns)``: PIN a directive's result for its session's next
  request (``pins.py``); ``arrive`` tells whether it was evicted meanwhile.
- ``evict()``: down to the budget: pins capped at half of it, then LRU leaves, then pins;
  with ``tenant_share``, tenants over their share give first (see ``evict``). The report
  says whose rows went (``evicted_by_tenant``, ``lost_pins_by_tenant``).
- ``flush(tenant)``: drop the tenant's pins and every unlocked row of the tenant (rows an
  in-flight request holds stay); other tenants keep theirs.

Provenance (which rows are exact, which belong to a session) is the tree's: see
``radix.py`` and ``leyline_agent.namespaces``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from leyline_agent.engine.cache.allocator import SlotAllocator
from leyline_agent.engine.cache.pins import TreePins
from leyline_agent.engine.cache.radix import Evicted, Match, RadixCache
from leyline_agent.namespaces import Namespace

__all__ = ["EvictionReport", "FlushReport", "PrefixCache"]


@dataclass(slots=True)
class EvictionReport:
    evicted_tokens: int = 0
    lost_pins: int = 0
    evicted_by_tenant: dict[str, int] = field(default_factory=dict)  # whose rows they were
    lost_pins_by_tenant: dict[str, int] = field(default_factory=dict)

    def add(self, ev: Evicted) -> list[int]:
        """Count ``ev``'s rows (by owner); its slots, to free."""
        self.evicted_tokens += len(ev.slots)
        for tenant, n in ev.by_tenant.items():
            self.evicted_by_tenant[tenant] = self.evicted_by_tenant.get(tenant, 0) + n
        return ev.slots


@dataclass(slots=True, frozen=True)
class FlushReport:
    flushed_tokens: int  # rows freed
    kept_tokens: int  # the tenant's rows still cached (locked by a request in flight)
    dropped_pins: int


class PrefixCache:
    def __init__(
        self,
        allocator: SlotAllocator,
        budget_tokens: int,
        *,
        enabled: bool = True,
        pin_ttl_s: float = 300.0,
        tenant_share: float | None = None,
    ) -> None:
        if tenant_share is not None and not 0 < tenant_share <= 1:
            raise ValueError(f"tenant_cache_share: {tenant_share} must be in (0, 1]")
        self.allocator, self.budget_tokens, self.enabled = allocator, budget_tokens, enabled
        # A tenant's share in rows (None: no shares, one LRU over everybody).
        self.share_tokens = None if tenant_share is None else int(tenant_share * budget_tokens)
        self.tree = RadixCache()
        self.pins = TreePins(self.tree, pin_ttl_s)

    # ---------------------------------------------------------------- lookups
    def match(self, tokens: Sequence[int], ns: Namespace) -> Match:
        if not self.enabled:
            return Match(0, [], self.tree.root)
        return self.tree.match_prefix(tokens, ns)

    def hold(self, m: Match) -> None:
        self.tree.lock(m.node)

    def release(self, m: Match) -> None:
        self.tree.unlock(m.node)
        self.allocator.free(self.tree.collect())

    # ---------------------------------------------------------------- writes
    def insert(
        self,
        tokens: Sequence[int],
        slots: Sequence[int],
        fresh: Sequence[int],
        ns: Namespace,
        exact_len: int,
    ) -> None:
        """Cache ``tokens -> slots``; rows ``[0, exact_len)`` exact, the rest ``ns``'s."""
        if not self.enabled:
            self.allocator.free(fresh)
            return
        res = self.tree.insert(tokens, slots, ns, exact_len)
        adopted = set(slots[res.held :])
        self.allocator.free([s for s in fresh if s not in adopted])
        self.allocator.free(res.freed)

    def pin(self, ns: Namespace, tokens: Sequence[int]) -> None:
        if self.enabled:
            self.pins.pin(ns, list(tokens))

    def arrive(self, ns: Namespace, prompt: Sequence[int] | None = None) -> bool:
        """``ns`` starts a request (of ``prompt``'s tokens, if given): its pin ends. True if
        its last splice result was lost since, pinned or not (``pins``), said once."""
        lost = self.pins.release(ns, prompt)
        self.allocator.free(self.tree.collect())
        return lost

    def evict(self) -> EvictionReport:
        """Pins hold at most half the budget (so they never starve fresh work); then LRU
        leaves go; if locked rows alone still exceed the budget, pins give way, oldest first.

        With a tenant share, each of these steps takes from the tenants holding more than
        their share first (their LRU rows, down to the share; then their pins), and only
        then from everybody. So a tenant within its share loses rows to another's traffic
        only when the tenants within their shares alone fill the cache (shares that add
        up to more than the whole)."""
        rep = EvictionReport()
        self.pins.expire()
        while self.pins.pinned_tokens > self.budget_tokens // 2 and self._break_pin():
            pass
        while True:
            self._evict_over_share(rep)
            if self.tree.total_tokens <= self.budget_tokens:
                break
            over_share = self._over_share()
            if over_share and self.pins.break_oldest(over_share):
                continue
            over = self.tree.total_tokens - self.budget_tokens
            self.allocator.free(rep.add(self.tree.evict_rows(over)))
            if self.tree.total_tokens <= self.budget_tokens or not self.pins.break_oldest():
                break
        rep.lost_pins = self.pins.count_lost(rep.lost_pins_by_tenant)
        return rep

    def flush(self, tenant: str) -> FlushReport:
        """Empty ``tenant``'s part of the cache, as far as no request in flight holds it."""
        dropped = self.pins.release_tenant(tenant)
        freed = self.tree.flush(tenant)
        self.allocator.free(freed)
        self.allocator.free(self.tree.collect())
        return FlushReport(len(freed), self.tree.tenant_tokens(tenant), dropped)

    # ---------------------------------------------------------------- shares
    def _over_share(self) -> dict[str, int]:
        """Tenants holding more rows than their share: how many more."""
        if self.share_tokens is None:
            return {}
        totals = self.tree.tenant_totals()
        return {t: n - self.share_tokens for t, n in totals.items() if n > self.share_tokens}

    def _evict_over_share(self, rep: EvictionReport) -> None:
        """While the cache is over budget: LRU rows of tenants over their share, largest
        excess first, each down to its share (whole leaves: possibly a little below)."""
        for tenant, excess in sorted(self._over_share().items(), key=lambda kv: -kv[1]):
            need = self.tree.total_tokens - self.budget_tokens
            if need <= 0:
                return
            ev = self.tree.evict_rows(min(need, excess), tenant=tenant)
            self.allocator.free(rep.add(ev))

    def _break_pin(self) -> bool:
        over_share = self._over_share()
        return bool(over_share) and self.pins.break_oldest(over_share) or self.pins.break_oldest()

    # ---------------------------------------------------------------- reading
    @property
    def total_tokens(self) -> int:
        return self.tree.total_tokens

    def tenant_tokens(self, tenant: str) -> int:
        return self.tree.tenant_tokens(tenant)

    def check(self) -> None:
        """Internal invariant (tests): every slot is in the tree, detached, or free, once."""
        cached = self.tree.all_slots()
        free = self.allocator.free_slots()
        everything = cached + free + self.tree.detached_slots
        if len(everything) != len(set(everything)):
            raise AssertionError("a slot is both cached and free (or cached twice)")
        if len(everything) != self.allocator.capacity:
            raise AssertionError(
                f"slot leak: {self.allocator.capacity - len(everything)} slots unaccounted"
            )
