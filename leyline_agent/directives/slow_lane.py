"""The slow lane: large CPU work that releases the GIL, one job at a time, at low priority.

A prompt is tokenized on the thread that renders it. Tokenizing a large text takes a core
for a long time (280 KB of unclosed ``<think>`` tags: 160,000 tokens, 0.2 s alone and over a
second beside other work), and a request whose prompt will then be refused for its length
costs that much before it is refused. ``tokenize(tokenizer, text)`` tokenizes a text of
``LARGE_TEXT_CHARS`` characters or more on the lane's one thread instead (the caller waits):

- one at a time: however many large prompts arrive, they take at most one core, queued
  behind each other, and never the core the step loop or the event loop is using;
- at ``LANE_NICE``, the lowest priority (the thread's own nice value, Linux; never a
  higher priority than the process's own): where the cores are busy, the operating system
  runs the step loop, the event loop and ordinary requests' threads first, and the lane gets
  what they leave. A stream of huge prompts that will be refused for their length is then
  paid for with idle CPU; at nice 5 the scheduler's weights (335 against 1,024 at nice 0)
  gave the lane about a quarter of a core that the step loop or the event loop wanted.

A fast tokenizer releases the GIL while it encodes, so the lane's low priority holds no
other thread back. Where a thread's priority cannot be set (not Linux), the lane still runs
one job at a time at normal priority, and says so once in the log.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog

log = structlog.get_logger(__name__)

__all__ = ["LANE_NICE", "LARGE_TEXT_CHARS", "tokenize"]

LARGE_TEXT_CHARS = 64 * 1024
LANE_NICE = 19


def _lower_priority() -> None:
    """Pool initializer: this thread's nice value to ``LANE_NICE``, or to the one it has if
    that is higher (a lane never runs ahead of the process that owns it) (Linux)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(LANE_NICE, os.getpriority(os.PRIO_PROCESS, tid)))
    except (AttributeError, OSError) as e:
        log.info(
            "slow lane at normal priority: its thread's nice value cannot be set", error=str(e)
        )


_LANE = ThreadPoolExecutor(1, thread_name_prefix="leyline-slow-lane", initializer=_lower_priority)


def tokenize(tokenizer: Any, text: str) -> list[int]:
    """``tokenizer.encode(text, add_special_tokens=False)`` as a list, on the lane when
    ``text`` is large (module doc), else on the calling thread. The tokenizer is used by one
    thread at a time: the caller waits for the lane."""
    if len(text) < LARGE_TEXT_CHARS:
        return list(tokenizer.encode(text, add_special_tokens=False))
    return _LANE.submit(lambda: list(tokenizer.encode(text, add_special_tokens=False))).result()
