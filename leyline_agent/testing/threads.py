"""Run one function per session on its own thread, all released together (``run_together``)."""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["run_together"]


def run_together[R](
    n: int, fn: Callable[[int, threading.Barrier], R], timeout: float = 600
) -> list[R]:
    """``[fn(0, start), ..., fn(n - 1, start)]``, each call on its own thread; ``start`` is a
    barrier of ``n`` a call may wait on to begin at the same moment as the others. Raises the
    first error a call raised (after every thread ended), or ``TimeoutError``."""
    results: list[R | None] = [None] * n
    errors: list[BaseException] = []
    start = threading.Barrier(n)

    def one(s: int) -> None:
        try:
            results[s] = fn(s, start)
        except BaseException as e:  # re-raised below, after every thread ended
            errors.append(e)
            start.abort()

    threads = [threading.Thread(target=one, args=(s,), daemon=True) for s in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"run_together: a call was still running after {timeout}s")
    if errors:
        raise errors[0]
    return results  # type: ignore[return-value]
