"""Limits over real HTTP: body size, prompt tokens, max_tokens cap, queue timeout,
abandoned requests, idempotent directive retries.

The worker is held busy by a job of the test's own (a ``threading.Event`` it waits on),
submitted to the server's real ``Worker``; that is how "queued", "waited too long" and
"refused before the tokenizer ran" are observed from outside. Expected token counts come
from the tokenizer itself; "not cached" and "executed once" are read from the server's
counters and from the next request's ``cached_tokens``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from leyline_agent.testing.server import serve_in_thread
from leyline_agent.testing.token_ids import random_ids

pytestmark = pytest.mark.slow

MIB = 1024 * 1024
PROMPT_LIMIT = 64
CAP = 8


@pytest.fixture(scope="module")
def served(model_dir):
    """(client, worker, model name) of a server with small limits and its own worker."""
    from leyline_agent.engine.engine import Engine
    from leyline_agent.server.app import create_app
    from leyline_agent.server.worker import Worker

    worker = Worker(Engine.from_pretrained(model_dir), queue_timeout_s=None)
    app = create_app(worker, max_prompt_tokens=PROMPT_LIMIT, max_tokens_cap=CAP)
    with serve_in_thread(app) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            yield c, worker, model_dir.name, srv
    worker.close(cancel_pending=True)


@contextmanager
def busy(worker) -> Iterator[threading.Event]:
    """Hold the worker until the block ends (or the event is set)."""
    release, running = threading.Event(), threading.Event()

    def hold(_engine):
        running.set()
        release.wait(30)

    done = worker.submit(hold)
    assert running.wait(10)
    try:
        yield release
    finally:
        release.set()
        done.result(30)


def idle(worker) -> None:
    """Wait until everything queued before this call has run."""
    worker.call(lambda _engine: None, timeout=60)


def _stats(c) -> dict:
    return c.get("/leyline/v1/stats").json()


def _error(r: httpx.Response, status: int, field: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["field"] == field, err
    return err


def test_a_40_mb_body_gets_413_within_seconds(served):
    c, _, name, srv = served
    body = b'{"model": "' + b"x" * (40 * 1000 * 1000) + b'"}'
    t = time.monotonic()
    r = c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert time.monotonic() - t < 5
    err = _error(r, 413, "body")
    assert err["leyline_type"] == "PayloadTooLargeError" and str(16 * MIB) in err["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"model": "'
        for _ in range(40):
            yield b"y" * (1000 * 1000)
        yield b'"}'

    t = time.monotonic()
    with httpx.Client(base_url=srv.url, timeout=30) as fresh:
        r = fresh.post("/leyline/v1/directives", content=chunks())
    assert time.monotonic() - t < 5
    assert _error(r, 413, "body")["leyline_type"] == "PayloadTooLargeError"
    assert _error(r, 413, "body")["type"] == "invalid_request_error"
    # just under the limit is read and parsed (then refused for what it says)
    small = b'{"model": "' + b"z" * (MIB) + b'", "prompt": [1], "max_tokens": 1}'
    r = c.post("/v1/completions", content=small, headers={"content-type": "application/json"})
    _error(r, 404, "model")


def test_prompt_token_limit_exact_and_before_the_tokenizer(served, tok):
    c, worker, name, _ = served
    ok = random_ids(201, PROMPT_LIMIT)
    assert (
        c.post("/v1/completions", json={"model": name, "prompt": ok, "max_tokens": 1}).status_code
        == 200
    )
    r = c.post("/v1/completions", json={"model": name, "prompt": ok + [7], "max_tokens": 1})
    assert str(PROMPT_LIMIT + 1) in _error(r, 400, "prompt")["message"]

    # text whose exact count is over the limit although its byte count allows it
    text = " ".join(f"w{i}" for i in range(60))
    n = len(tok.encode(text))
    assert n > PROMPT_LIMIT
    r = c.post("/v1/completions", json={"model": name, "prompt": text, "max_tokens": 1})
    assert f"has {n} tokens" in _error(r, 400, "prompt")["message"]
    chat = {"model": name, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    r = c.post("/v1/chat/completions", json=chat)
    rendered = tok.apply_chat_template(chat["messages"], add_generation_prompt=True, tokenize=False)
    want = len(tok.encode(rendered, add_special_tokens=False))
    assert f"has {want} tokens" in _error(r, 400, "messages")["message"]

    # obviously too long: refused while the worker (where the tokenizer runs) is busy
    huge = "abc " * 250_000
    with busy(worker):
        t = time.monotonic()
        r1 = c.post("/v1/completions", json={"model": name, "prompt": huge, "max_tokens": 1})
        msgs = [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": huge}]},
        ]
        r2 = c.post("/v1/chat/completions", json={"model": name, "messages": msgs})
        old = [{"role": "user", "content": huge}]
        r3 = c.post("/leyline/v1/directives", json={"old_messages": old, "new_messages": old[:0]})
        assert time.monotonic() - t < 5
    assert "at least" in _error(r1, 400, "prompt")["message"]
    assert "at least" in _error(r2, 400, "messages")["message"]
    assert "at least" in _error(r3, 400, "old_messages")["message"]


def test_max_tokens_cap(served):
    c, _, name, _ = served
    P = random_ids(202, 10)
    r = c.post("/v1/completions", json={"model": name, "prompt": P, "max_tokens": CAP + 1})
    assert str(CAP) in _error(r, 400, "max_tokens")["message"]
    msgs = [{"role": "user", "content": "hello"}]
    for field in ("max_tokens", "max_completion_tokens"):
        r = c.post("/v1/chat/completions", json={"model": name, "messages": msgs, field: CAP + 1})
        _error(r, 400, field)
    r = c.post("/v1/chat/completions", json={"model": name, "messages": msgs, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= CAP
    r = c.post("/v1/completions", json={"model": name, "prompt": P, "max_tokens": CAP})
    assert r.status_code == 200


def test_queue_timeout_gives_503_with_retry_after_and_runs_nothing(model_dir):
    from leyline_agent.engine.engine import Engine
    from leyline_agent.server.app import create_app
    from leyline_agent.server.worker import Worker

    worker = Worker(Engine.from_pretrained(model_dir), queue_timeout_s=0.3)
    with (
        serve_in_thread(create_app(worker)) as srv,
        httpx.Client(base_url=srv.url, timeout=30) as c,
    ):
        name = model_dir.name
        before = _stats(c)
        body = {"model": name, "prompt": random_ids(203, 12), "max_tokens": 2}
        results: dict[str, httpx.Response] = {}

        def send(key: str, **extra) -> None:
            results[key] = httpx.post(
                f"{srv.url}/v1/completions", json={**body, **extra}, timeout=30
            )

        with busy(worker):
            threads = [
                threading.Thread(target=send, args=("plain",)),
                threading.Thread(target=send, args=("stream",), kwargs={"stream": True}),
            ]
            for t in threads:
                t.start()
            time.sleep(0.8)  # both wait in the queue past the timeout
        for t in threads:
            t.join(30)
        for key in ("plain", "stream"):
            r = results[key]
            err = _error(r, 503, None)
            assert err["leyline_type"] == "QueueTimeoutError", err
            assert int(r.headers["retry-after"]) >= 1
        assert _stats(c) == before  # nothing ran
        r = c.post("/v1/completions", json=body)
        assert (
            r.status_code == 200
            and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        )
    worker.close()


def _abandon(url: str, path: str, body: dict, after: float = 0.5) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}{path}", json=body, timeout=httpx.Timeout(30, read=after))


def test_an_abandoned_queued_request_never_runs(served):
    c, worker, name, srv = served
    P = random_ids(204, 20)
    before = _stats(c)
    with busy(worker):
        _abandon(srv.url, "/v1/completions", {"model": name, "prompt": P, "max_tokens": 2})
        chat = {"model": name, "messages": [{"role": "user", "content": "queued"}], "max_tokens": 2}
        _abandon(srv.url, "/v1/chat/completions", chat)
        time.sleep(0.2)  # the server sees the disconnects while the jobs are queued
    idle(worker)
    assert _stats(c) == before
    r = c.post("/v1/completions", json={"model": name, "prompt": P, "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_an_abandoned_running_generation_stops_and_is_not_cached(model_dir):
    """Without the cap: a long answer, on a server of its own."""
    from leyline_agent.engine.engine import Engine
    from leyline_agent.server.app import create_app
    from leyline_agent.server.worker import Worker
    from leyline_agent.testing.slow_engine import SlowTokens

    # 10 ms a token: its answer to the prompt below (about 470 tokens, then a stop token) takes
    # seconds on any machine, so the request is surely running when its client leaves
    worker = Worker(SlowTokens(Engine.from_pretrained(model_dir), 0.01))
    with (
        serve_in_thread(create_app(worker)) as srv,
        httpx.Client(base_url=srv.url, timeout=60) as c,
    ):
        name = model_dir.name
        P = random_ids(205, 30)
        before = _stats(c)
        body = {"model": name, "prompt": P, "max_tokens": 4000, "temperature": 0}
        _abandon(srv.url, "/v1/completions", body, after=1.0)  # running for a while by then
        t = time.monotonic()
        idle(worker)
        assert time.monotonic() - t < 10  # stopped at its next token, not run to 4000
        assert _stats(c) == before  # not counted
        r = c.post("/v1/completions", json={**body, "max_tokens": 1})
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # not cached
    worker.close()


def test_an_abandoned_queued_directive_is_not_executed(served):
    c, worker, name, srv = served
    T = random_ids(206, 30)
    c.post("/v1/completions", json={"model": name, "prompt": T, "max_tokens": 1})
    d = {"tokens": T, "directives": [{"start": 4, "end": 9, "replacement": [11, 12]}]}
    before = _stats(c)
    with busy(worker):
        _abandon(srv.url, "/leyline/v1/directives", d)
        time.sleep(0.2)
    idle(worker)
    assert _stats(c) == before
    r = c.post("/leyline/v1/directives", json=d)  # T is still cached: the splice was never made
    assert r.status_code == 200 and r.json()["splices"]["amortize"] == 1


def test_a_retried_request_id_executes_once(served):
    c, _, name, srv = served
    T = random_ids(207, 30)
    c.post("/v1/completions", json={"model": name, "prompt": T, "max_tokens": 1})
    d = {"start": 3, "end": 8, "replacement": [21, 22, 23]}
    body = {"tokens": T, "directives": [d], "request_id": "retry-1"}
    before = _stats(c)["splices"]["amortize"]
    answers: list[httpx.Response] = []

    def send() -> None:
        answers.append(httpx.post(f"{srv.url}/leyline/v1/directives", json=body, timeout=30))

    threads = [threading.Thread(target=send) for _ in range(3)]  # concurrent retries
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    answers.append(c.post("/leyline/v1/directives", json=body))  # a later retry
    assert [r.status_code for r in answers] == [200] * 4
    assert all(r.json() == answers[0].json() for r in answers)
    assert answers[0].json()["tokens"] == T[:3] + [21, 22, 23] + T[8:]
    assert _stats(c)["splices"]["amortize"] == before + 1

    other = {**body, "directives": [{**d, "replacement": [24]}]}
    _error(c.post("/leyline/v1/directives", json=other), 400, "request_id")
    assert _stats(c)["splices"]["amortize"] == before + 1
    # a new id on the new base is a new request
    body2 = {"tokens": answers[0].json()["tokens"], "directives": [d], "request_id": "retry-2"}
    assert c.post("/leyline/v1/directives", json=body2).status_code == 200
    assert _stats(c)["splices"]["amortize"] == before + 2
    _error(c.post("/leyline/v1/directives", json={**body, "request_id": ""}), 400, "request_id")
