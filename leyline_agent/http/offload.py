"""CPU work of a request, run off the event loop on a bounded pool of threads.

``off_loop(fn, *args, deadline_s=..., field=...)`` runs ``fn(*args)`` on one of
``OFFLOAD_THREADS`` threads and awaits it, so the event loop keeps answering other requests
(``/health``, other streams) meanwhile: C extensions that release the GIL (xgrammar's
schema converter) run in parallel with it, and pure Python work gives the loop the GIL every
switch interval (5 ms) instead of holding it to the end. With ``deadline_s``, a request
whose work is still running then gets a 400 naming ``field``; the thread finishes its call in
the background (a queued call that has not started is dropped). The pool is bounded, so
hostile requests queue behind each other instead of taking every core.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from leyline_agent.errors import RequestError

__all__ = ["OFFLOAD_THREADS", "off_loop"]

OFFLOAD_THREADS = 2
_POOL = ThreadPoolExecutor(OFFLOAD_THREADS, thread_name_prefix="leyline-offload")


async def off_loop[R](
    fn: Callable[..., R],
    *args: object,
    deadline_s: float | None = None,
    field: Callable[[], str] | str = "body",
) -> R:
    """``fn(*args)`` on the pool (module doc); ``field``: the field a deadline names (or a
    function that says which, read when the deadline passes)."""
    future = _POOL.submit(fn, *args)
    try:
        return await asyncio.wait_for(asyncio.wrap_future(future), deadline_s)
    except TimeoutError:
        future.cancel()  # not started yet: never runs
        where = field() if callable(field) else field
        raise RequestError(f"the work on it took longer than {deadline_s:g} s", where) from None
