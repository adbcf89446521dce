"""How many times each ``rotate_band`` backend actually ran (read by tests and benchmarks).

Its own module so that both backends count into it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LAUNCHES", "LaunchCounter"]


@dataclass(slots=True)
class LaunchCounter:
    triton: int = 0
    torch: int = 0
    c: int = 0


LAUNCHES = LaunchCounter()
