"""PIN of splice results on vLLM: which namespace holds which blocks, until when (pure).

The semantics are ``leyline serve``'s (``engine/cache/pins.py``): the latest splice result
``T'`` of each namespace is kept from eviction until the namespace's next request is
scheduled, its next directive (which replaces the pin), a TTL, or a flush; under memory
pressure pins are broken oldest first, and pinned blocks stay within a budget (half the
pool). A pin that no longer holds its blocks (broken, or past its TTL) and whose rows are
then gone is counted (``pin_evictions``), and the namespace's next request is told once
(``Arrival.lost``, the answer's ``usage.leyline.splice_evicted``). After the pin ends the
table keeps *watching* ``T'``'s blocks (no reference held) until the next directive: a
request that arrives after they were evicted is told too, once, and a request whose
prompt does not continue ``T'`` ends the watch.

Three levels, as the plugin has them: this table holds block ids and each block's hash key
(opaque here); the scheduler takes and gives back the block-pool references that the
table's answers name (``Refs``: ``take`` first, then ``give_back``); ``Rows.intact`` (the
scheduler) says whether a watched ``T'`` still lives in the blocks the splice wrote. No
torch, no vLLM.
"""

from __future__ import annotations

import math
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "DEFAULT_TTL_S",
    "TTL_ENV",
    "Arrival",
    "Pin",
    "PinTable",
    "Refs",
    "Rows",
    "Watch",
    "ttl_from_env",
]

TTL_ENV = "LEYLINE_PIN_TTL_S"
DEFAULT_TTL_S = 300.0  # leyline serve's --pin-ttl-s default
DEFAULT_WATCHED = 4096


def ttl_from_env(environ: Mapping[str, str] = os.environ) -> float:
    """``LEYLINE_PIN_TTL_S`` in seconds (unset: 300, as ``leyline serve``; 0: no pins, the
    results are only watched). ``ValueError`` naming the variable for anything else."""
    raw = environ.get(TTL_ENV, "").strip()
    if not raw:
        return DEFAULT_TTL_S
    try:
        ttl = float(raw)
    except ValueError:
        raise ValueError(f"{TTL_ENV}: {raw!r} is not a number of seconds") from None
    if not math.isfinite(ttl) or ttl < 0:
        raise ValueError(f"{TTL_ENV}: {raw!r} must be a finite number >= 0")
    return ttl


@dataclass(frozen=True, slots=True)
class Watch:
    """A splice result as the splice left it: ``T'``, the ids and hash keys of its full
    blocks (cached under ``salt``), and the block holding its rows past them (``partial``,
    held by the scheduler's held-rows table; ``None``: none)."""

    tokens: tuple[int, ...]
    block_ids: tuple[int, ...]
    keys: tuple[Any, ...]
    salt: str | None
    partial: int | None = None


@dataclass(slots=True)
class Pin:
    watch: Watch
    deadline: float
    held: bool = True  # the table holds one reference on each of watch.block_ids
    evicted: bool = False  # found gone after it stopped holding them (counted once)


@dataclass(frozen=True, slots=True)
class Refs:
    """References the scheduler must take (``touch``) and give back (``free_blocks``)."""

    take: tuple[int, ...] = ()
    give_back: tuple[int, ...] = ()

    def __add__(self, other: Refs) -> Refs:
        return Refs(self.take + other.take, self.give_back + other.give_back)


@dataclass(frozen=True, slots=True)
class Arrival:
    """What a namespace's arriving request is told: ``lost`` (said once), whether the table
    still watches the namespace after it (``watched``), references to give back."""

    lost: bool
    watched: bool
    refs: Refs = Refs()


class Rows(Protocol):
    def intact(self, ns: str, watch: Watch, with_partial: bool) -> bool:
        """``watch``'s rows are still those the splice wrote: each full block still holds
        its hash key, and (``with_partial``) the held rows past them are still held."""
        ...


class PinTable:
    def __init__(
        self,
        rows: Rows,
        ttl_s: float,
        max_blocks: int,
        clock: Callable[[], float] = time.monotonic,
        max_watched: int = DEFAULT_WATCHED,
    ) -> None:
        if not ttl_s >= 0:
            raise ValueError(f"{TTL_ENV}: {ttl_s} must be >= 0")
        if max_watched < 1:
            raise ValueError(f"max_watched: {max_watched} must be >= 1")
        self.rows, self.ttl_s, self.clock = rows, ttl_s, clock
        self.max_blocks = max(0, max_blocks)
        self.max_watched = max_watched
        self.pin_evictions = 0
        self._pins: OrderedDict[str, Pin] = OrderedDict()  # oldest first
        self._watched: OrderedDict[str, Watch] = OrderedDict()  # least recently spliced first

    # -- public API ----------------------------------------------------------------------
    def pin(self, ns: str, watch: Watch) -> Refs:
        """``watch`` is ``ns``'s latest splice result: replaces ``ns``'s pin and watch, holds
        its blocks (unless the TTL is 0), and breaks the oldest pins while pinned blocks
        exceed the budget (the new pin too, if it alone exceeds it)."""
        refs = self._drop(ns)
        self._watched[ns] = watch
        while len(self._watched) > self.max_watched:
            old, _ = self._watched.popitem(last=False)
            refs += self._end_pin(old)
        if self.ttl_s == 0 or not watch.block_ids:
            return refs
        self._pins[ns] = Pin(watch, self.clock() + self.ttl_s)
        refs += Refs(take=watch.block_ids)
        while self.pinned_blocks > self.max_blocks:
            refs += self.break_oldest()
        return refs

    def arrive(self, ns: str) -> Arrival:
        """A request of ``ns`` is about to be served: whether its splice result was lost
        (its pin broken or expired and the rows gone, or the rows gone after the pin
        ended). Said once: a lost result is dropped, pin and watch. The pin of an intact
        result stays until the request is scheduled (``scheduled``)."""
        w = self._watched.get(ns)
        if w is None:
            return Arrival(False, False)
        p = self._pins.get(ns)
        lost = (p is not None and p.evicted) or not self.rows.intact(ns, w, p is not None)
        if not lost:
            return Arrival(False, True)
        if p is not None and not p.evicted:
            self.pin_evictions += 1
            p.evicted = True
        return Arrival(True, False, self._drop(ns))

    def scheduled(self, ns: str, prompt: Sequence[int]) -> Refs:
        """A request of ``ns`` with ``prompt`` was scheduled (it holds the blocks it reads
        now): ``ns``'s pin ends; a prompt that does not continue ``T'`` ends the watch."""
        refs = self._end_pin(ns)
        w = self._watched.get(ns)
        if w is not None and tuple(prompt[: len(w.tokens)]) != w.tokens:
            del self._watched[ns]
        return refs

    def expire(self) -> Refs:
        """Pins past their deadline stop holding their blocks (the rows stay cached,
        unprotected, and watched)."""
        now, out = self.clock(), []
        for p in self._pins.values():  # oldest first: deadlines in order (one TTL)
            if now < p.deadline:
                break
            if p.held:
                p.held = False
                out.extend(p.watch.block_ids)
        return Refs(give_back=tuple(out))

    def break_oldest(self) -> Refs:
        """The oldest pin that holds its blocks stops holding them (memory pressure); no
        references to give back if none holds any."""
        for p in self._pins.values():
            if p.held:
                p.held = False
                return Refs(give_back=p.watch.block_ids)
        return Refs()

    def count_lost(self) -> int:
        """Mark the pins that no longer hold their blocks and whose rows are gone; how many
        were newly found gone (added to ``pin_evictions``)."""
        n = 0
        for ns, p in self._pins.items():
            if not p.held and not p.evicted and not self.rows.intact(ns, p.watch, True):
                p.evicted = True
                n += 1
        self.pin_evictions += n
        return n

    def clear(self) -> tuple[int, Refs]:
        """Drop every pin and watch (a flush): how many pins, and the references to give
        back."""
        n = len(self._pins)
        out = [b for p in self._pins.values() if p.held for b in p.watch.block_ids]
        self._pins.clear()
        self._watched.clear()
        return n, Refs(give_back=tuple(out))

    def holds(self, ns: str) -> bool:
        """``ns`` has a pin that still holds its blocks."""
        p = self._pins.get(ns)
        return p is not None and p.held

    def watches(self, ns: str) -> bool:
        return ns in self._watched

    @property
    def pinned_blocks(self) -> int:
        return sum(len(p.watch.block_ids) for p in self._pins.values() if p.held)

    @property
    def num_pins(self) -> int:
        return len(self._pins)

    # -- helpers -------------------------------------------------------------------------
    def _end_pin(self, ns: str) -> Refs:
        p = self._pins.pop(ns, None)
        if p is None or not p.held:
            return Refs()
        return Refs(give_back=p.watch.block_ids)

    def _drop(self, ns: str) -> Refs:
        self._watched.pop(ns, None)
        return self._end_pin(ns)
