"""Seeded token ids for tests that need a prompt but not a text."""

from __future__ import annotations

import random

__all__ = ["random_ids"]


def random_ids(seed: int, n: int) -> list[int]:
    """``n`` seeded token ids inside the tiny models' vocabulary, clear of the first ids."""
    rng = random.Random(seed)
    return [rng.randrange(3, 5990) for _ in range(n)]
