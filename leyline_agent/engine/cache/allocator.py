"""Slot allocator: hands out row indices of the KV pool (no tensors here).

Three levels (see ``radix.py``): the radix tree holds slot indices, this allocator owns
which indices are free, the pool (``kv_pool.py``) holds the bytes. The allocator never
runs out: when the free list is short it asks the pool to grow (``grow`` callback). ``trim``
gives the top of the index range back when nothing there is in use, so the pool can shrink
after a burst (the engine calls it when it goes idle).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

__all__ = ["SlotAllocator"]


@dataclass(slots=True)
class SlotAllocator:
    capacity: int
    grow: Callable[[int], int] | None = None  # (min_capacity) -> new capacity
    _free: list[int] = field(default_factory=list)
    _used: int = 0

    def __post_init__(self) -> None:
        self._free = list(range(self.capacity - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self._used

    def free_slots(self) -> list[int]:
        return list(self._free)

    def alloc(self, n: int) -> list[int]:
        if n <= 0:
            return []
        if n > len(self._free):
            if self.grow is None:
                raise MemoryError(f"KV pool full: {n} slots wanted, {len(self._free)} free")
            want = self._used + n
            new_cap = self.grow(want)
            self._free = list(range(new_cap - 1, self.capacity - 1, -1)) + self._free
            self.capacity = new_cap
        out = self._free[-n:][::-1]
        del self._free[-n:]
        self._used += n
        return out

    def free(self, slots: Iterable[int]) -> None:
        slots = list(slots)
        self._free.extend(reversed(slots))
        self._used -= len(slots)

    def trim(self, floor: int) -> int:
        """Drop the free indices at the top of the range, down to ``floor`` at most: the new
        capacity is the smallest one at or above ``floor`` past every index in use. Returns it
        (the pool then shrinks to it). O(capacity)."""
        free = set(self._free)
        cap = self.capacity
        while cap > floor and cap - 1 in free:
            cap -= 1
        if cap < self.capacity:
            self._free = [s for s in self._free if s < cap]
            self.capacity = cap
        return cap
