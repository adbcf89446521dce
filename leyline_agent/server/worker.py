"""Worker threads run every piece of engine work, started first in, first out.

HTTP handlers run concurrently on the event loop; nothing but the worker's threads ever
touches the engine: a handler wraps its work in a function ``fn(engine)`` (render a
prompt, generate, apply directives, read stats), ``submit``s it and awaits the ``Future``.

Threads: ``concurrency=1`` (the default of a bare ``Worker``, and the only value for an
engine that does not say it is ``thread_safe``) runs one job at a time, to completion, in
arrival order. ``concurrency=N`` (``leyline serve`` on the embedded ``Engine``: its
concurrent ``generate`` calls share batched steps; a directive's replacement is prefilled
in those steps beside other sequences, and everything else runs between two steps under its
lock) starts jobs in arrival order on N threads that run side by side, so eight
streaming clients decode in one batched forward. ``concurrency_for`` picks N.

Sessions: a job submitted with a ``key`` (the routes pass a named session's namespace,
``session_key``) never runs beside another job of the same key: jobs of one key start in
arrival order, each after the previous one ended, while other keys' jobs run on the other
threads. A parked job holds no thread. So a directive of a session never lands in the
middle of a generation of that session (it sees the session as its requests left it, as
with one thread); requests that name no session share no key and run concurrently (each
directive still holds its base rows from its checks to its cache write, so what it reads
cannot change under it).

Streaming: ``stream`` runs a generating job whose ``on_token`` callback (called on the
worker thread) hands each event to the event loop through an ``asyncio.Queue``; the
async iterator yields them and then the job's result (or raises its exception).
A stream whose consumer stops before the job started cancels it (it never runs); once
running, the job itself decides when to stop (the routes raise from ``on_token``), so the
engine is never interrupted half-way through a step.

Queue timeout: a job that waited longer than ``queue_timeout_s`` from its arrival until a
thread started it (behind other jobs, or parked behind its session's) fails with
``QueueTimeoutError`` (503 with ``Retry-After``) without running.

``close()`` stops accepting work, lets queued jobs finish (or cancels them), and joins.
``abandon(error)`` (a shutdown's deadline) closes without waiting: every job not yet
finished, running or queued, fails with ``error`` at once, so its request is answered now
(a prefill chunk can run for seconds); what a running job returns later is dropped, and its
thread (a daemon) ends when the engine lets it go.
"""

from __future__ import annotations

import asyncio
import math
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Hashable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import structlog

from leyline_agent.engine.params import GenerationResult, SamplingParams
from leyline_agent.errors import RuntimeUnavailableError
from leyline_agent.front.turns import TurnEngine
from leyline_agent.namespaces import ANONYMOUS, Namespace
from leyline_agent.wire import Counters, StatsResponse

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from leyline_agent.engine.cache.prefix_cache import FlushReport

log = structlog.get_logger(__name__)

__all__ = [
    "DEFAULT_CONCURRENCY",
    "DEFAULT_QUEUE_TIMEOUT_S",
    "QueueTimeoutError",
    "ServedEngine",
    "StreamEnd",
    "Worker",
    "concurrency_for",
    "session_key",
]

T = TypeVar("T")
DEFAULT_QUEUE_TIMEOUT_S = 300.0
# Threads for a thread-safe engine: requests in flight at once, so at most this many
# sequences share a batched step. 16 is the largest concurrency the demo and the benchmarks
# drive (C = 1..16), so none of their sessions waits for another's whole answer; a thread
# that waits for the engine lock costs a stack and nothing else.
DEFAULT_CONCURRENCY = 16


class ServedEngine(TurnEngine, Protocol):
    """What the server needs from an inference engine: a chat turn's ``TurnEngine`` (render,
    apply directives, counters) and more (``leyline_agent.engine.engine.Engine`` is one;
    tests serve doubles). ``generate``'s ``on_token(token_id, text_delta)`` gets the
    text each token adds, stop-safe: the deltas add up to the result's ``text``.

    An engine whose methods may be called from several threads at once says so with a
    true ``thread_safe`` attribute (``Engine.thread_safe``); without it (doubles, wrappers
    of engines that are not) the worker runs one job at a time (``concurrency_for``).

    ``counters`` is read by a chat turn whose token drift is spliced
    (``front.chat_turn.drift_turn``) and ``flush`` by ``POST /leyline/v1/flush``; doubles
    that serve neither may leave them out."""

    model_name: str

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase: ...

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        on_token: Callable[[int, str], None] | None = None,
        *,
        namespace: Namespace = ANONYMOUS,
    ) -> GenerationResult: ...

    def stats(self, tenant: str | None = None) -> StatsResponse: ...

    def flush(self, tenant: str) -> FlushReport: ...

    def counters(self, tenant: str) -> Counters: ...


class QueueTimeoutError(RuntimeUnavailableError):
    """A job waited in the queue longer than the worker's ``queue_timeout_s``.

    ``retry_after_s`` (the ``Retry-After`` header): a tenth of the timeout, 1 to 60 s.
    """

    def __init__(self, waited_s: float, timeout_s: float) -> None:
        super().__init__(
            f"the server is busy: the request waited {waited_s:.1f}s in the queue "
            f"(limit {timeout_s:g}s) and was not run; retry later"
        )
        self.retry_after_s = max(1, min(60, math.ceil(timeout_s / 10)))


def concurrency_for(engine: ServedEngine, requested: int | None = None) -> int:
    """Worker threads for ``engine``: ``requested``, or by default ``DEFAULT_CONCURRENCY``
    for a ``thread_safe`` engine and 1 for any other; more than 1 for an engine that is
    not thread-safe is a ``ValueError`` (never a silent downgrade)."""
    safe = bool(getattr(engine, "thread_safe", False))
    if requested is None:
        return DEFAULT_CONCURRENCY if safe else 1
    if requested < 1:
        raise ValueError(f"concurrency: {requested} must be >= 1")
    if requested > 1 and not safe:
        raise ValueError(
            f"concurrency: {requested}: the engine {type(engine).__name__} is not thread-safe "
            "(no true thread_safe attribute); it runs one request at a time"
        )
    return requested


def session_key(ns: Namespace) -> Namespace | None:
    """The ``key`` that orders a request's jobs: its namespace if it names a session
    (requests without one share no key: see the module doc)."""
    return ns if ns.session is not None else None


@dataclass(slots=True, eq=False)
class _Job:
    fn: Callable[[ServedEngine], object]
    future: Future
    queued_at: float
    key: Hashable | None = None


@dataclass(slots=True)
class StreamEnd[R]:
    """Last item of ``Worker.stream``: the job's return value."""

    result: R


class Worker:
    """Runs all work on one engine: FIFO starts, on ``concurrency`` threads (default 1),
    one job at a time per ``key``."""

    def __init__(
        self,
        engine: ServedEngine,
        *,
        name: str = "leyline-worker",
        queue_timeout_s: float | None = None,
        concurrency: int = 1,
    ) -> None:
        if queue_timeout_s is not None and not queue_timeout_s > 0:
            raise ValueError(f"queue_timeout_s: {queue_timeout_s} must be > 0 (or None)")
        self.engine = engine
        self.queue_timeout_s = queue_timeout_s
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        # key -> jobs parked behind its running job (a key is present while one runs)
        self._keys: dict[Hashable, deque[_Job]] = {}
        self._running: set[_Job] = set()  # jobs started and not finished (``abandon``)
        self.concurrency = concurrency = concurrency_for(engine, concurrency)  # checked
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(concurrency)
        ]
        for t in self._threads:
            t.start()

    # ---- public API --------------------------------------------------------------------
    def submit(self, fn: Callable[[ServedEngine], T], key: Hashable | None = None) -> Future[T]:
        """Queue ``fn(engine)``; its result or exception arrives in the returned future.
        ``key``: never run beside another job of the same key (see the module doc)."""
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeUnavailableError("the server is shutting down; no new work accepted")
            self._queue.put(_Job(fn, future, time.monotonic(), key))
        return future

    async def run(self, fn: Callable[[ServedEngine], T], key: Hashable | None = None) -> T:
        """``submit`` and await the result from the event loop."""
        return await asyncio.wrap_future(self.submit(fn, key))

    def call(
        self,
        fn: Callable[[ServedEngine], T],
        timeout: float | None = None,
        key: Hashable | None = None,
    ) -> T:
        """``submit`` and block (for synchronous callers, never from the event loop)."""
        return self.submit(fn, key).result(timeout)

    async def stream(
        self, fn: Callable[[ServedEngine, Callable[..., None]], T], key: Hashable | None = None
    ) -> AsyncIterator[tuple[Any, ...] | StreamEnd[T]]:
        """Run ``fn(engine, emit)``; yield each ``emit(*args)`` as a tuple, then ``StreamEnd``.

        The job's exception, if any, is raised from the iterator after the events before it.
        If the iterator is closed before the job started, the job is cancelled (never runs).
        """
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def post(kind: str, payload: Any) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, (kind, payload))
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

        future = self.submit(lambda engine: fn(engine, lambda *args: post("event", args)), key)
        future.add_done_callback(lambda f: post("done", f))
        try:
            while True:
                kind, payload = await events.get()
                if kind == "event":
                    yield payload
                    continue
                yield StreamEnd(payload.result())  # raises the job's exception, if any
                return
        finally:
            future.cancel()  # no effect once running

    def close(self, *, cancel_pending: bool = False, timeout: float | None = 60.0) -> None:
        """Stop accepting work; finish (or cancel) what is queued; join the worker."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if cancel_pending:
                self._cancel_queued()
            for _ in self._threads:
                self._queue.put(None)
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._threads):
            log.warning("worker still busy after close", timeout=timeout)

    def abandon(self, error: BaseException) -> None:
        """Close without waiting; every unfinished job fails with ``error`` (module doc)."""
        with self._lock:
            running = list(self._running)
        self.close(cancel_pending=True, timeout=0)
        for job in running:
            _settle(job.future, exc=error)

    @property
    def closed(self) -> bool:
        return self._closed

    # ---- worker ------------------------------------------------------------------------
    def _cancel_queued(self) -> None:  # under self._lock
        parked = [job for jobs in self._keys.values() for job in jobs]
        for jobs in self._keys.values():
            jobs.clear()  # never popped: a notified future cannot be started
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                parked.append(job)
        for job in parked:
            if job.future.cancel():
                job.future.set_running_or_notify_cancel()  # wakes concurrent.futures.wait()

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if job.key is not None:
                with self._lock:
                    if job.key in self._keys:  # its key is running: park it behind
                        self._keys[job.key].append(job)
                        continue
                    self._keys[job.key] = deque()
            while job is not None:
                self._run(job)
                job = self._next_of(job.key)

    def _next_of(self, key: Hashable | None) -> _Job | None:
        """The job parked first behind ``key`` (it keeps the key), or None (key released)."""
        if key is None:
            return None
        with self._lock:
            parked = self._keys[key]
            if parked:
                return parked.popleft()
            del self._keys[key]
            return None

    def _run(self, job: _Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            return  # cancelled while it waited
        waited = time.monotonic() - job.queued_at
        if self.queue_timeout_s is not None and waited > self.queue_timeout_s:
            job.future.set_exception(QueueTimeoutError(waited, self.queue_timeout_s))
            return
        with self._lock:
            self._running.add(job)
        try:
            result = job.fn(self.engine)
        except Exception as exc:  # handed to the awaiting request, never lost
            _settle(job.future, exc=exc)
        else:
            _settle(job.future, result)
        finally:
            with self._lock:
                self._running.discard(job)


def _settle(future: Future, result: object = None, *, exc: BaseException | None = None) -> None:
    """Give ``future`` its outcome unless it has one (``Worker.abandon`` may have failed it)."""
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass
