"""The worker: one thread FIFO, never two jobs at once; N threads: N at once, FIFO starts,
one job at a time per key (session); errors delivered, timeouts, clean close.

The "engine" here is a recorder object: the thing under test is the worker itself.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import wait

import pytest

from leyline_agent.errors import RuntimeUnavailableError
from leyline_agent.server.worker import (
    DEFAULT_CONCURRENCY,
    QueueTimeoutError,
    StreamEnd,
    Worker,
    concurrency_for,
)


class Recorder:
    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self.active = 0
        self.max_active = 0
        self.threads: set[int] = set()
        self._lock = threading.Lock()

    def work(self, tag: int, steps: int = 3) -> int:
        with self._lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        self.threads.add(threading.get_ident())
        for _ in range(steps):
            self.log.append(("step", tag))
            time.sleep(0.001)
        with self._lock:
            self.active -= 1
        return tag * 10


def test_jobs_run_one_at_a_time_in_submission_order_on_one_thread():
    rec = Recorder()
    sched = Worker(rec)
    futures = []
    lock = threading.Lock()

    def client(k: int) -> None:
        for j in range(5):
            with lock:  # record the global submission order
                futures.append((k * 100 + j, sched.submit(lambda e, t=k * 100 + j: e.work(t))))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [f.result(10) for _, f in futures] == [tag * 10 for tag, _ in futures]
    sched.close()
    assert rec.max_active == 1 and len(rec.threads) == 1
    order = [tag for kind, tag in rec.log[::3]]
    assert order == [tag for tag, _ in futures]
    assert all(
        rec.log[i][1] == rec.log[i + 1][1] == rec.log[i + 2][1] for i in range(0, len(rec.log), 3)
    )


def test_an_exception_reaches_its_caller_and_the_worker_keeps_going():
    sched = Worker(Recorder())

    def boom(engine):
        raise ValueError("bad thing")

    bad = sched.submit(boom)
    good = sched.submit(lambda e: e.work(7))
    with pytest.raises(ValueError, match="bad thing"):
        bad.result(5)
    assert good.result(5) == 70
    sched.close()


def test_stream_yields_events_then_result_and_raises_job_errors():
    sched = Worker(Recorder())

    def job(engine, emit):
        for k in range(4):
            emit(k, str(k))
        return "done"

    def failing(engine, emit):
        emit(1)
        raise KeyError("late")

    async def collect(fn):
        return [event async for event in sched.stream(fn)]

    events = asyncio.run(collect(job))
    assert events[:-1] == [(k, str(k)) for k in range(4)]
    assert isinstance(events[-1], StreamEnd) and events[-1].result == "done"

    async def partial():
        seen = []
        with pytest.raises(KeyError):
            async for event in sched.stream(failing):
                seen.append(event)
        return seen

    assert asyncio.run(partial()) == [(1,)]
    sched.close()


def test_close_finishes_queued_work_then_refuses_new_work():
    rec = Recorder()
    sched = Worker(rec)
    futures = [sched.submit(lambda e, k=k: e.work(k, steps=2)) for k in range(5)]
    sched.close()
    assert [f.result(0) for f in futures] == [0, 10, 20, 30, 40]
    with pytest.raises(RuntimeUnavailableError):
        sched.submit(lambda e: e.work(1))


def test_close_can_cancel_what_is_still_queued():
    rec = Recorder()
    sched = Worker(rec)
    started, gate = threading.Event(), threading.Event()

    def blocker(engine):
        started.set()
        return gate.wait(5)

    first = sched.submit(blocker)
    queued = [sched.submit(lambda e, k=k: e.work(k)) for k in range(3)]
    assert started.wait(5)
    closer = threading.Thread(target=sched.close, kwargs={"cancel_pending": True})
    closer.start()  # blocks in join() while the first job still runs
    done, _ = wait(queued, timeout=5)
    assert len(done) == 3 and all(f.cancelled() for f in queued)
    assert not first.done()
    gate.set()
    closer.join(5)
    assert first.result(5) is True
    assert rec.log == [] and not closer.is_alive()


# ---- several threads -------------------------------------------------------------------
class SafeRecorder(Recorder):
    thread_safe = True


def _gate_jobs(sched: Worker, rec: Recorder, keys: list, gate: threading.Event):
    """One job per key (None: no key), each recording its start and waiting on ``gate``."""
    started: list[int] = []
    lock = threading.Lock()

    def job(engine, k: int):
        with lock:
            started.append(k)
        engine.work(k, steps=1)
        gate.wait(10)
        engine.work(k, steps=1)
        return k

    return started, [sched.submit(lambda e, k=k: job(e, k), key) for k, key in enumerate(keys)]


def test_n_threads_run_n_jobs_at_once_started_in_arrival_order():
    rec = SafeRecorder()
    sched = Worker(rec, concurrency=4)
    gate = threading.Event()
    started, futures = _gate_jobs(sched, rec, [None] * 6, gate)
    deadline = time.monotonic() + 10
    while len(started) < 4 and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.05)
    assert sorted(started) == [0, 1, 2, 3]  # four at once; the fifth waits for a thread
    gate.set()
    assert [f.result(10) for f in futures] == list(range(6))
    sched.close()
    assert rec.max_active == 4 and len(rec.threads) == 4


def test_jobs_of_one_key_never_overlap_and_keep_their_order_others_run_beside():
    rec = SafeRecorder()
    sched = Worker(rec, concurrency=4)
    spans: dict[int, list[float]] = {}
    lock = threading.Lock()

    def job(engine, k: int):
        t0 = time.monotonic()
        time.sleep(0.05)
        with lock:
            spans[k] = [t0, time.monotonic()]
        return k

    keys = ["a", "a", "b", "a", None, "b"]
    futures = [sched.submit(lambda e, k=k: job(e, k), key) for k, key in enumerate(keys)]
    assert [f.result(10) for f in futures] == list(range(6))
    sched.close()
    for key in ("a", "b"):
        mine = [k for k, x in enumerate(keys) if x == key]
        for first, second in zip(mine, mine[1:], strict=False):
            assert spans[first][1] <= spans[second][0], (key, spans)  # in order, no overlap
    # different keys overlapped: job 2 ("b") and job 4 (no key) started while job 0 ran
    assert spans[2][0] < spans[0][1] and spans[4][0] < spans[0][1], spans


def test_a_parked_job_times_out_from_its_arrival_and_a_cancelled_one_never_runs():
    rec = SafeRecorder()
    sched = Worker(rec, concurrency=4, queue_timeout_s=0.2)
    gate = threading.Event()
    first = sched.submit(lambda e: gate.wait(10), "s")
    late = sched.submit(lambda e: e.work(1), "s")  # parked behind "s" with threads free
    dropped = sched.submit(lambda e: e.work(2), "s")
    other = sched.submit(lambda e: e.work(3), "t")  # another key is not held up
    assert other.result(5) == 30
    assert dropped.cancel()
    time.sleep(0.4)
    gate.set()
    assert first.result(5) is True
    with pytest.raises(QueueTimeoutError):
        late.result(5)
    assert dropped.cancelled()
    assert sched.submit(lambda e: e.work(4), "s").result(5) == 40  # the key was released
    sched.close()
    assert [tag for _, tag in rec.log[::3]] == [3, 4]


def test_close_cancels_parked_jobs_too():
    rec = SafeRecorder()
    sched = Worker(rec, concurrency=2)
    gate = threading.Event()
    first = sched.submit(lambda e: gate.wait(10), "s")
    parked = [sched.submit(lambda e, k=k: e.work(k), "s") for k in range(3)]
    time.sleep(0.1)
    closer = threading.Thread(target=sched.close, kwargs={"cancel_pending": True})
    closer.start()
    done, _ = wait(parked, timeout=5)
    assert len(done) == 3 and all(f.cancelled() for f in parked)
    gate.set()
    closer.join(5)
    assert first.result(5) is True and rec.log == [] and not closer.is_alive()


def test_concurrency_for_needs_a_thread_safe_engine():
    assert concurrency_for(SafeRecorder()) == DEFAULT_CONCURRENCY > 1
    assert concurrency_for(Recorder()) == 1
    assert concurrency_for(SafeRecorder(), 3) == 3
    with pytest.raises(ValueError, match="not thread-safe"):
        concurrency_for(Recorder(), 2)
    with pytest.raises(ValueError):
        concurrency_for(SafeRecorder(), 0)
    with pytest.raises(ValueError, match="not thread-safe"):
        Worker(Recorder(), concurrency=2)


def test_request_memory_runs_one_of_concurrent_retries():
    from leyline_agent.directives.idempotence import RequestMemory, fingerprint
    from leyline_agent.namespaces import Namespace
    from leyline_agent.wire import DirectivesRequest, DirectivesResponse

    memory: RequestMemory[DirectivesResponse] = RequestMemory()
    ns = Namespace("t", None)
    req = DirectivesRequest.model_validate(
        {
            "tokens": [5, 6, 7, 8],
            "directives": [{"start": 1, "end": 2, "replacement": [9]}],
            "request_id": "r1",
        }  # fmt: skip
    )
    calls: list[int] = []
    entered = threading.Barrier(8)

    def execute() -> DirectivesResponse:
        calls.append(1)
        time.sleep(0.1)  # the other retries arrive meanwhile
        return DirectivesResponse(outcome="noop", tokens=[len(calls)], applied=[])

    answers: list[DirectivesResponse] = []

    def retry() -> None:
        entered.wait(5)
        answers.append(memory.run(ns.key, req.request_id, fingerprint(req), execute))

    threads = [threading.Thread(target=retry) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(calls) == 1 and len(answers) == 8 and all(a.tokens == [1] for a in answers)
