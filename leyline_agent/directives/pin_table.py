"""PIN of splice results: which namespace holds what, until when (pure, torch-free).

The one pin table of every engine: ``leyline serve`` adapts it to its radix tree
(``engine.cache.pins``), the vLLM plugin to its block pool (``vllm_plugin.pins``).

The latest splice result ``T'`` of each namespace is kept from eviction until the
namespace's next request is scheduled (``scheduled``), its next directive (which replaces
the pin), a TTL (``expire``), or a flush (``clear``); under memory pressure pins are broken
oldest first (``break_oldest``), and pinned rows may be bounded (``budget``). A pin that no
longer holds its rows (broken, or past its TTL) and whose rows are then gone is counted
(``count_lost``, ``pin_evictions``), and the namespace's next request is told once
(``arrive``: ``Arrival.lost``, the answer's ``usage.leyline.splice_evicted``). After the
pin ends the table keeps *watching* ``T'`` (no reference held) until the next directive: a
request that arrives after its rows were lost is told too, once, and a request whose prompt
does not continue ``T'`` ends the watch. Watches are bounded (``max_watched`` namespaces,
least recently spliced first).

The table holds nothing itself: its answers name the references (``Refs``, opaque handles:
block ids, tree nodes) the engine takes and gives back (``take`` first), and the engine's
``Rows.intact`` says whether a watched ``T'`` still lives in the rows the splice wrote.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "DEFAULT_TTL_S",
    "DEFAULT_WATCHED",
    "Arrival",
    "Pin",
    "PinTable",
    "Refs",
    "Rows",
    "Watched",
]

DEFAULT_WATCHED = 4096
DEFAULT_TTL_S = 300.0  # unless configured: ``leyline serve --pin-ttl-s``, ``LEYLINE_PIN_TTL_S``


@dataclass(frozen=True, slots=True)
class Refs:
    """References the engine must take, then give back."""

    take: tuple[Hashable, ...] = ()
    give_back: tuple[Hashable, ...] = ()

    def __add__(self, other: Refs) -> Refs:
        return Refs(self.take + other.take, self.give_back + other.give_back)


@dataclass(frozen=True, slots=True)
class Arrival:
    """What a namespace's arriving request is told: ``lost`` (said once), whether the table
    still watches the namespace after it (``watched``), references to give back."""

    lost: bool
    watched: bool
    refs: Refs = Refs()


class Watched(Protocol):
    """A splice result as the engine describes it: at least its tokens ``T'``."""

    @property
    def tokens(self) -> Sequence[int]: ...


class Rows[K: Hashable, W: Watched](Protocol):
    def intact(self, ns: K, watch: W, with_partial: bool) -> bool:
        """``watch``'s rows are still those the splice wrote (``with_partial``: the rows
        the engine holds past its full blocks, while the pin lasts, count too)."""
        ...


@dataclass(slots=True)
class Pin[W]:
    watch: W
    hold: tuple[Hashable, ...]  # the references the pin holds while ``held``
    size: int  # what it counts against the budget (blocks, tokens)
    deadline: float
    held: bool = True
    evicted: bool = False  # found gone after it stopped holding (counted once)


class PinTable[K: Hashable, W: Watched]:
    """The pins and watches of every namespace ``K`` (module doc)."""

    def __init__(
        self,
        rows: Rows[K, W],
        ttl_s: float,
        *,
        budget: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_watched: int = DEFAULT_WATCHED,
        ttl_name: str = "pin_ttl_s",
    ) -> None:
        if not ttl_s >= 0:
            raise ValueError(f"{ttl_name}: {ttl_s} must be >= 0")
        if max_watched < 1:
            raise ValueError(f"max_watched: {max_watched} must be >= 1")
        self.rows, self.ttl_s, self.clock = rows, ttl_s, clock
        self.budget = None if budget is None else max(0, budget)
        self.max_watched = max_watched
        self.pin_evictions = 0
        self._pins: OrderedDict[K, Pin[W]] = OrderedDict()  # oldest first
        self._watched: OrderedDict[K, W] = OrderedDict()  # least recently spliced first

    def pin(self, ns: K, watch: W, hold: tuple[Hashable, ...], size: int) -> Refs:
        """``watch`` is ``ns``'s latest splice result: replaces ``ns``'s pin and watch,
        holds ``hold`` (unless the TTL is 0 or there is nothing to hold), and breaks the
        oldest pins while pinned sizes exceed the budget (the new pin too, if it alone
        does)."""
        refs = self.drop(ns)
        self._watched[ns] = watch
        while len(self._watched) > self.max_watched:
            old, _ = self._watched.popitem(last=False)
            refs += self._end_pin(old)
        if self.ttl_s == 0 or not hold:
            return refs
        self._pins[ns] = Pin(watch, hold, size, self.clock() + self.ttl_s)
        refs += Refs(take=hold)
        while self.budget is not None and self.pinned() > self.budget:
            refs += self.break_oldest()
        return refs

    def arrive(self, ns: K) -> Arrival:
        """A request of ``ns`` is about to be served: whether its splice result was lost
        (its pin broken or expired and the rows gone, or the rows gone after the pin
        ended). Said once: a lost result is dropped, pin and watch. The pin of an intact
        result stays until the request is scheduled (``scheduled``)."""
        w = self._watched.get(ns)
        if w is None:
            p = self._pins.get(ns)  # a pin whose watch was dropped: it ends here
            return Arrival(p is not None and p.evicted, False, self._end_pin(ns))
        p = self._pins.get(ns)
        lost = (p is not None and p.evicted) or not self.rows.intact(ns, w, p is not None)
        if not lost:
            return Arrival(False, True)
        if p is not None and not p.evicted:
            self.pin_evictions += 1
            p.evicted = True
        return Arrival(True, False, self.drop(ns))

    def scheduled(self, ns: K, prompt: Sequence[int] | None) -> Refs:
        """A request of ``ns`` with ``prompt`` was scheduled (it holds the rows it reads
        now): ``ns``'s pin ends; a prompt that does not continue ``T'`` ends the watch
        (``None``: unknown, the watch stays)."""
        refs = self._end_pin(ns)
        w = self._watched.get(ns)
        if w is not None and prompt is not None:
            if tuple(prompt[: len(w.tokens)]) != tuple(w.tokens):
                del self._watched[ns]
        return refs

    def expire(self) -> Refs:
        """Pins past their deadline stop holding (their rows stay cached, unprotected, and
        watched)."""
        now, out = self.clock(), []
        for p in self._pins.values():  # oldest first: deadlines in order (one TTL)
            if now < p.deadline:
                break
            if p.held:
                p.held = False
                out.extend(p.hold)
        return Refs(give_back=tuple(out))

    def break_oldest(self, among: Callable[[K], bool] | None = None) -> Refs:
        """The oldest pin that holds (of the namespaces ``among`` accepts, if given) stops
        holding (memory pressure); empty ``Refs`` if none holds."""
        for ns, p in self._pins.items():
            if p.held and (among is None or among(ns)):
                p.held = False
                return Refs(give_back=p.hold)
        return Refs()

    def count_lost(self) -> list[K]:
        """Mark the pins that no longer hold and whose rows are gone: the namespaces newly
        found so (added to ``pin_evictions``)."""
        lost = []
        for ns, p in self._pins.items():
            if not p.held and not p.evicted and not self.rows.intact(ns, p.watch, True):
                p.evicted = True
                lost.append(ns)
        self.pin_evictions += len(lost)
        return lost

    def clear(self, among: Callable[[K], bool] | None = None) -> tuple[int, Refs]:
        """Drop every pin and watch (of the namespaces ``among`` accepts, if given): a
        flush. How many pins, and the references to give back."""
        pins = [ns for ns in self._pins if among is None or among(ns)]
        refs = Refs()
        for ns in pins:
            refs += self._end_pin(ns)
        for ns in [ns for ns in self._watched if among is None or among(ns)]:
            del self._watched[ns]
        return len(pins), refs

    def drop(self, ns: K) -> Refs:
        """``ns``'s pin and watch, gone."""
        self._watched.pop(ns, None)
        return self._end_pin(ns)

    def holds(self, ns: K) -> bool:
        """``ns`` has a pin that still holds."""
        p = self._pins.get(ns)
        return p is not None and p.held

    def watches(self, ns: K) -> bool:
        return ns in self._watched

    def pinned(self, among: Callable[[K], bool] | None = None) -> int:
        """The sizes of the pins that hold (of the namespaces ``among`` accepts)."""
        return sum(
            p.size for ns, p in self._pins.items() if p.held and (among is None or among(ns))
        )

    @property
    def num_pins(self) -> int:
        return len(self._pins)

    def _end_pin(self, ns: K) -> Refs:
        p = self._pins.pop(ns, None)
        if p is None or not p.held:
            return Refs()
        return Refs(give_back=p.hold)
