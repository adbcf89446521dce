"""PIN of splice results on vLLM: ``directives.pin_table.PinTable`` holding blocks (pure).

The semantics are the one pin table's, ``leyline serve``'s too: the latest splice result
``T'`` of each namespace (its salt) is kept from eviction until the namespace's next
request is scheduled, its next directive, a TTL, or a flush; pins are broken oldest first
under memory pressure, pinned blocks stay within a budget (half the pool), and a result
lost meanwhile is told once (``Arrival.lost``, the answer's ``usage.leyline.splice_evicted``).
Here a result is watched by its full blocks' ids and hash keys (opaque) and the block
holding its rows past them (``Watch``); the table's references are block ids, which the
scheduler takes and gives back (``Refs``: ``take`` first); the scheduler's ``Rows.intact``
says whether a watched ``T'`` still lives in the blocks the splice wrote. No torch, no vLLM.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from leyline_agent.directives.pin_table import DEFAULT_WATCHED, Arrival, PinTable, Refs, Rows

__all__ = [
    "DEFAULT_TTL_S",
    "DEFAULT_WATCHED",
    "TTL_ENV",
    "Arrival",
    "BlockPins",
    "Refs",
    "Rows",
    "Watch",
    "ttl_from_env",
]

TTL_ENV = "LEYLINE_PIN_TTL_S"
DEFAULT_TTL_S = 300.0  # leyline serve's --pin-ttl-s default


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
    keys: tuple[object, ...]  # vLLM's block hashes, opaque here
    salt: str | None
    partial: int | None = None


class BlockPins(PinTable[str, Watch]):
    """The pin table of the plugin's scheduler: namespaces are salts, sizes are blocks,
    at most ``max_blocks`` pinned."""

    def __init__(
        self,
        rows: Rows[str, Watch],
        ttl_s: float,
        max_blocks: int,
        clock: Callable[[], float] = time.monotonic,
        max_watched: int = DEFAULT_WATCHED,
    ) -> None:
        super().__init__(
            rows, ttl_s, budget=max_blocks, clock=clock, max_watched=max_watched, ttl_name=TTL_ENV
        )

    def pin_blocks(self, ns: str, watch: Watch) -> Refs:
        """``watch`` is ``ns``'s latest splice result: its full blocks are pinned."""
        return self.pin(ns, watch, watch.block_ids, len(watch.block_ids))

    @property
    def pinned_blocks(self) -> int:
        return self.pinned()
