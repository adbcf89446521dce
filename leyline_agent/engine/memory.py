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

A trim returns only whole free pages. ``tune_allocator()`` (called by ``leyline serve`` before
the model loads) keeps freed memory in such pages: large blocks (``MMAP_THRESHOLD_BYTES`` and
up: a 1 MB prompt's token lists, a tokenizer's buffers) are mapped on their own and unmapped
when freed (glibc otherwise raises its threshold after each large free, and the next large
blocks land in the heaps between small live ones), and at most ``ARENA_MAX`` arenas are made
(one per thread otherwise, each keeping its own free pages). Measured with
``leyline bench store-budget`` (40 responses of 1 MB input): the RSS over a warm start went
from +363 MB to +95 MB, and after a flush from +229 MB to +31 MB. Settings given in the
environment (``MALLOC_ARENA_MAX``, ``MALLOC_MMAP_THRESHOLD_``) are left as they are.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
import time
from collections.abc import Callable

import structlog

log = structlog.get_logger(__name__)

__all__ = ["MemoryTrimmer", "load_malloc_trim", "tune_allocator"]

IDLE_INTERVAL_S = 1.0
BUSY_INTERVAL_S = 10.0
MMAP_THRESHOLD_BYTES = 128 * 1024
ARENA_MAX = 2
_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8  # glibc's malloc.h


def load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (``int malloc_trim(size_t pad)``), or None elsewhere."""
    libc = _libc()
    fn = getattr(libc, "malloc_trim", None)
    if fn is None:
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def _libc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def tune_allocator() -> dict[str, int]:
    """Set glibc's mmap threshold and arena cap (module doc); returns what it set (empty
    where the C library is not glibc, which the log says)."""
    libc = _libc()
    if libc is None:
        log.info("allocator settings unavailable (not glibc): left as they are")
        return {}
    done = {}
    for env, option, value in (
        ("MALLOC_MMAP_THRESHOLD_", _M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
        ("MALLOC_ARENA_MAX", _M_ARENA_MAX, ARENA_MAX),
    ):
        if env not in os.environ and libc.mallopt(ctypes.c_int(option), ctypes.c_int(value)):
            done[env] = value
    return done


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
