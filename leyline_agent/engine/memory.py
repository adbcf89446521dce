"""Hand freed heap memory back to the operating system (glibc's ``malloc_trim``).

A serving process allocates and frees the same kinds of buffers over and over (each step's
activations and logits, each request's token lists and detokenizer state) on many threads.
glibc keeps what is freed in per-thread arenas for reuse and returns it to the OS only
when the top of a heap is free, so under a changing mix of requests the resident size keeps
climbing although live memory stays flat. ``malloc_trim(0)`` walks every arena and returns
its free pages (``madvise``): the resident size then follows what is really in use.

``MemoryTrimmer.after_request(idle=...)`` is called after each generation: it trims when the
engine has just gone idle (at most once per ``idle_interval_s``) and, under a load that never
lets it go idle, at most once per ``busy_interval_s``. A trim takes milliseconds and runs on
the finishing request's thread, outside the engine lock (glibc locks each arena while it
trims it, so other threads only wait for the arena they share).

Where the C library is not glibc (musl, macOS, Windows) there is no ``malloc_trim``: the
trimmer says so once in the log (``available`` is False) and does nothing else.
"""

from __future__ import annotations

import ctypes
import platform
import threading
import time
from collections.abc import Callable

import structlog

log = structlog.get_logger(__name__)

__all__ = ["MemoryTrimmer", "load_malloc_trim"]

IDLE_INTERVAL_S = 1.0
BUSY_INTERVAL_S = 10.0


def load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (``int malloc_trim(size_t pad)``), or None elsewhere."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


class MemoryTrimmer:
    """Rate-limited ``malloc_trim(0)`` (see the module doc). ``trims`` counts the calls."""

    def __init__(
        self,
        *,
        idle_interval_s: float = IDLE_INTERVAL_S,
        busy_interval_s: float = BUSY_INTERVAL_S,
        trim: Callable[[int], int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._trim = trim if trim is not None else load_malloc_trim()
        self.idle_interval_s, self.busy_interval_s = idle_interval_s, busy_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last = clock()
        self.trims = 0
        if self._trim is None:
            log.info("malloc_trim unavailable (not glibc): freed memory stays with the allocator")

    @property
    def available(self) -> bool:
        return self._trim is not None

    def after_request(self, *, idle: bool) -> bool:
        """Trim if it is time (``idle``: the engine has nothing running). True if it did."""
        if self._trim is None:
            return False
        now = self._clock()
        with self._lock:  # check and stamp at once: two threads never both trim
            wait = self.idle_interval_s if idle else self.busy_interval_s
            if now - self._last < wait:
                return False
            self._last = now
            self.trims += 1
        self._trim(0)
        return True

    def trim_now(self) -> bool:
        """Trim at once (after a large free). True if ``malloc_trim`` exists."""
        if self._trim is None:
            return False
        with self._lock:
            self._last = self._clock()
            self.trims += 1
        self._trim(0)
        return True
