"""``request_id`` answers are per namespace (tenant and session), over real HTTP.

Within a session a retry gets the first answer and another body under the id is a 400
naming ``request_id``. Another session (or tenant) reusing the id gets a new request: its
own answer, executed, never "already used" (which would tell it that the id exists) and
never the first session's answer (its token sequence). Executions are read from the
server's counters; expected token sequences are built here from the directive.
"""

from __future__ import annotations

import httpx
import pytest

from leyline_agent.directives.idempotence import RequestMemory
from leyline_agent.testing.server import serve_in_thread
from leyline_agent.testing.token_ids import random_ids

KEYS = {"A": "key-tenant-a", "B": "key-tenant-b"}


@pytest.fixture(scope="module")
def url(model_dir):
    from leyline_agent.engine.engine import Engine
    from leyline_agent.server.app import create_app

    app = create_app(Engine.from_pretrained(model_dir), api_keys=[(k, t) for t, k in KEYS.items()])
    with serve_in_thread(app) as srv:
        yield srv.url


def _client(url: str, tenant: str = "A", session: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    if session is not None:
        headers["X-Leyline-Session"] = session
    return httpx.Client(base_url=url, headers=headers, timeout=60)


def _amortizes(c: httpx.Client) -> int:
    return c.get("/leyline/v1/stats").json()["splices"]["amortize"]


def _cache(c: httpx.Client, name: str, t: list[int]) -> None:
    r = c.post("/v1/completions", json={"model": name, "prompt": t, "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_a_request_id_is_per_session(url, name):
    t = random_ids(301, 40)
    d = {"start": 4, "end": 9, "replacement": [21, 22]}
    body = {"tokens": t, "directives": [d], "request_id": "shared-id"}
    other = {**body, "directives": [{**d, "replacement": [23]}]}
    with _client(url, session="s1") as s1, _client(url, session="s2") as s2:
        _cache(s1, name, t)
        n = _amortizes(s1)
        first = s1.post("/leyline/v1/directives", json=body)
        assert first.status_code == 200, first.text
        assert first.json()["tokens"] == t[:4] + [21, 22] + t[9:]
        retry = s1.post("/leyline/v1/directives", json=body)
        assert retry.status_code == 200 and retry.json() == first.json()
        assert _amortizes(s1) == n + 1  # the retry did not run again

        r = s1.post("/leyline/v1/directives", json=other)
        assert r.status_code == 400 and r.json()["error"]["field"] == "request_id", r.text
        assert _amortizes(s1) == n + 1

        # another session: the id is new there; its own body runs and gets its own answer
        r = s2.post("/leyline/v1/directives", json=other)
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == t[:4] + [23] + t[9:]
        assert _amortizes(s1) == n + 2
        # the same body as the first session's: executed again, not handed s1's answer
        r = s2.post("/leyline/v1/directives", json={**body, "request_id": "s1-only"})
        assert r.status_code == 200, r.text
        # the body's session field is the same namespace as the header's
        r = s2.post("/leyline/v1/directives", json={**other, "session": "s2"})
        assert r.status_code == 200 and r.json()["tokens"] == t[:4] + [23] + t[9:]


def test_the_anonymous_session_and_other_tenants_are_namespaces_of_their_own(url, name):
    t = random_ids(302, 40)
    d = {"start": 2, "end": 6, "replacement": [31]}
    body = {"tokens": t, "directives": [d], "request_id": "id-x"}
    with _client(url, session="named") as named, _client(url) as anon, _client(url, "B") as b:
        for c in (named, b):
            _cache(c, name, t)
        assert named.post("/leyline/v1/directives", json=body).status_code == 200
        moved = {**body, "directives": [{**d, "replacement": [32]}]}
        for c in (anon, b):  # the id is new in each: no 400, each body runs
            r = c.post("/leyline/v1/directives", json=moved)
            assert r.status_code == 200, r.text
            assert r.json()["tokens"] == t[:2] + [32] + t[6:]


def test_the_memory_is_bounded_per_namespace_and_in_all():
    m: RequestMemory[int] = RequestMemory(per_namespace=3, total=5)
    for i in range(4):
        m.remember("ns-a", f"r{i}", "d", i)
    assert m.lookup("ns-a", "r0", "d") is None  # the oldest of ns-a left
    assert [m.lookup("ns-a", f"r{i}", "d") for i in (1, 2, 3)] == [1, 2, 3]
    for i in range(3):
        m.remember("ns-b", f"r{i}", "d", 10 + i)
    assert len(m) == 5
    assert m.lookup("ns-a", "r1", "d") is None  # least recently used in all
    assert m.lookup("ns-b", "r2", "d") == 12
    assert m.lookup("ns-c", "r2", "other") is None  # another namespace: a new id
    with pytest.raises(ValueError, match="request_id"):
        m.lookup("ns-b", "r2", "other")
