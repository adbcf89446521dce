"""``vllm serve --api-key`` with the plugin, over plain HTTP: what a client without the key,
or with hostile input, gets from the Leyline routes.

- every Leyline route is 401 without the key (vLLM itself guards only ``/v1`` and a few other
  prefixes), with ``leyline serve``'s error body, and nothing is applied;
- a client's own ``cache_salt`` starting with ``leyline-`` is refused;
- bad input is a 4xx naming the field, never a 5xx: deeply nested JSON, lone surrogates in a
  text replacement or in message content;
- ``request_id``: a retry gets the first answer, another body under the id is a 400, and
  another session's id is simply a new id (never "already used");
- a 40 MB body is a 413 within seconds, with and without ``Content-Length``;
- ``/leyline/v1/flush`` frees the cache (the next request is a full prefill).

One server for the module (tiny llama, block 32, 1 GiB of KV cache).
"""

from __future__ import annotations

import random
import time

import httpx
import pytest
import vllm  # noqa: F401  (this folder needs the vLLM venv)

from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.testing.server import serve_vllm

KEY = "sk-test-leyline"
BLOCK = 32
ROUTES = [
    ("GET", "/leyline/v1/stats"),
    ("POST", "/leyline/v1/directives"),
    ("POST", "/leyline/v1/flush"),
]


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 5990) for _ in range(n)]


@pytest.fixture(scope="module")
def srv():
    with serve_vllm(
        tiny_model_dir("llama"), block_size=BLOCK, kv_cache_gib=1, extra_args=["--api-key", KEY]
    ) as s:
        yield s


@pytest.fixture(scope="module")
def c(srv):
    with httpx.Client(
        base_url=srv.url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}
    ) as client:
        yield client


def _complete(c: httpx.Client, srv, prompt: list[int], session: str | None = None) -> int:
    headers = {"X-Leyline-Session": session} if session else {}
    r = c.post(
        "/v1/completions",
        json={"model": srv.model, "prompt": prompt, "max_tokens": 1, "temperature": 0},
        headers=headers,
    )
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _error(r: httpx.Response, status: int, field: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["field"] == field and err["param"] == field, err
    return err


@pytest.mark.parametrize("auth", [None, "Bearer wrong-key", "Basic " + KEY, f"Bearer{KEY}"])
def test_every_leyline_route_is_401_without_the_key(srv, c, auth):
    t = ids(1, 3 * BLOCK + 1)
    _complete(c, srv, t)
    before = c.get("/leyline/v1/stats").json()
    body = {"tokens": t, "directives": [{"start": 5, "end": 9, "replacement": [7]}]}
    headers = {"Authorization": auth} if auth else {}
    problem = "the API key is not valid" if auth == "Bearer wrong-key" else (
        "missing 'Authorization: Bearer <key>'"
    )  # fmt: skip
    for method, path in ROUTES:
        r = httpx.request(method, srv.url + path, json=body, headers=headers, timeout=30)
        assert r.status_code == 401, (path, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.json() == {  # leyline serve's body, as its tests see it
            "error": {
                "message": f"authorization: {problem}",
                "type": "authentication_error",
                "leyline_type": "AuthenticationError",
                "param": "authorization",
                "code": "invalid_api_key",
                "field": "authorization",
            }
        }, path
    after = c.get("/leyline/v1/stats").json()
    assert after["splices"] == before["splices"]  # the directive was not applied
    assert _complete(c, srv, t) == 3 * BLOCK  # nor the flush: T is still cached


def test_the_routes_answer_with_the_key(c):
    assert c.get("/leyline/v1/stats").status_code == 200
    r = c.get("/leyline/v1/stats", headers={"Authorization": f"bearer  {KEY}"})
    assert r.status_code == 200, r.text


def test_a_client_salt_starting_with_leyline_is_refused(srv, c):
    for path, body in [
        ("/v1/completions", {"model": srv.model, "prompt": [5, 6, 7], "max_tokens": 1}),
        ("/v1/chat/completions", {"model": srv.model, "max_tokens": 1,
                                  "messages": [{"role": "user", "content": "hi"}]}),
    ]:  # fmt: skip
        r = c.post(path, json={**body, "cache_salt": "leyline-mine"})
        _error(r, 400, "cache_salt")
        ok = c.post(path, json={**body, "cache_salt": "mine"})  # any other salt is the client's
        assert ok.status_code == 200, ok.text


def _raw(c: httpx.Client, path: str, raw: bytes) -> httpx.Response:
    return c.post(path, content=raw, headers={"content-type": "application/json"})


def test_deeply_nested_json_is_a_400_and_the_connection_stays_usable(c):
    for raw in [
        b"[" * 100_000 + b"]" * 100_000,
        b'{"tokens": ' + b"[" * 3000 + b"]" * 3000 + b', "directives": []}',
        b'{"tokens": [1, 2], "directives": [{"start": 0, "end": 1, "replacement": '
        + b'{"a": ' * 500 + b"1" + b"}" * 500 + b"}]}",
    ]:
        _error(_raw(c, "/leyline/v1/directives", raw), 400, "body")
        assert c.get("/leyline/v1/stats").status_code == 200  # same keep-alive connection


def test_lone_surrogates_are_a_400_naming_the_field(c):
    cases = [
        (b'{"tokens": [1, 2, 3], "directives": [{"start": 0, "end": 1, "replacement": '
         b'"ab\\ud800c"}]}', "directives[0].replacement"),
        (b'{"old_messages": [{"role": "user", "content": "hi"}], "new_messages": '
         b'[{"role": "user", "content": "h\\udfffi"}]}', "new_messages[0].content"),
        (b'{"old_messages": [{"role": "user", "content": [{"type": "text", "text": '
         b'"\\ud83d"}]}], "new_messages": [{"role": "user", "content": "hi"}]}',
         "old_messages[0].content[0].text"),
    ]  # fmt: skip
    for raw, field in cases:
        err = _error(_raw(c, "/leyline/v1/directives", raw), 400, field)
        assert "surrogate" in err["message"]


def test_bad_input_is_never_a_5xx(srv, c):
    t = ids(2, 2 * BLOCK)
    bodies: list[bytes | dict] = [
        b"", b"{", b"nope", b"null", b"[]", b'"x"', b"\xff\xfe", b'{"tokens": NaN}',
        b'{"tokens": [1e400], "directives": []}',
        {}, {"tokens": t}, {"tokens": t, "directives": [{"start": 9, "end": 3, "replacement": []}]},
        {"tokens": [-1], "directives": []}, {"tokens": [10**30], "directives": []},
        {"tokens": t, "directives": [{"start": 0, "end": 1, "replacement": [1], "mode": "pin"}]},
        {"tokens": t, "directives": [], "request_id": ""},
        {"tokens": t, "directives": [], "request_id": "x" * 300},
        {"tokens": t, "directives": [], "session": ""},
        {"tokens": t, "directives": [], "model": "other"},
        {"old_messages": [{"role": "nobody"}], "new_messages": []},
        {"old_messages": "x", "new_messages": None},
    ]  # fmt: skip
    for b in bodies:
        r = _raw(c, "/leyline/v1/directives", b) if isinstance(b, bytes) else c.post(
            "/leyline/v1/directives", json=b
        )  # fmt: skip
        assert 400 <= r.status_code < 500, (b if isinstance(b, bytes) else str(b)[:80], r.text)
        assert set(r.json()["error"]) >= {"message", "type", "param", "code", "field"}
    r = c.post("/leyline/v1/directives", json={"tokens": t, "directives": []},
               headers={"X-Leyline-Session": "\x01"})  # fmt: skip
    assert r.status_code == 400, r.text


def test_request_id_is_per_session_and_tied_to_the_body(srv, c):
    t = ids(3, 4 * BLOCK)
    _complete(c, srv, t)
    d = {"start": 10, "end": 20, "replacement": [11, 12, 13]}
    body = {"tokens": t, "directives": [d], "request_id": "rid-1"}
    first = c.post("/leyline/v1/directives", json=body, headers={"X-Leyline-Session": "a"})
    assert first.status_code == 200, first.text
    assert first.json()["tokens"] == t[:10] + [11, 12, 13] + t[20:]
    n = c.get("/leyline/v1/stats").json()["splices"]["amortize"]

    again = c.post("/leyline/v1/directives", json=body, headers={"X-Leyline-Session": "a"})
    assert again.status_code == 200 and again.json() == first.json()  # the first answer
    other = {**body, "directives": [{**d, "replacement": [14]}]}
    _error(
        c.post("/leyline/v1/directives", json=other, headers={"X-Leyline-Session": "a"}),
        400, "request_id",
    )  # fmt: skip
    assert c.get("/leyline/v1/stats").json()["splices"]["amortize"] == n  # nothing ran

    # another session: the same id is a new id there (its own answer, never "already used")
    b = c.post("/leyline/v1/directives", json=other, headers={"X-Leyline-Session": "b"})
    assert b.status_code == 200, b.text
    assert b.json()["tokens"] == t[:10] + [14] + t[20:]
    assert c.get("/leyline/v1/stats").json()["splices"]["amortize"] == n + 1
    # the session named in the body is the same namespace as the header's
    same = c.post("/leyline/v1/directives", json={**other, "session": "b"})
    assert same.status_code == 200 and same.json() == b.json()


def test_a_40_mb_body_is_a_413_within_seconds(srv, c):
    big = b'{"tokens": [' + b"1," * (20 * 1000 * 1000) + b'1], "directives": []}'
    assert len(big) > 40 * 1000 * 1000
    for path in ("/leyline/v1/directives", "/v1/completions"):
        t0 = time.monotonic()
        r = _raw(c, path, big)
        assert time.monotonic() - t0 < 5
        err = _error(r, 413, "body")
        assert (err["type"], err["leyline_type"]) == ("invalid_request_error", "PayloadTooLargeError")

    def chunks():  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 1 << 20):
            yield big[i : i + (1 << 20)]

    t0 = time.monotonic()
    try:
        r = c.post("/leyline/v1/directives", content=chunks(),
                   headers={"content-type": "application/json"})  # fmt: skip
        _error(r, 413, "body")
    except httpx.WriteError:  # the server answered and closed before the whole upload
        pass
    assert time.monotonic() - t0 < 10
    assert c.get("/leyline/v1/stats").status_code == 200


def test_flush_frees_the_cache(srv, c):
    t = ids(4, 3 * BLOCK + 1)
    _complete(c, srv, t)
    assert _complete(c, srv, t) == 3 * BLOCK
    before = c.get("/leyline/v1/stats").json()
    r = c.post("/leyline/v1/flush")
    assert r.status_code == 200, r.text
    j = r.json()
    assert set(j) == {"tenant", "flushed_tokens", "kept_tokens", "dropped_pins",
                      "dropped_conversations", "dropped_responses"}  # fmt: skip
    assert j["flushed_tokens"] >= 3 * BLOCK and j["kept_tokens"] == 0
    assert j["dropped_responses"] == 0  # vLLM's own Responses store is not the plugin's
    assert _complete(c, srv, t) == 0  # a full prefill again
    after = c.get("/leyline/v1/stats").json()
    assert after["splices"] == before["splices"] and after["requests"] == before["requests"] + 1
    _error(c.post("/leyline/v1/flush", json={"tenant": "x"}), 400, "body")
