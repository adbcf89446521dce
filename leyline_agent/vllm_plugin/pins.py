"""PIN of splice results on vLLM: ``directives.pin_table.PinTable`` bound to the block pool.

The semantics are the one pin table's. Here namespaces are salts, a result is watched by
its full blocks' ids and hash keys and the held block with its rows past them (``Watch``),
the table's references and sizes are block ids and blocks (the scheduler takes and gives
them back, ``LeylineScheduler.leyline_apply``; at most half the pool), and
``BlockRows.intact`` says whether a watched ``T'`` still lives in the blocks the splice
wrote. No torch, no vLLM import.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from leyline_agent.directives.held_rows import HeldRowsTable
from leyline_agent.directives.pin_table import DEFAULT_TTL_S

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

__all__ = ["TTL_ENV", "BlockRows", "Watch", "ttl_from_env"]

TTL_ENV = "LEYLINE_PIN_TTL_S"


def ttl_from_env(environ: Mapping[str, str] = os.environ) -> float:
    """``LEYLINE_PIN_TTL_S`` in seconds (unset: 300, as ``leyline serve``; 0: no pins, the
    results are only watched). ``ValueError`` naming the variable for anything else."""
    raw = environ.get(TTL_ENV, "").strip()
    try:
        ttl = float(raw) if raw else DEFAULT_TTL_S
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


class BlockRows:
    """``Rows`` over the block pool's blocks and the scheduler's held-rows table."""

    def __init__(
        self, blocks: Sequence[KVCacheBlock], block_size: int, held: HeldRowsTable
    ) -> None:
        self.blocks, self.block_size, self.held = blocks, block_size, held

    def intact(self, ns: str, watch: Watch, with_partial: bool) -> bool:
        blocks = self.blocks
        if any(blocks[i].block_hash != k for i, k in zip(watch.block_ids, watch.keys, strict=True)):
            return False
        if not with_partial or watch.partial is None:
            return True
        base = len(watch.block_ids) * self.block_size
        held = self.held.find(ns, watch.salt, watch.tokens, base)
        return (
            held is not None
            and held.block_id == watch.partial
            and len(held.tokens) == len(watch.tokens)
        )
