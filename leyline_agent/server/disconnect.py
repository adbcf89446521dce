"""Work for a client that may leave: stop it when the client disconnects.

``while_connected(request, awaitable, on_gone)`` awaits ``awaitable`` while watching the
connection (the next ASGI message after the body is ``http.disconnect`` when the client
goes away). If the client leaves first, ``on_gone()`` runs (the route cancels its queued
job and sets the event its ``on_token`` checks) and ``ClientDisconnected`` is raised.

``run_connected(request, worker, fn, key=...)`` is that around one worker job (``key``:
the worker's per-session order, ``worker.session_key``): a job still in the queue is
cancelled and never runs. A running generation is stopped at its next token by
``on_token`` raising ``GenerationCancelled`` (before the engine caches or counts
anything); a running directive finishes (it is atomic) and its answer is dropped.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Hashable

from starlette.requests import Request

from leyline_agent.server.errors import ClientDisconnected
from leyline_agent.server.worker import ServedEngine, Worker

__all__ = [
    "ClientDisconnected",
    "GenerationCancelled",
    "run_connected",
    "stop_when_gone",
    "while_connected",
]


class GenerationCancelled(Exception):
    """Raised from ``on_token`` on the worker when the client has gone away."""


def stop_when_gone(gone: threading.Event) -> Callable[..., None]:
    """An ``on_token`` that stops the generation once ``gone`` is set."""

    def on_token(*_: object) -> None:
        if gone.is_set():
            raise GenerationCancelled("the client disconnected")

    return on_token


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
        await asyncio.sleep(0.01)  # a server that answers at once must not spin


async def while_connected[T](
    request: Request, awaitable: Awaitable[T], on_gone: Callable[[], None]
) -> T:
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    on_gone()
    task.cancel()
    await asyncio.wait({task})  # let it clean up (it is waiting, not working)
    if not task.cancelled():
        task.exception()  # retrieved: nobody wants it
    raise ClientDisconnected("the client disconnected")


async def run_connected[T](
    request: Request,
    worker: Worker,
    fn: Callable[[ServedEngine], T],
    gone: threading.Event | None = None,
    key: Hashable | None = None,
) -> T:
    """Run ``fn(engine)`` on the worker unless the client leaves first (see module doc)."""
    future = worker.submit(fn, key)

    def on_gone() -> None:
        if gone is not None:
            gone.set()
        future.cancel()  # no effect once running

    return await while_connected(request, asyncio.wrap_future(future), on_gone)
