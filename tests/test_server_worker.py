"""The worker: one worker, FIFO, never two jobs at once, errors delivered, clean close.

The "engine" here is a recorder object: the thing under test is the worker itself.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import wait

import pytest

from leyline_agent.errors import RuntimeUnavailableError
from leyline_agent.server.worker import StreamEnd, Worker


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
