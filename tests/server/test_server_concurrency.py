"""The server with several worker threads: concurrent streams, a client that leaves, bad
input while others run, per-session order, queue timeout, request-id de-duplication.

A real ``Engine`` on the tiny model behind the real app on loopback, real ``openai`` /
``httpx`` clients. The engine is wrapped so that each token reaches its client 10 ms late
(``testing.slow_engine.SlowTokens``, as in ``test_server_limits``): a stream is then surely
still running when the test acts on it. Ground truths: Hugging Face greedy decoding by full recomputation
(``hf_greedy``) for every answer; for "changes nothing", the tree, the pool rows it points
at, node locks and the counters, read between two steps through the engine's own lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import numpy as np
import openai
import pytest
import torch

from leyline_agent.namespaces import Namespace
from leyline_agent.reference.hf_reference import hf_greedy
from leyline_agent.testing.server import serve_in_thread
from leyline_agent.testing.slow_engine import SlowTokens
from leyline_agent.testing.token_ids import random_ids

pytestmark = pytest.mark.slow

THREADS = 8
DELAY_S = 0.01


@pytest.fixture(scope="module")
def served(model_dir):
    """(engine, worker, server) with ``THREADS`` worker threads."""
    from leyline_agent.engine.engine import Engine

    engine = Engine.from_pretrained(model_dir)
    with serve_in_thread(SlowTokens(engine, DELAY_S), concurrency=THREADS) as srv:
        worker = srv._server.config.app.state.leyline.worker
        assert worker.concurrency == THREADS
        yield engine, worker, srv


def _client(srv, session: str | None = None) -> openai.OpenAI:
    headers = {"X-Leyline-Session": session} if session else None
    return openai.OpenAI(
        base_url=srv.base_url, api_key="none", max_retries=0, timeout=120, default_headers=headers
    )


def _stream(srv, prompt, max_tokens, session=None, leave_after=None, marks=None):
    """Stream a greedy completion; (text, logprobs, usage). ``leave_after``: close the
    connection after that many content chunks. ``marks``: filled with the arrival times of
    the first and the last chunk."""
    parts = []
    stream = _client(srv, session).completions.create(
        model=srv_model(srv), prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=1,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    for p in stream:
        parts.append(p)
        if marks is not None:
            marks.setdefault("first", time.monotonic())
            marks["last"] = time.monotonic()
        if leave_after is not None and sum(1 for q in parts if q.choices) >= leave_after:
            stream.close()
            return None
    text = "".join(p.choices[0].text for p in parts if p.choices)
    lps = [
        x
        for p in parts
        if p.choices and p.choices[0].logprobs
        for x in p.choices[0].logprobs.token_logprobs
    ]
    return text, lps, parts[-1].usage


def srv_model(srv) -> str:
    return srv._server.config.app.state.leyline.model.id


def _truth(model_dir, stop_ids, prompt, n):
    g = hf_greedy(model_dir, prompt, n, stop_ids)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return tok.decode(g.token_ids, skip_special_tokens=True), g  # as the server sends it


def _in_threads(fns) -> list:
    """Run the callables at once (released together); their results, errors re-raised."""
    out: list = [None] * len(fns)
    errors: list[BaseException] = []
    start = threading.Barrier(len(fns))

    def run(k: int) -> None:
        try:
            start.wait(30)
            out[k] = fns[k]()
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    return out


@contextmanager
def _between_steps(engine) -> Iterator[None]:
    with engine.stepper.exclusive():
        yield


def _state(engine) -> dict:
    """What a bad request must not change, read between two steps: the tree (tokens,
    slots, tags), every node's lock count and access time, the pool rows the tree points
    at, the counters (a sequence still running changes none of them: it writes only its own
    fresh rows until it commits, and a commit would show in ``requests``). Leaked slots are
    seen once the engine is idle (``_wait_idle``)."""
    with _between_steps(engine):
        tree = engine.cache.tree.tagged_sequences()
        slots = sorted({s for _, ss, _ in tree for s in ss})
        return {
            "tree": tree,
            "nodes": [(n.last_access, n.lock_ref) for n in engine.cache.tree._nodes()],
            "rows": [r.clone() for r in engine.pool.snapshot(slots)],
            "stats": engine.stats().model_dump(),
        }


def _wait_idle(engine, timeout: float) -> float:
    """Seconds until no sequence runs and every used slot is the tree's."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        with _between_steps(engine):
            tree = {s for _, ss, _ in engine.cache.tree.tagged_sequences() for s in ss}
            if not engine.stepper.running and engine.allocator.num_used == len(tree):
                return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"the engine was still busy after {timeout}s")


def _stats(srv) -> dict:
    return httpx.get(f"{srv.url}/leyline/v1/stats", timeout=30).json()


# ---- tests -----------------------------------------------------------------------------
def test_concurrent_streams_each_get_what_they_get_alone(served, model_dir, stop_ids):
    engine, _, srv = served
    prompts = [random_ids(300 + k, 20 + 7 * k) for k in range(THREADS)]
    n = 24
    truths = [_truth(model_dir, stop_ids, p, n) for p in prompts]
    steps0 = engine.stepper.steps
    marks: list[dict] = [{} for _ in prompts]
    got = _in_threads(
        [lambda k=k: _stream(srv, prompts[k], n, marks=marks[k]) for k in range(THREADS)]
    )
    for k, ((text, lps, usage), (want, g)) in enumerate(zip(got, truths, strict=True)):
        assert text == want, k
        # the stop token is not counted (as OpenAI and vLLM count)
        assert usage.completion_tokens == len(g.token_ids) - g.stopped, k
        listed = g.logprobs[: len(g.token_ids) - g.stopped]  # nor is it listed
        np.testing.assert_allclose(lps, listed, atol=1e-4, err_msg=f"stream {k}")
    # they ran side by side, in shared steps: the last stream to start did so before the
    # longest had ended (a short answer may end before a late thread starts on a loaded
    # machine), and the engine took fewer steps than the streams one after another
    assert max(m["first"] for m in marks) < max(m["last"] for m in marks)
    assert engine.stepper.steps - steps0 < sum(len(g.token_ids) + 1 for _, g in truths)


def test_a_client_that_leaves_mid_stream_is_stopped_and_the_others_are_undisturbed(
    served, model_dir, stop_ids
):
    engine, _, srv = served
    leaver = random_ids(310, 24)
    assert not hf_greedy(model_dir, leaver, 20, stop_ids).stopped, "a prompt that runs on"
    stayers = [random_ids(311 + k, 30) for k in range(3)]
    n = 40
    truths = [_truth(model_dir, stop_ids, p, n) for p in stayers]
    _wait_idle(engine, 30)
    before = _stats(srv)
    fns = [lambda: _stream(srv, leaver, 3000, leave_after=2)]
    fns += [lambda k=k: _stream(srv, stayers[k], n) for k in range(3)]
    got = _in_threads(fns)
    assert got[0] is None
    for (text, lps, _), (want, g) in zip(got[1:], truths, strict=True):
        assert text == want
        np.testing.assert_allclose(lps, g.logprobs, atol=1e-4)
    # stopped at its next token: 3000 tokens would take 30 s at DELAY_S per token
    assert _wait_idle(engine, 10) < 10
    after = _stats(srv)
    assert after["requests"] == before["requests"] + 3  # the abandoned one never completed
    generated = sum(len(g.token_ids) for _, g in truths)
    assert after["generated_tokens"] == before["generated_tokens"] + generated
    assert after["cache_tokens"] == before["cache_tokens"] + sum(
        len(p) + len(g.token_ids) for p, (_, g) in zip(stayers, truths, strict=True)
    )  # its rows were freed, not cached
    r = _client(srv).completions.create(
        model=srv_model(srv), prompt=leaver, max_tokens=1, temperature=0
    )
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def _bad_directives(T: list[int], U: list[int]) -> list[tuple[dict, int]]:
    """(body, status): refused by the route (400) or by the engine (409: not cached)."""
    d = {"start": 2, "end": 5, "replacement": [7, 8]}
    return [
        ({"tokens": T, "directives": [{**d, "end": len(T) + 1}]}, 400),
        ({"tokens": T, "directives": [d, {"start": 3, "end": 6}]}, 400),
        ({"tokens": T, "directives": [{**d, "replacement": [10**7]}]}, 400),
        ({"tokens": T, "directives": [{**d, "mode": "summarize"}]}, 400),
        ({"tokens": U, "directives": [d]}, 409),  # nothing of U is cached
        ({"tokens": T + U, "directives": [{"start": len(T) + 2, "end": len(T) + 4}]}, 409),
        ({"old_messages": [{"role": "user", "content": "never seen"}],
          "new_messages": [{"role": "user", "content": "never"}]}, 409),
    ]  # fmt: skip


def test_bad_directives_while_others_stream_change_nothing(served, model_dir, stop_ids):
    engine, _, srv = served
    T, U = random_ids(320, 30), random_ids(321, 20)
    victim = _client(srv, "victim")
    victim.completions.create(model=srv_model(srv), prompt=T, max_tokens=1, temperature=0)
    probe = T + random_ids(322, 3)

    def ask():
        r = victim.completions.create(
            model=srv_model(srv), prompt=probe, max_tokens=3, temperature=0, logprobs=2
        )
        c = r.choices[0]
        return r.usage.prompt_tokens_details.cached_tokens, c.text, c.logprobs.token_logprobs

    ask()
    probe_before = ask()
    _wait_idle(engine, 30)
    others = [random_ids(323 + k, 25) for k in range(4)]
    n = 150  # 1.5 s of DELAY_S per stream: none commits while the bad requests go in
    truths = [_truth(model_dir, stop_ids, p, n) for p in others]
    results: list = [None] * len(others)
    marks: list[dict] = [{} for _ in others]
    threads = [
        threading.Thread(
            target=lambda k=k: results.__setitem__(
                k, _stream(srv, others[k], n, session=f"o{k}", marks=marks[k])
            )
        )
        for k in range(len(others))
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while not all("first" in m for m in marks) and time.monotonic() < deadline:
        time.sleep(0.01)
    before = _state(engine)
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        for body, status in _bad_directives(T, U):
            for session in ("victim", None):
                r = http.post("/leyline/v1/directives", json={**body, "session": session})
                assert r.status_code == status, (body, r.text)
                assert r.json()["error"]["message"], r.text
    after = _state(engine)
    misses = sum(2 for _, s in _bad_directives(T, U) if s == 409)
    assert after["stats"]["directive_errors"] == before["stats"]["directive_errors"] + misses
    after["stats"]["directive_errors"] = before["stats"]["directive_errors"]
    assert after["stats"] == before["stats"]
    assert after["tree"] == before["tree"] and after["nodes"] == before["nodes"]
    assert all(torch.equal(a, b) for a, b in zip(before["rows"], after["rows"], strict=True))
    for t in threads:
        t.join(120)
    _wait_idle(engine, 30)  # and no slot leaked: every used row is the tree's
    for (text, lps, _), (want, g) in zip(results, truths, strict=True):
        assert text == want
        np.testing.assert_allclose(lps, g.logprobs, atol=1e-4)
    assert ask() == probe_before  # the victim's cache: same hit, bitwise the same logprobs


def test_a_directive_and_a_generation_of_one_session_serialize_other_sessions_do_not(
    served, model_dir, stop_ids
):
    engine, _, srv = served
    T, R = random_ids(330, 30), random_ids(331, 30)
    n = 80
    want, g = _truth(model_dir, stop_ids, T, n)
    assert not g.stopped, "a prompt that runs on"
    s_client = _client(srv, "s")
    s_client.completions.create(model=srv_model(srv), prompt=T, max_tokens=1, temperature=0)
    _client(srv, "r").completions.create(
        model=srv_model(srv), prompt=R, max_tokens=1, temperature=0
    )
    _wait_idle(engine, 30)
    marks: dict = {}
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("s", _stream(srv, T, n, "s", marks=marks)))
    t.start()
    deadline = time.monotonic() + 30
    while "first" not in marks and time.monotonic() < deadline:
        time.sleep(0.005)
    d = {"start": 2, "end": 4, "replacement": [9]}
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        other = http.post(
            "/leyline/v1/directives", json={"tokens": R, "directives": [d], "session": "r"}
        )
        other_at = time.monotonic()
        mine = http.post(
            "/leyline/v1/directives",
            json={"tokens": T + g.token_ids, "directives": [d], "session": "s"},
        )
    t.join(60)
    assert other.status_code == mine.status_code == 200, (other.text, mine.text)
    assert other_at < marks["last"], "another session's directive waited for this stream"
    # this session's directive waited for its generation: it found the whole answer cached
    assert mine.json()["cached_base_tokens"] == len(T) + n
    assert out["s"][0] == want


def test_concurrent_retries_of_one_request_id_execute_once(served):
    _, _, srv = served
    T = random_ids(340, 30)
    _client(srv).completions.create(model=srv_model(srv), prompt=T, max_tokens=1, temperature=0)
    body = {
        "tokens": T,
        "directives": [{"start": 3, "end": 8, "replacement": [21, 22]}],
        "request_id": "concurrent-retry",
    }
    before = _stats(srv)["splices"]["amortize"]
    answers = _in_threads(
        [
            lambda: httpx.post(f"{srv.url}/leyline/v1/directives", json=body, timeout=60)
            for _ in range(THREADS)
        ]
    )
    assert [r.status_code for r in answers] == [200] * THREADS
    assert all(r.json() == answers[0].json() for r in answers)
    assert _stats(srv)["splices"]["amortize"] == before + 1


def _send_in_background(url: str, body: dict, headers: dict | None = None) -> tuple:
    out: dict = {}

    def send() -> None:
        out["r"] = httpx.post(url, json=body, headers=headers, timeout=60)

    t = threading.Thread(target=send)
    t.start()
    return t, out


def test_queue_timeout_with_several_threads_counts_from_arrival_to_start(model_dir):
    """The worker's contract (as with one thread): a job that waited past the timeout when
    a thread reaches it fails with 503 without running; waiting parked behind its own
    session's job counts too, and does not hold up other sessions."""
    from leyline_agent.engine.engine import Engine

    engine = Engine.from_pretrained(model_dir)
    with serve_in_thread(engine, concurrency=2, queue_timeout_s=0.3) as srv:
        worker = srv._server.config.app.state.leyline.worker
        url = f"{srv.url}/v1/completions"
        body = {"model": srv_model(srv), "prompt": random_ids(350, 12), "max_tokens": 2}
        before = _stats(srv)
        release = threading.Event()
        holds = [worker.submit(lambda e: release.wait(30)) for _ in range(2)]  # both threads
        time.sleep(0.1)
        sent = [_send_in_background(url, body), _send_in_background(url, {**body, "stream": True})]
        time.sleep(0.8)  # both wait in the queue past the timeout
        release.set()
        assert all(h.result(30) for h in holds)
        for t, out in sent:
            t.join(60)
            r = out["r"]
            assert r.status_code == 503, r.text
            assert r.json()["error"]["leyline_type"] == "QueueTimeoutError"
            assert int(r.headers["retry-after"]) >= 1
        assert _stats(srv) == before  # nothing ran

        release = threading.Event()
        hold = worker.submit(lambda e: release.wait(30), Namespace("", "busy"))
        time.sleep(0.05)
        t, parked = _send_in_background(url, body, {"X-Leyline-Session": "busy"})
        free = httpx.post(url, json=body, headers={"X-Leyline-Session": "free"}, timeout=30)
        assert free.status_code == 200, free.text  # a thread was free: runs at once
        time.sleep(0.5)
        assert t.is_alive()  # still parked behind "busy", although a thread is free
        release.set()
        t.join(60)
        assert hold.result(30) is True
        r = parked["r"]
        assert r.status_code == 503 and r.json()["error"]["leyline_type"] == "QueueTimeoutError", r.text
        again = httpx.post(url, json=body, headers={"X-Leyline-Session": "busy"}, timeout=30)
        assert again.status_code == 200, again.text


def test_serve_concurrency_flag(model_dir):
    from leyline_agent.cli import build_parser
    from leyline_agent.server.main import ArgumentError, build_app

    def app_of(*flags):
        args = build_parser().parse_args(["serve", "--model", str(model_dir), *flags])
        return build_app(args)

    for flags, want in (((), 16), (("--concurrency", "3"), 3)):  # 16: the default
        worker = app_of(*flags).state.leyline.worker
        assert worker.concurrency == want
        worker.close()
    with pytest.raises(ArgumentError, match="--concurrency"):
        app_of("--concurrency", "0")
    from leyline_agent.errors import LeylineError
    from leyline_agent.server.cli import _refuse_embedded_only

    sglang = ["serve", "--model", str(model_dir), "--engine", "sglang", "--concurrency", "4"]
    with pytest.raises(LeylineError, match="--concurrency"):  # SGLang's server would ignore it
        _refuse_embedded_only(build_parser().parse_args(sglang))
