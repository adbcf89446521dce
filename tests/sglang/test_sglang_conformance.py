"""The directive cases of the conformance suite on ``leyline serve`` and the SGLang plugin's
route side by side: the same bodies get the same answers, because both mount one
``directives.service.DirectiveService``.

``leyline serve``: an ``Engine`` on the tiny DeepSeek-V2 checkpoint behind real HTTP
(``serve_in_thread``). SGLang: the plugin's routes (``http_route.add_routes``) on a FastAPI
app, over SGLang's real radix cache, allocator and MLA pool on CPU
(``testing.sglang_pools.LoopbackEngine``: the scheduler's RPC handling under the plugin's
hook, prefills by the same model). Both take prompts of at most ``LIMIT`` tokens.

Cases: bad bodies (a 4xx naming the same field, with the same type), ``request_id`` reuse,
the size limits, a flush, a batch refused by one of its directives (the cache bitwise unchanged, no
counter but ``directive_errors`` moved, and that one only for a miss), and a verb added
through its mode rule alone, refused by name by both until a backend implements its row
operation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient

from leyline_agent import edits
from leyline_agent.directives import modes
from leyline_agent.directives.core import Mode
from leyline_agent.directives.flush import FlushResponse
from leyline_agent.testing import sglang_pools as sp
from leyline_agent.testing.server import serve_in_thread

LIMIT = 64
SERVERS = ["leyline", "sglang"]


@dataclass
class Side:
    name: str
    http: Any  # httpx.Client or TestClient: .post / .get
    cache: Callable[[list[int]], None]  # make the tokens cached (exact rows, anonymous)
    state: Callable[[], Any]  # the cache's bytes and structure
    same: Callable[[Any, Any], None]  # assert two states are bitwise equal

    def directive(self, body: Any, session: str | None = None) -> httpx.Response:
        headers = {"X-Leyline-Session": session} if session else {}
        return self.http.post("/leyline/v1/directives", json=body, headers=headers)

    def stats(self) -> dict[str, Any]:
        r = self.http.get("/leyline/v1/stats")
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture(scope="module")
def engine(model_dir):
    from leyline_agent.engine.engine import Engine

    return Engine.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def leyline(engine, name):
    with serve_in_thread(engine, max_prompt_tokens=LIMIT) as srv:
        with httpx.Client(base_url=srv.url, timeout=120) as http:

            def cache(tokens: list[int]) -> None:
                body = {"model": name, "prompt": tokens, "max_tokens": 1}
                assert http.post("/v1/completions", json=body).status_code == 200

            def state() -> Any:
                pool = engine.pool
                return engine.cache.total_tokens, pool.keys.clone(), pool.values.clone()

            def same(a: Any, b: Any) -> None:
                assert a[0] == b[0]
                torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)
                torch.testing.assert_close(a[2], b[2], rtol=0, atol=0)

            yield Side("leyline", http, cache, state, same)


@pytest.fixture(scope="module")
def sglang(model_dir, name):
    from leyline_agent.engine.engine import Engine
    from leyline_agent.sglang_plugin.http_route import SGLangRoute, add_routes

    model = Engine.from_pretrained(model_dir)  # its own weights' copy: only its model runs
    loop = sp.LoopbackEngine(model.model, model.tokenizer, size=1024)
    loop.tokenizer_manager.served_model_name = name
    loop.tokenizer_manager.context_len = LIMIT

    class LoopRoute(SGLangRoute):
        async def round_trip(self, req: Any) -> Any:  # the RPC socket: one scheduler rank
            return loop.handle_rpc(req)

    app = FastAPI()
    add_routes(app, LoopRoute(loop.tokenizer_manager, "ipc://unused"))
    with TestClient(app) as http:
        yield Side(
            "sglang",
            http,
            lambda tokens: sp.prefill(loop.cache, model.model, tokens),
            lambda: sp.snapshot(loop.cache),
            lambda a, b: b.assert_equal(a),
        )
    loop.close()


@pytest.fixture(params=SERVERS)
def side(request) -> Side:
    return request.getfixturevalue(request.param)


def _tokens(seed: int, n: int = 40) -> list[int]:
    from leyline_agent.testing.token_ids import random_ids

    return random_ids(seed, n)


T = _tokens(1)
D = {"start": 4, "end": 9, "replacement": [21, 22]}
BAD: list[tuple[Any, int, str, str | None]] = [  # body, status, error type, field
    ({"tokens": T}, 400, "ValidationError", None),  # a model-level check: no one field
    ({"tokens": T, "directives": [{**D, "end": 90}]}, 400, "DirectiveError", "directives[0].end"),
    ({"tokens": T, "directives": [D, {**D, "start": 6, "end": 12}]}, 400, "DirectiveError",
     "directives[1]"),
    ({"tokens": T, "directives": [{**D, "mode": "decay"}]}, 400, "UnsupportedModeError",
     "directives[0].mode"),
    ({"tokens": T, "directives": [D], "request_id": ""}, 400, "RequestError", "request_id"),
    ({"tokens": T, "directives": [D], "request_id": "x" * 300}, 400, "RequestError", "request_id"),
    ({"tokens": T, "directives": [D], "model": "no-such-model"}, 404, "ModelNotFoundError",
     "model"),
    ({"tokens": [*T[:-1], 10**9], "directives": [D]}, 400, "RequestError", "tokens[39]"),
    ({"tokens": T, "directives": [{**D, "replacement": [10**9]}]}, 400, "RequestError",
     "directives[0].replacement[0]"),
    ({"tokens": T, "directives": [D], "session": ""}, 400, "RequestError", "session"),
    ({"tokens": _tokens(2, LIMIT + 1), "directives": [D]}, 400, "RequestError", "tokens"),
    ({"tokens": T, "directives": [{**D, "replacement": [5] * (LIMIT + 1)}]}, 400, "RequestError",
     "directives[0].replacement"),
    ({"tokens": T, "directives": [{**D, "replacement": [5] * (LIMIT - 30)}]}, 400,
     "RequestError", "directives"),
]  # fmt: skip


def _error(r: httpx.Response) -> dict[str, Any]:
    err = r.json()["error"]
    assert err["param"] == err["field"], err
    return err


@pytest.mark.parametrize("i", range(len(BAD)))
def test_bad_bodies_get_the_same_4xx_naming_the_same_field(leyline, sglang, i):
    body, status, type_, field = BAD[i]
    answers = [s.directive(body) for s in (leyline, sglang)]
    a, b = (_error(r) for r in answers)
    assert answers[0].status_code == answers[1].status_code, (a, b)
    assert (a["leyline_type"], a["field"], a["type"]) == (b["leyline_type"], b["field"], b["type"])
    assert (answers[0].status_code, a["leyline_type"], a["field"]) == (status, type_, field), a


RAW_BAD: list[tuple[bytes, str, str]] = [  # a body the guards refuse: type, field
    (b'{"tokens": [1, 2', "ValidationError", "body[16]"),  # not JSON
    (b'{"tokens": ' + b"[" * 200 + b"]" * 200 + b"}", "RequestError", "body"),  # too deep
    (b'{"tokens": [1], "directives": [], "session": "\\ud800"}', "RequestError", "session"),
    (b'{"tokens": [1], "directives": [], "request_id": NaN}', "RequestError", "request_id"),
]


@pytest.mark.parametrize("i", range(len(RAW_BAD)))
def test_the_http_guards_refuse_a_bad_body_alike(leyline, sglang, i):
    """One set of HTTP guards (``http.guards``): a body that is not JSON, too deep, with a
    lone surrogate or a non-finite number gets the same 400 naming the same field."""
    raw, type_, field = RAW_BAD[i]
    headers = {"Content-Type": "application/json"}
    answers = [s.http.post("/leyline/v1/directives", content=raw, headers=headers)
               for s in (leyline, sglang)]  # fmt: skip
    a, b = (_error(r) for r in answers)
    assert [r.status_code for r in answers] == [400, 400], (a, b)
    assert (a["leyline_type"], a["field"]) == (b["leyline_type"], b["field"]) == (type_, field)


def test_repair_is_refused_by_name_where_its_row_operation_is_missing(sglang):
    r = sglang.directive({"tokens": T, "directives": [{**D, "mode": "repair"}]})
    err = _error(r)
    assert (r.status_code, err["leyline_type"]) == (400, "UnsupportedModeError"), err
    assert "'repair' is not executed by this server" in err["message"]


def test_a_refused_batch_leaves_the_cache_bitwise_unchanged(side):
    """A batch whose one directive is refused runs none of them: a bad id, an overlap (400),
    a span past the cached prefix (409); only the miss counts as a directive error."""
    t = _tokens(3)
    side.cache(t)
    stats, before = side.stats(), side.state()
    right = {"start": 30, "end": 34, "replacement": [7, 8, 9]}
    for bad, status in [
        ({"start": 4, "end": 9, "replacement": [10**9]}, 400),
        ({"start": 28, "end": 31, "replacement": [7]}, 400),
    ]:
        r = side.directive({"tokens": t, "directives": [right, bad]})
        assert r.status_code == status, r.text
    never = t[:20] + _tokens(4, 20)  # cached through 20 only
    r = side.directive({"tokens": never, "directives": [{**right, "start": 2, "end": 5}, right]})
    assert r.status_code == 409 and _error(r)["field"] == "directives[1]", r.text
    side.same(before, side.state())
    assert side.stats() == {**stats, "directive_errors": stats["directive_errors"] + 1}
    ok = side.directive({"tokens": t, "directives": [right, D]})  # the same batch, all good
    assert ok.status_code == 200 and ok.json()["splices"]["amortize"] == 2, ok.text


def test_request_id_reuse_is_the_same_on_both(side):
    t = _tokens(5)
    side.cache(t)
    body = {"tokens": t, "directives": [D], "request_id": "rid-1"}
    n = side.stats()["splices"]["amortize"]
    first = side.directive(body, session="rid")
    assert first.status_code == 200, first.text
    assert first.json()["tokens"] == t[:4] + [21, 22] + t[9:]
    again = side.directive(body, session="rid")
    assert again.status_code == 200 and again.json() == first.json()
    other = side.directive({**body, "directives": [{**D, "replacement": [23]}]}, session="rid")
    assert other.status_code == 400 and _error(other)["field"] == "request_id", other.text
    assert side.stats()["splices"]["amortize"] == n + 1  # the retry did not run again
    elsewhere = side.directive(body, session="rid-other")  # a new id in another namespace
    assert elsewhere.status_code == 200, elsewhere.text
    assert side.stats()["splices"]["amortize"] == n + 2


def test_a_verb_added_by_its_rule_alone_is_refused_by_name(leyline, sglang, monkeypatch):
    """DECAY given a rule (its tail's row operation "decay") and let through the wire: every
    server still refuses it by name, as no backend implements "decay"; no other mode's path
    runs it."""
    monkeypatch.setitem(modes.RULES, Mode.DECAY, modes.ModeRule(Mode.DECAY, "decay", False))
    monkeypatch.setattr(edits, "RESERVED_MODES", frozenset({Mode.PIN, Mode.SCRATCH}))
    for s in (leyline, sglang):
        t = _tokens(6)
        s.cache(t)
        stats, before = s.stats(), s.state()
        r = s.directive({"tokens": t, "directives": [{**D, "mode": "decay"}]})
        err = _error(r)
        assert (r.status_code, err["leyline_type"], err["field"]) == (
            400, "UnsupportedModeError", "directives[0].mode"
        ), (s.name, err)  # fmt: skip
        assert "'decay' is not executed by this server" in err["message"], err
        s.same(before, s.state())
        assert s.stats() == stats


def test_a_flush_forgets_alike(side):
    """``POST /leyline/v1/flush``: the same answer fields; the rows are gone (a directive
    on them is a miss), no request held any, and no counter moved but that miss."""
    t = _tokens(7)
    side.cache(t)
    stats = side.stats()
    r = side.http.post("/leyline/v1/flush")
    assert r.status_code == 200, r.text
    j = r.json()
    assert set(j) == set(FlushResponse.model_fields), j
    assert j["flushed_tokens"] >= len(t) - 1 and j["kept_tokens"] == 0, j
    miss = side.directive({"tokens": t, "directives": [D]})
    assert miss.status_code == 409, miss.text
    after = side.stats()
    assert (after["splices"], after["fallbacks"], after["directive_errors"]) == (
        stats["splices"], stats["fallbacks"], stats["directive_errors"] + 1
    )  # fmt: skip
